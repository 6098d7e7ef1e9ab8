"""The model runner: turns one scheduled step into flat tensors, runs the model, returns logits.

`ScheduledSeq`, what it runs, is defined in engine/step.py (a leaf the scheduler builds it from) and re-exported
here as the runner's input type."""

from ..engine.step import ScheduledSeq
from .model_runner import ModelRunner

__all__ = ["ModelRunner", "ScheduledSeq"]
