"""The one error type the loader raises for bad model files or unsupported models (defined with the
other public errors in cpuinfer.errors)."""

from cpuinfer.errors import ModelLoadError

__all__ = ["ModelLoadError"]
