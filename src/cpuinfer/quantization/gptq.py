"""GPTQ checkpoints (auto-gptq / gptqmodel / optimum) rewritten as QuantWeight.

`quantization_config.quant_method == "gptq"`. Per quantized linear `<prefix>` (in = K, out = N,
G groups, f = 32 / bits values per int32, value j of a word at bits j * bits, low first):

| tensor    | dtype | shape      | holds                                             |
|-----------|-------|------------|---------------------------------------------------|
| qweight   | int32 | [K / f, N] | u[k, n]: k packed along the rows                  |
| qzeros    | int32 | [G, N / f] | the zero point of group g, output n (see format)  |
| scales    | f16   | [G, N]     | d[g, n]                                           |
| g_idx     | int32 | [K]        | the group of input k (optional: k // group_size)  |

w[n, k] = d[g, n] * (u[k, n] - z[g, n]) with g = g_idx[k]: kept exactly as a weight-only (act16)
QuantWeight in zero-point form (4 or 8 bit, group = group_size, or K for group_size -1). Where group_size does
not divide K (the last group is short), the QuantWeight's groups are gcd(K, group_size), each
GPTQ group's scale and zero point repeated over its sub-groups.

Zero points: checkpoint_format "gptq" (auto-gptq's "v1", what optimum and transformers write and
vLLM reads) stores z - 1, read back as stored + 1 with no wrap, as auto-gptq's dequantization
(qlinear_cuda) and vLLM's kernels do; "gptq_v2" (gptqmodel's internal format) stores z itself.
An 8-bit zero point of 256 (stored 255) does not fit the kernels' uint8: such a weight is kept
in minimum form instead, m = -d * z rounded to f16.

desc_act (act-order): g_idx is then a permutation of the groups, each group still group_size
inputs. We sort k by group (stable), pack the values in that order so every group is contiguous,
and hand the kernel that order as the weight's perm: it gathers x through it before quantizing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ModelLoadError
from .linear_tensors import LinearTensors, group_order, unpack_words
from .weight import QuantWeight, scale16

MARKER = "qweight"  # a quantized linear is a prefix with this tensor
SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class Scheme:
    """The parts of a GPTQ quantization_config the weights depend on."""

    bits: int
    group_size: int  # -1: one group over all of K
    v1_zeros: bool  # checkpoint_format "gptq": zero points stored minus 1
    desc_act: bool

    @property
    def kind(self) -> str:
        """A name for logs, e.g. GPTQ-4bit-g128-act."""
        g = "" if self.group_size == -1 else f"-g{self.group_size}"
        return f"GPTQ-{self.bits}bit{g}{'-act' if self.desc_act else ''}"


def scheme(qcfg: dict, source: str) -> Scheme:
    """The scheme of a GPTQ quantization_config, checked against what the kernels take."""
    bits, group = qcfg.get("bits", 4), qcfg.get("group_size", 128)
    fmt = qcfg.get("checkpoint_format") or qcfg.get("format") or "gptq"
    if bits not in (4, 8):
        raise ModelLoadError(f"{source}: GPTQ with bits = {bits!r} is not supported; cpuinfer runs 4- and 8-bit GPTQ")
    if not isinstance(group, int) or isinstance(group, bool) or not (group == -1 or (group >= 32 and group % 32 == 0)):
        raise ModelLoadError(
            f"{source}: GPTQ group_size = {group!r} is not supported; use -1 or a multiple of 32 (32, 64, 128, ...)"
        )
    if fmt not in FORMATS:
        raise ModelLoadError(
            f"{source}: GPTQ checkpoint_format {fmt!r} is not supported; cpuinfer reads "
            f"{' and '.join(FORMATS)} (re-save the model in the gptq format)"
        )
    if qcfg.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise ModelLoadError(f"{source}: GPTQ pack_dtype {qcfg['pack_dtype']!r} is not supported; only int32 words")
    if qcfg.get("dynamic"):
        raise ModelLoadError(f"{source}: GPTQ 'dynamic' per-module overrides are not supported")
    return Scheme(bits=bits, group_size=group, v1_zeros=fmt == "gptq", desc_act=bool(qcfg.get("desc_act")))


def read(t: LinearTensors, s: Scheme) -> QuantWeight:
    """One GPTQ linear layer as a QuantWeight (see the module docstring)."""
    bits, per = s.bits, 32 // s.bits
    qweight = t.get("qweight", (torch.int32,))
    if qweight.dim() != 2:
        raise t.error("qweight", f"has shape {list(qweight.shape)}, expected [in_features * {bits} / 32, out_features]")
    k, n = qweight.shape[0] * per, qweight.shape[1]
    if k % 32:
        raise t.error("qweight", f"packs {k} inputs, not a multiple of 32 (the kernels' block)")
    if n * bits % 32:
        raise t.error(
            "qweight", f"has {n} outputs; qzeros packs them {per} to an int32, so it must be a multiple of {per}"
        )
    group = k if s.group_size == -1 else s.group_size
    groups = -(-k // group)  # GPTQ's last group may be short (SmolLM2's 576 inputs in groups of 128)
    sub = math.gcd(k, group)  # the QuantWeight's group: divides k, and each GPTQ group is whole sub-groups
    if sub % 32:
        raise t.error(
            "qweight", f"packs {k} inputs; with group_size {group} the groups do not fall on the kernels' blocks of 32"
        )
    u = unpack_words(t.words("qweight", (k // per, n)), bits, axis=0).T  # [N, K]
    z = unpack_words(
        t.words("qzeros", (groups, n // per), f"{groups} groups x out_features * {bits} / 32"), bits, axis=1
    ).astype(np.int32) + (1 if s.v1_zeros else 0)
    d = t.scales("scales", (groups, n), f"{groups} groups x out_features")
    perm = group_order(t, "g_idx", k, group, groups) if t.has("g_idx") else None
    if perm is not None:
        u = u[:, perm]
    at = np.arange(k // sub) * sub // group  # the GPTQ group of each sub-group (in packed k order)
    d, z = np.ascontiguousarray(d.T[:, at]), np.ascontiguousarray(z.T[:, at])
    if z.max() > 255:
        try:
            m = scale16(-d.astype(np.float32) * z)
        except ValueError:
            raise t.error("scales", "times a zero point of 256 overflows float16") from None
        return QuantWeight.pack(
            np.ascontiguousarray(u), d, m=m, bits=bits, group=sub, kind=s.kind, perm=perm, act16=True
        )
    return QuantWeight.pack(
        np.ascontiguousarray(u), d, z.astype(np.uint8), bits=bits, group=sub, kind=s.kind, perm=perm, act16=True
    )
