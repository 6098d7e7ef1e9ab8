"""The model runner: turns one scheduled step into flat tensors, runs the model, returns logits."""

from .model_runner import ModelRunner

__all__ = ["ModelRunner"]
