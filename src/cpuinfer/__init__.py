"""cpuinfer: CPU-first LLM inference, with kernels picked for this CPU at import."""

from __future__ import annotations

from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

# torch first: it loads the OpenMP runtime whose threads the kernels share.
import torch as _torch  # noqa: F401

from ._dispatch import IsaError
from ._dispatch import select as _select
from .envs import EnvError

try:
    __version__ = _metadata.version("cpuinfer")
except _metadata.PackageNotFoundError:  # running from a tree that was never installed
    __version__ = "0+unknown"


def _run_by_cli() -> bool:
    import os
    import sys

    # argv[0] is "-m" while `python -m cpuinfer` is still importing the package.
    return os.path.basename(sys.argv[0]) == "cpuinfer" or sys.argv[0] == "-m"


try:
    _selection = _select()
except (IsaError, EnvError) as _exc:
    if _run_by_cli():  # the `cpuinfer` command: one clear line, no traceback
        import sys

        sys.stderr.write(f"cpuinfer: {_exc}\n")
        raise SystemExit(1) from None
    raise
_C = _selection.module

if TYPE_CHECKING:
    from .entrypoints.llm import LLM
    from .sampling_params import PoolingParams, SamplingParams, StructuredOutputsParams

# The engine is imported on first use so that `import cpuinfer` stays cheap.
_LAZY = {
    "LLM": ("cpuinfer.entrypoints.llm", "LLM"),
    "SamplingParams": ("cpuinfer.sampling_params", "SamplingParams"),
    "PoolingParams": ("cpuinfer.sampling_params", "PoolingParams"),
    "StructuredOutputsParams": ("cpuinfer.sampling_params", "StructuredOutputsParams"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'cpuinfer' has no attribute {name!r}")


def info() -> dict[str, Any]:
    """What was detected and chosen, and why (the object `cpuinfer info --json` prints)."""
    from ._info import collect

    return collect(_selection)


__all__ = [
    "LLM",
    "EnvError",
    "IsaError",
    "PoolingParams",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
    "info",
]
