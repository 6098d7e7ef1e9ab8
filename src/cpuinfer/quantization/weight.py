"""Quantized weights as the kernels read them: integer values in 16-row panels, per-group scales.

A QuantWeight holds one [n, k] matrix in the layout of csrc/common/quant_tile.h: values u of 4, 5,
6 or 8 bits (kept at that width), and per group of `group` consecutive k and row a float16 scale d
with either a uint8 zero point z (w = d * (u - z)) or a float16 minimum m (w = d * u + m). Every format we load (GGUF's
block quants, GPTQ, AWQ, compressed-tensors) is rewritten into this form once, at load; the
layout does not depend on the kernel variant. A QuantStack is several of them stacked along n
(a fused QKV whose q, k and v came in different formats).

A weight may be packed in a k order other than the input's (GPTQ act-order: k sorted by group
so that every group is contiguous): `perm` (int32 [k]) names the input feature of each packed
k, and the kernel quantizes x gathered through it.

`act16` says how the activations meet the weight. False (GGUF, as llama.cpp calibrates its types;
compressed-tensors W8A8): x quantized to int8 per block of 32, integer dot products. True (the
weight-only formats GPTQ, AWQ, compressed-tensors W4A16 / W8A16, as their accuracy is published and
vLLM runs them): x stays in the run's 16-bit type and the weight is widened where it is used
(csrc/common/quant_wide.h). CPUINFER_INT4_W4A8=1 turns 4-bit weight-only layers back to int8 activations.

`fp4` is MXFP4 (gpt-oss's experts, GGUF's MXFP4) as the file has it: 4-bit E2M1 codes in groups of 32 and
each group's E8M0 exponent byte in z, no d: 4.25 bits a weight. The kernels look each code up as a small
integer (quant_tile.h) and run it with int8 activations, as llama.cpp does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import _C

LANES = 16  # rows per panel
BLOCK = 32  # k per block of the activation quantization


def _panels(n: int) -> int:
    return (n + LANES - 1) // LANES


@dataclass(eq=False)
class QuantWeight:
    """One quantized [n, k] weight in the kernels' panel layout (see the module docstring)."""

    qs: torch.Tensor  # uint8 [panels * k / 32 * 16 * 32 * bits / 8]
    d: torch.Tensor | None  # float16 [panels * k / group * 16] (None with fp4)
    z: torch.Tensor | None  # uint8 [panels * k / group * 16] (zero-point form; fp4: the E8M0 exponents)
    m: torch.Tensor | None  # float16, same size as d (minimum form)
    bits: int
    group: int
    n: int
    k: int
    kind: str  # the source format, e.g. "Q4_1", for logs and `cpuinfer info`
    perm: torch.Tensor | None = None  # int32 [k]: input feature of each packed k, or None (in order)
    act16: bool = False  # x stays 16-bit (weight-only formats), else int8 per block of 32 (module docstring)
    fp4: bool = False  # MXFP4: qs holds E2M1 codes, z their groups' exponents, no d (module docstring)

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return (self.n, self.k)

    @property
    def parts(self) -> tuple[QuantWeight, ...]:
        """The quantized matrices this weight stacks (itself)."""
        return (self,)

    @property
    def nbytes(self) -> int:
        """Bytes held in memory."""
        held = (self.qs, self.d, self.z, self.m, self.perm)
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    @classmethod
    def empty(cls, n: int, k: int, bits: int, group: int, has_min: bool, kind: str, fp4: bool = False) -> QuantWeight:
        """An unfilled weight of this shape and form (quant_pack fills it)."""
        panels, groups = _panels(n), k // group
        return cls(
            qs=torch.empty(panels * (k // BLOCK) * LANES * BLOCK * bits // 8, dtype=torch.uint8),
            d=None if fp4 else torch.empty(panels * groups * LANES, dtype=torch.float16),
            z=None if has_min else torch.empty(panels * groups * LANES, dtype=torch.uint8),
            m=torch.empty(panels * groups * LANES, dtype=torch.float16) if has_min else None,
            bits=bits,
            group=group,
            n=n,
            k=k,
            kind=kind,
            fp4=fp4,
        )

    @classmethod
    def pack(
        cls,
        u: np.ndarray,
        d: np.ndarray | None,
        z: np.ndarray | None = None,
        m: np.ndarray | None = None,
        *,
        bits: int,
        group: int,
        kind: str,
        perm: np.ndarray | None = None,
        act16: bool = False,
        fp4: bool = False,
    ) -> QuantWeight:
        """From values u [n, k] (uint8, < 2**bits) and per-group d and z or m [n, k / group], all in perm's k order
        (fp4: u the E2M1 codes, z their E8M0 exponents, no d)."""
        n, k = u.shape
        if (z is None) == (m is None):
            raise ValueError("pass exactly one of z (zero points) and m (minimums)")
        w = cls.empty(n, k, bits, group, m is not None, kind, fp4)
        w.act16 = act16
        if perm is not None:
            perm = np.asarray(perm)
            if perm.shape != (k,) or not np.array_equal(np.sort(perm), np.arange(k)):
                raise ValueError(f"perm must be a permutation of 0..{k - 1}")
            w.perm = _tensor(perm, np.int32)
        _C.quant_pack(
            w,
            _tensor(u, np.uint8),
            None if d is None else _tensor(d, np.float16),
            None if z is None else _tensor(z, np.uint8),
            None if m is None else _tensor(m, np.float16),
        )
        return w

    def rows(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows ids of the dequantized weight, in dtype (an embedding lookup)."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], self.k, dtype=dtype)
        _C.quant_rows(out, self, ids)
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole [n, k] weight dequantized (tests and fallbacks)."""
        return self.rows(torch.arange(self.n), dtype)


@dataclass(eq=False)
class QuantStack:
    """Quantized weights stacked along n, each writing its own output columns."""

    parts: tuple[QuantWeight, ...]

    @property
    def n(self) -> int:
        """Total out_features."""
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        """in_features (the same for every part)."""
        return self.parts[0].k

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features)."""
        return (self.n, self.k)

    @property
    def kind(self) -> str:
        """The parts' source formats, e.g. "Q5_0+Q8_0"."""
        return "+".join(p.kind for p in self.parts)

    @property
    def nbytes(self) -> int:
        """Bytes held in memory."""
        return sum(p.nbytes for p in self.parts)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole [n, k] weight dequantized."""
        return torch.cat([p.dequantize(dtype) for p in self.parts])


Quantized = QuantWeight | QuantStack


def is_quantized(w) -> bool:
    """True for a QuantWeight or QuantStack."""
    return isinstance(w, (QuantWeight, QuantStack))


def _same_form(a: QuantWeight, b: QuantWeight) -> bool:
    """Whether b can be appended to a's panels (one kernel call reads x once, in one k order)."""
    same_order = a.perm is b.perm or (a.perm is not None and b.perm is not None and torch.equal(a.perm, b.perm))
    form = (a.bits, a.group, a.z is None, a.k, a.act16, a.fp4)
    return form == (b.bits, b.group, b.z is None, b.k, b.act16, b.fp4) and same_order


def concat(weights: list[QuantWeight]) -> Quantized:
    """weights stacked along n: merged into one QuantWeight where formats agree, else a QuantStack.

    Panels are 16 rows, so two weights of one form (and k order) merge by concatenation when the
    first has a multiple of 16 rows (its last panel is full). Parts packed in different k orders
    stay separate parts, each read through its own perm. At most 3 parts remain (the kernels' limit).
    """
    merged: list[QuantWeight] = []
    for w in weights:
        last = merged[-1] if merged else None
        if last is not None and _same_form(last, w) and last.n % LANES == 0:
            merged[-1] = QuantWeight(
                qs=torch.cat([last.qs, w.qs]),
                d=None if w.d is None else torch.cat([last.d, w.d]),
                z=None if w.z is None else torch.cat([last.z, w.z]),
                m=None if w.m is None else torch.cat([last.m, w.m]),
                bits=w.bits,
                group=w.group,
                n=last.n + w.n,
                k=w.k,
                kind=last.kind if last.kind == w.kind else f"{last.kind}+{w.kind}",
                perm=last.perm,
                act16=w.act16,
                fp4=w.fp4,
            )
        else:
            merged.append(w)
    if len(merged) == 1:
        return merged[0]
    if len(merged) > 3:
        raise ValueError(f"{len(merged)} quantized parts of different formats cannot be stacked (at most 3)")
    return QuantStack(tuple(merged))


def mxfp4(codes: np.ndarray, exponents: np.ndarray, kind: str = "MXFP4") -> QuantWeight | None:
    """An MXFP4 weight from its E2M1 codes [n, k] (0..15, sign in bit 3) and E8M0 exponents [n, k / 32], as the
    file has them (fp4); None when an exponent is outside 2..254 (2^-126 .. 2^126: beyond that the kernels' f32
    scale is not exact, and 255 is NaN), for the caller to dequantize."""
    if exponents.size and (exponents.min() < 2 or exponents.max() > 254):
        return None
    return QuantWeight.pack(codes, None, exponents, bits=4, group=BLOCK, kind=kind, fp4=True)


def scale16(x: np.ndarray) -> np.ndarray:
    """Group scales (or minimums) as float16, refusing what does not fit (a corrupt or exotic file)."""
    x = np.asarray(x)
    with np.errstate(over="ignore"):
        out = x.astype(np.float16)
    if not np.isfinite(out).all() and np.isfinite(x).all():
        raise ValueError("a group scale overflows float16")
    return out


def _tensor(a: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype))
