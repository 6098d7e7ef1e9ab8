"""Every environment variable cpuinfer reads, in one place.

vLLM's CPU-backend names are honoured so existing deployment scripts work
unchanged; each also has a ``CPUINFER_`` spelling, which wins when both are
set. A malformed value raises :class:`EnvError` naming the variable and what
it accepts, never a silent default.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class EnvError(ValueError):
    """An environment variable holds a value cpuinfer cannot use."""


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One variable: its names (first wins), parser, default and meaning."""

    names: tuple[str, ...]
    parse: Callable[[str, str], T]
    default: T
    help: str

    def raw(self) -> tuple[str, str] | None:
        """The (name, value) actually set, if any, in order of precedence."""
        for name in self.names:
            value = os.environ.get(name)
            if value is not None and value.strip() != "":
                return name, value.strip()
        return None

    def get(self) -> T:
        """The parsed value, or the default when unset."""
        found = self.raw()
        if found is None:
            return self.default
        name, value = found
        return self.parse(name, value)


def parse_bool(name: str, value: str) -> bool:
    """1/0, true/false, yes/no, on/off (any case)."""
    v = value.lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise EnvError(f"{name}={value!r} is not a boolean; use 1 or 0 (true/false)")


def parse_positive_float(name: str, value: str) -> float:
    """A number > 0."""
    try:
        x = float(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not a number") from None
    if not x > 0 or x != x or x == float("inf"):
        raise EnvError(f"{name}={value!r} must be a positive, finite number")
    return x


def parse_nonneg_int(name: str, value: str) -> int:
    """An integer >= 0."""
    try:
        x = int(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not an integer") from None
    if x < 0:
        raise EnvError(f"{name}={value!r} must be >= 0")
    return x


def parse_positive_int(name: str, value: str) -> int:
    """An integer >= 1."""
    x = parse_nonneg_int(name, value)
    if x < 1:
        raise EnvError(f"{name}={value!r} must be >= 1")
    return x


def parse_str(name: str, value: str) -> str:  # noqa: ARG001 - every parser takes (name, value)
    """Any non-empty string."""
    return value


def _isa_name(name: str, value: str) -> str:
    v = value.strip().lower()
    if not v.replace("_", "").isalnum():
        raise EnvError(f"{name}={value!r} is not a variant name (letters, digits and '_', e.g. 'avx2')")
    return v


# Kernel selection and build.
ISA = EnvVar(("CPUINFER_ISA",), _isa_name, "", "Force a kernel variant (e.g. avx2); unset = best for this CPU.")
ISAS = EnvVar(("CPUINFER_ISAS",), parse_str, "native", "Variants a build compiles: native, all, or a comma list.")
AVX512BF16 = EnvVar(
    ("CPUINFER_CPU_AVX512BF16", "VLLM_CPU_AVX512BF16"),
    parse_bool,
    False,
    "Build the avx512bf16 variant even if the build host lacks it.",
)
MAX_JOBS = EnvVar(("MAX_JOBS",), parse_positive_int, 0, "Parallel compile jobs of a source build.")
USE_PRECOMPILED = EnvVar(
    ("CPUINFER_USE_PRECOMPILED", "VLLM_USE_PRECOMPILED"),
    parse_bool,
    False,
    "Editable install that takes compiled kernels from a prebuilt wheel.",
)
PRECOMPILED_WHEEL_LOCATION = EnvVar(
    ("CPUINFER_PRECOMPILED_WHEEL_LOCATION", "VLLM_PRECOMPILED_WHEEL_LOCATION"),
    parse_str,
    "",
    "Path or URL of the prebuilt wheel for precompiled installs.",
)
WHEEL_INDEX = EnvVar(
    ("CPUINFER_WHEEL_INDEX",),
    parse_str,
    "",
    "Index URL a precompiled install downloads the wheel from (default: pip's index).",
)

# Engine.
KVCACHE_SPACE = EnvVar(
    ("CPUINFER_KVCACHE_SPACE", "VLLM_CPU_KVCACHE_SPACE"), parse_positive_float, 4.0, "KV cache size in GiB."
)
OMP_THREADS_BIND = EnvVar(
    ("CPUINFER_OMP_THREADS_BIND", "VLLM_CPU_OMP_THREADS_BIND"),
    parse_str,
    "auto",
    "Cores for inference threads: auto, nobind, a list like 0-31, or a|b per rank on this machine.",
)
NUM_OF_RESERVED_CPU = EnvVar(
    ("CPUINFER_NUM_OF_RESERVED_CPU", "VLLM_CPU_NUM_OF_RESERVED_CPU"),
    parse_nonneg_int,
    0,
    "Cores per rank kept free of inference threads under auto (unset: 0 with one rank, 1 with several).",
)
VISIBLE_MEMORY_NODES = EnvVar(
    ("CPUINFER_VISIBLE_MEMORY_NODES", "CPU_VISIBLE_MEMORY_NODES"),
    parse_str,
    "",
    "NUMA nodes auto binding uses, in binding order, e.g. 0,1.",
)
FUSED_LAYERS = EnvVar(
    ("CPUINFER_FUSED_LAYERS",),
    parse_bool,
    True,
    "Run each bf16/f16 decoder layer as one kernel call (0 = the per-op Python path, for debugging).",
)
MOE_PREPACK = EnvVar(
    ("CPUINFER_MOE_PREPACK", "VLLM_CPU_MOE_PREPACK"),
    parse_bool,
    True,
    "Pack mixture-of-experts layers' expert weights at load into the kernels' panel layout (0 = keep them "
    "row-major: no repacking pass, the GEMV kernel at every batch size).",
)
PP_MICRO_BATCHES = EnvVar(
    ("CPUINFER_PP_MICRO_BATCHES",),
    parse_nonneg_int,
    0,
    "Micro-batches per step under pipeline parallelism (0: one per stage, for steps of 64 tokens per micro-batch "
    "or more; N: up to N whatever the step's size; 1: no overlap).",
)
GGUF_DEQUANTIZE = EnvVar(
    ("CPUINFER_GGUF_DEQUANTIZE",),
    parse_bool,
    False,
    "Load GGUF block quants dequantized to the run dtype (bf16 accuracy, ~3.5x the memory and "
    "bytes per token) instead of running them on the integer kernels.",
)
INT4_W4A8 = EnvVar(
    ("CPUINFER_INT4_W4A8", "VLLM_CPU_INT4_W4A8"),
    parse_bool,
    False,
    "Run 4-bit weight-only checkpoints (GPTQ, AWQ, compressed-tensors W4A16) with int8 activations per block "
    "of 32 (W4A8: faster prefill, less accurate) instead of 16-bit activations.",
)
RAY_CPUS_PER_ENGINE = EnvVar(
    ("CPUINFER_RAY_CPUS_PER_ENGINE",),
    parse_positive_int,
    0,
    "CPUs each data-parallel engine core reserves on Ray (--data-parallel-backend ray); unset = the CPUs of "
    "the cluster's smallest node, one core per machine.",
)
API_KEY = EnvVar(("CPUINFER_API_KEY", "VLLM_API_KEY"), parse_str, "", "Bearer token the server requires.")

ALL: tuple[EnvVar, ...] = (
    ISA,
    ISAS,
    AVX512BF16,
    MAX_JOBS,
    USE_PRECOMPILED,
    PRECOMPILED_WHEEL_LOCATION,
    WHEEL_INDEX,
    KVCACHE_SPACE,
    OMP_THREADS_BIND,
    NUM_OF_RESERVED_CPU,
    VISIBLE_MEMORY_NODES,
    FUSED_LAYERS,
    MOE_PREPACK,
    PP_MICRO_BATCHES,
    GGUF_DEQUANTIZE,
    INT4_W4A8,
    RAY_CPUS_PER_ENGINE,
    API_KEY,
)
# What an engine core reads where it runs: copied into the runtime_env of Ray actors, whose nodes lack the
# server's environment.
ENGINE: tuple[EnvVar, ...] = (
    ISA,
    KVCACHE_SPACE,
    OMP_THREADS_BIND,
    NUM_OF_RESERVED_CPU,
    VISIBLE_MEMORY_NODES,
    FUSED_LAYERS,
    MOE_PREPACK,
    GGUF_DEQUANTIZE,
    INT4_W4A8,
)
