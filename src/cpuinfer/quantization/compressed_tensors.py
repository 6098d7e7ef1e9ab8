"""compressed-tensors checkpoints (llm-compressor's format) rewritten as QuantWeight.

`quantization_config.quant_method == "compressed-tensors"`. Each entry of config_groups names
its targets ("Linear", a module name, or "re:<regex>" matched from the start, as
compressed-tensors' match_name does) and its weight scheme; `ignore` lists layers kept dense
(lm_head, typically), which the checkpoint then holds as a plain float `weight`. Integer weights
of b bits are stored signed, q in [-2**(b-1), 2**(b-1)); per group g of output n:

| format                          | tensor            | dtype | shape                           |
|---------------------------------|-------------------|-------|---------------------------------|
| int-quantized / naive-quantized | weight            | int8  | [N, K]: q                       |
| pack-quantized                  | weight_packed     | int32 | [N, K * b / 32]: q + 2**(b-1)   |
|                                 | weight_shape      | int   | [2] = (N, K)                    |
| both                            | weight_scale      | float | [N, G] (G = 1: channel)         |
| both, asymmetric                | weight_zero_point | int8  | [N, G] (packed: int32 along N)  |
| both, group act-order           | weight_g_idx      | int   | [K]                             |

(packed: value j of an int32 at bits j * b, low first, as compressed-tensors' pack_to_int32.)

w[n, k] = s[n, g] * (q[n, k] - zp[n, g]) (zp = 0 when symmetric), kept as a b-bit QuantWeight in
zero-point form with u = q + 2**(b-1), z = zp + 2**(b-1). Strategies: channel (one group of K),
group (group_size a multiple of 32), tensor (one scale, repeated per row); b = 4 or 8. Scales
are stored as float16 (within 2**-11 of a float32 or bfloat16 scale; one past float16's range
is refused).

W8A8 (`int-quantized`, int8 per-channel weights with dynamic per-token int8 activations): our
kernel quantizes activations dynamically too, per row and block of 32 inputs, which is at least as
fine as per token, so the result is at least as close to the float product. Static activation
scales (input_scale, dynamic: false) are not used for the same reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ModelLoadError
from .linear_tensors import LinearTensors, group_order, unpack_words
from .weight import QuantWeight

MARKER = "weight_scale"
SUFFIXES = (
    "weight",
    "weight_packed",
    "weight_shape",
    "weight_scale",
    "weight_zero_point",
    "weight_g_idx",
    "input_scale",
    "input_zero_point",
)
INT_FORMATS = ("int-quantized", "naive-quantized")
FORMATS = (*INT_FORMATS, "pack-quantized")
STRATEGIES = ("channel", "group", "tensor")


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weight quantization."""

    format: str
    bits: int
    strategy: str
    group_size: int | None
    symmetric: bool
    activations: str  # "int8 dynamic", "int8 static" or "none"

    @property
    def kind(self) -> str:
        """A name for logs, e.g. W4A16-g128 or W8A8-channel."""
        a = "A16" if self.activations == "none" else "A8"
        g = f"g{self.group_size}" if self.strategy == "group" else self.strategy
        return f"W{self.bits}{a}-{g}{'' if self.symmetric else '-asym'}"


@dataclass(frozen=True)
class Scheme:
    """The config groups (targets -> weight scheme) and the ignore list."""

    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]
    ignore: tuple[str, ...]

    def for_layer(self, prefix: str, source: str) -> WeightScheme:
        """The scheme of the first config group whose targets match the layer (and it is not ignored)."""
        if any(_matches(prefix, t) for t in self.ignore):
            raise ModelLoadError(
                f"{source}: layer {prefix!r} holds quantized tensors but quantization_config's "
                "ignore list names it; the checkpoint and its config do not match"
            )
        for targets, ws in self.groups:
            if any(_matches(prefix, t) for t in targets):
                return ws
        raise ModelLoadError(
            f"{source}: layer {prefix!r} holds quantized tensors but no config_groups entry "
            "targets it; the checkpoint and its config do not match"
        )


def _matches(name: str, target: str) -> bool:
    """compressed-tensors' rule: "re:" regex from the start, an exact name, or a class (Linear: any linear)."""
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), name) is not None
    return target == name or target == "Linear"


def scheme(qcfg: dict, source: str) -> Scheme:
    """The scheme of a compressed-tensors quantization_config, checked against what the kernels take."""
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError(f"{source}: compressed-tensors quantization_config has no config_groups")
    parsed = []
    for name, g in groups.items():
        if not isinstance(g, dict) or not isinstance(g.get("targets"), list):
            raise ModelLoadError(f"{source}: compressed-tensors config group {name!r} has no targets list")
        parsed.append((tuple(g["targets"]), _weight_scheme(g, qcfg.get("format"), f"{source}: config group {name!r}")))
    ignore = qcfg.get("ignore") or []
    return Scheme(groups=tuple(parsed), ignore=tuple(ignore))


