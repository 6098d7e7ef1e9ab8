"""AWQ checkpoints (AutoAWQ's GEMM version) rewritten as QuantWeight.

`quantization_config.quant_method == "awq"`, `version == "gemm"`, 4 bit with zero points. Per
quantized linear `<prefix>` (in = K, out = N, G = K / group_size groups), each int32 holding 8
4-bit values of consecutive outputs in AWQ's interleaved order: bits 4j..4j+3 of word c hold
output 8c + [0, 2, 4, 6, 1, 3, 5, 7][j]:

| tensor  | dtype | shape      | holds                      |
|---------|-------|------------|----------------------------|
| qweight | int32 | [K, N / 8] | u[k, n]                    |
| qzeros  | int32 | [G, N / 8] | z[g, n], stored as is      |
| scales  | f16   | [G, N]     | d[g, n]                    |

w[n, k] = d[g, n] * (u[k, n] - z[g, n]) with g = k // group_size: kept exactly as a 4-bit
QuantWeight in zero-point form.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ModelLoadError
from .linear_tensors import LinearTensors, unpack_words
from .weight import QuantWeight

MARKER = "qweight"
SUFFIXES = ("qweight", "qzeros", "scales")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # output within a word's run of 8, for value j of the word


@dataclass(frozen=True)
class Scheme:
    """The parts of an AWQ quantization_config the weights depend on."""

    group_size: int

    @property
    def kind(self) -> str:
        """A name for logs, e.g. AWQ-4bit-g128."""
        return f"AWQ-4bit-g{self.group_size}"


def scheme(qcfg: dict, source: str) -> Scheme:
    """The scheme of an AWQ quantization_config, checked against what the kernels take."""
    bits = qcfg.get("bits", qcfg.get("w_bit", 4))
    group = qcfg.get("group_size", qcfg.get("q_group_size", 128))
    version = str(qcfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise ModelLoadError(f"{source}: AWQ version {version!r} is not supported; cpuinfer reads the GEMM version")
    if bits != 4:
        raise ModelLoadError(f"{source}: AWQ with bits = {bits!r} is not supported; AWQ GEMM checkpoints are 4 bit")
    if not qcfg.get("zero_point", True):
        raise ModelLoadError(f"{source}: AWQ without zero points (zero_point: false) is not supported")
    if not isinstance(group, int) or isinstance(group, bool) or group < 32 or group % 32:
        raise ModelLoadError(
            f"{source}: AWQ group_size = {group!r} is not supported; use a multiple of 32 (64 and 128 are AWQ's)"
        )
    return Scheme(group_size=group)


def read(t: LinearTensors, s: Scheme) -> QuantWeight:
    """One AWQ linear layer as a QuantWeight (see the module docstring)."""
    qweight = t.get("qweight", (torch.int32,))
    if qweight.dim() != 2:
        raise t.error("qweight", f"has shape {list(qweight.shape)}, expected [in_features, out_features / 8]")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if k % s.group_size:
        raise t.error("qweight", f"has {k} inputs, not a multiple of group_size {s.group_size}")
    groups = k // s.group_size
    u = unpack_words(t.words("qweight", (k, n // 8)), 4, axis=1, order=AWQ_ORDER).T  # [N, K]
    z = unpack_words(
        t.words("qzeros", (groups, n // 8), f"{groups} groups x out_features / 8"), 4, axis=1, order=AWQ_ORDER
    )
    d = t.scales("scales", (groups, n), f"{groups} groups x out_features")
    return QuantWeight.pack(
        np.ascontiguousarray(u),
        np.ascontiguousarray(d.T),
        np.ascontiguousarray(z.T),
        bits=4,
        group=s.group_size,
        kind=s.kind,
        act16=True,  # weight-only: x stays 16-bit (weight.py)
    )
