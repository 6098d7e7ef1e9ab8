"""Model implementations (plain tensors + our kernels) and the architecture registry."""

from .registry import ARCHITECTURES, build_model, describe

__all__ = ["ARCHITECTURES", "build_model", "describe"]
