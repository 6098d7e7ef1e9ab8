"""The one error type the loader raises for bad model files or unsupported models."""


class ModelLoadError(ValueError):
    """A model file is missing, corrupt, or describes something cpuinfer does not support."""