def _weight_scheme(g: dict, default_format: str | None, where: str) -> WeightScheme:
    fmt = g.get("format") or default_format
    w = g.get("weights") or {}
    bits, kind = w.get("num_bits"), w.get("type", "int")
    strategy, group_size = w.get("strategy"), w.get("group_size")
    if fmt not in FORMATS:
        raise ModelLoadError(
            f"{where}: compressed-tensors format {fmt!r} is not supported; cpuinfer reads {', '.join(FORMATS)}"
        )
    if kind != "int" or bits not in (4, 8) or (fmt in INT_FORMATS and bits != 8):
        raise ModelLoadError(
            f"{where}: {bits}-bit {kind} weights in {fmt} are not supported; cpuinfer reads int8 "
            "(int-quantized) and int4/int8 (pack-quantized) weights"
        )
    if strategy not in STRATEGIES:
        raise ModelLoadError(
            f"{where}: weight strategy {strategy!r} is not supported; use one of {', '.join(STRATEGIES)}"
        )
    if strategy == "group" and (not isinstance(group_size, int) or group_size < 32 or group_size % 32):
        raise ModelLoadError(f"{where}: group_size = {group_size!r} is not supported; use a multiple of 32")
    if w.get("dynamic"):
        raise ModelLoadError(f"{where}: dynamic weight quantization is not a checkpoint format cpuinfer reads")
    a = g.get("input_activations")
    if a is None:
        acts = "none"
    elif a.get("type", "int") == "int" and a.get("num_bits") == 8:
        acts = "int8 dynamic" if a.get("dynamic") else "int8 static"
    else:
        raise ModelLoadError(
            f"{where}: input activations {a.get('num_bits')}-bit {a.get('type')} are not "
            "supported; cpuinfer runs int8 (W8A8) or unquantized (W4A16, W8A16) activations"
        )
    return WeightScheme(
        format=fmt,
        bits=bits,
        strategy=strategy,
        group_size=group_size if strategy == "group" else None,
        symmetric=bool(w.get("symmetric", True)),
        activations=acts,
    )


def read(t: LinearTensors, s: Scheme) -> QuantWeight:
    """One compressed-tensors linear layer as a QuantWeight (see the module docstring)."""
    ws = s.for_layer(t.prefix, t.source)
    bits, offset = ws.bits, 1 << (ws.bits - 1)
    if ws.format == "pack-quantized":
        shape = t.get("weight_shape", (torch.int32, torch.int64), (2,), "(out_features, in_features)")
        n, k = (int(v) for v in shape.tolist())
        if n < 1 or k < 1:
            raise t.error("weight_shape", f"is {[n, k]}, not a positive shape")
        if k * bits % 32:
            raise t.error("weight_shape", f"has {k} inputs; {bits}-bit packing needs a multiple of {32 // bits}")
        u = unpack_words(
            t.words("weight_packed", (n, k * bits // 32), f"weight_shape {[n, k]}, {bits} bits"), bits, axis=1
        )
    else:
        q = t.get("weight", (torch.int8,))
        if q.dim() != 2:
            raise t.error("weight", f"has shape {list(q.shape)}, expected [out_features, in_features]")
        n, k = q.shape
        u = (q.numpy().astype(np.int16) + offset).astype(np.uint8)
    if k % 32:
        raise t.error(
            "weight_packed" if ws.format == "pack-quantized" else "weight",
            f"has {k} inputs, not a multiple of 32 (the kernels' block)",
        )
    group = ws.group_size or k
    if k % group:
        raise t.error("weight_scale", f"cannot group {k} inputs by group_size {group}")
    groups = k // group
    if ws.strategy == "tensor":
        one = t.get("weight_scale", (torch.float16, torch.bfloat16, torch.float32))
        if one.numel() != 1:
            raise t.error("weight_scale", f"has {one.numel()} values, expected 1 (tensor strategy)")
        t.tensors[t.name("weight_scale")] = one.reshape(1, 1).expand(n, 1)
    d = t.scales("weight_scale", (n, groups), f"out_features x {groups} groups ({ws.strategy} strategy)")
    z = _zero_points(t, ws, n, groups) + offset
    perm = group_order(t, "weight_g_idx", k, group, groups) if t.has("weight_g_idx") else None
    if perm is not None:
        u = u[:, perm]
    return QuantWeight.pack(
        np.ascontiguousarray(u),
        d,
        z.astype(np.uint8),
        bits=bits,
        group=group,
        kind=ws.kind,
        perm=perm,
        act16=ws.activations == "none",  # W4A16 / W8A16: x stays 16-bit (weight.py); W8A8: int8
    )


def _zero_points(t: LinearTensors, ws: WeightScheme, n: int, groups: int) -> np.ndarray:
    """Signed zero points [n, groups] (zeros when symmetric)."""
    if ws.symmetric or not t.has("weight_zero_point"):
        if not ws.symmetric:
            raise t.error("weight_zero_point", "is missing (the scheme is asymmetric)")
        return np.zeros((n, groups), np.int16)
    lo, hi = -(1 << (ws.bits - 1)), (1 << (ws.bits - 1)) - 1
    zp = t.tensors[t.name("weight_zero_point")]
    if ws.format == "pack-quantized" and zp.dtype == torch.int32:
        rows = -(-n * ws.bits // 32)
        u = unpack_words(
            t.words("weight_zero_point", (rows, groups), f"out_features * {ws.bits} / 32 x groups"), ws.bits, axis=0
        )[:n]
        return u.astype(np.int16) + lo
    zp = t.get("weight_zero_point", (torch.int8, torch.int32), (n, groups), f"out_features x {groups} groups")
    z = zp.numpy().astype(np.int16)
    if z.min() < lo or z.max() > hi:
        raise t.error("weight_zero_point", f"holds {int(z.min())}..{int(z.max())}, outside {ws.bits}-bit [{lo}, {hi}]")
    return z
