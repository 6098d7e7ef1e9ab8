"""MXFP4 checkpoints (gpt-oss's experts: `quantization_config.quant_method == "mxfp4"`).

OCP microscaling FP4: per block of 32 inputs, 16 bytes of E2M1 values (two a byte, the low nibble first)
and one E8M0 scale byte e, w = fp4 * 2^(e - 127). transformers stores a stack of experts' weights as
`<name>_blocks` (uint8 [*lead, out, in / 32, 16]) and `<name>_scales` (uint8 [*lead, out, in / 32]).

The kernels run it exactly on their 5-bit zero-point form: twice an E2M1 value is an integer in
[-12, 12], so u = 2 fp4 + 12 (25 levels, 5 bits) with zero point 12 and scale d = 2^(e - 128), a power of
two that float16 holds exactly from 2^-24 to 2^15. That is 5.75 bits a weight in memory (5 + the group's
f16 scale and u8 zero point) against MXFP4's 4.25, on the integer kernels of every variant, with the int8
activations llama.cpp also runs MXFP4 with. A stack whose scales float16 cannot hold exactly is
dequantized to the run dtype instead (logged).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ModelLoadError
from .weight import QuantWeight

logger = logging.getLogger(__name__)

MARKER = "_blocks"
SUFFIXES = ("_blocks", "_scales")
# E2M1 codes 0..15 (sign in bit 3) as twice their value: exact small integers.
E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)
ZERO = 12  # the 5-bit form's zero point


@dataclass(frozen=True)
class Scheme:
    """MXFP4 has no parameters; the scheme only names it."""

    kind: str = "MXFP4"


def scheme(qcfg: dict, source: str) -> Scheme:  # noqa: ARG001 - every reader's scheme() takes both
    """The quantization_config's scheme (MXFP4 is fixed: blocks of 32, E2M1 values, E8M0 scales)."""
    return Scheme()


@dataclass
class Mxfp4Stack:
    """A stack of MXFP4 matrices as stored: blocks [*lead, out, in / 32, 16], scales [*lead, out, in / 32]."""

    blocks: np.ndarray
    scales: np.ndarray
    kind: str = "MXFP4"

    @property
    def shape(self) -> tuple[int, ...]:
        """[*lead, out, in] of the values."""
        return (*self.scales.shape[:-1], self.scales.shape[-1] * 32)

    def weight(self, index: tuple, rows: slice = slice(None)) -> QuantWeight | None:
        """stack[index] (one [out, in] matrix), rows `rows` of it, exactly in the kernels' 5-bit form; None
        when a scale is outside float16's exact powers of two (the caller dequantizes)."""
        blocks, scales = self.blocks[index][rows], self.scales[index][rows]
        e = scales.astype(np.int32) - 128
        if e.min() < -24 or e.max() > 15:
            return None
        u = (E2M1_X2[_codes(blocks)] + ZERO).astype(np.uint8).reshape(blocks.shape[0], -1)
        d = np.ldexp(np.ones(e.shape, dtype=np.float32), e).astype(np.float16)
        return QuantWeight.pack(u, d, np.full(d.shape, ZERO, dtype=np.uint8), bits=5, group=32, kind=self.kind)

    def dequantize(self, dtype: torch.dtype, index: tuple = ()) -> torch.Tensor:
        """stack[index] as dense [..., out, in] values (exact in float32)."""
        blocks, scales = self.blocks[index], self.scales[index]
        values = (
            E2M1_X2[_codes(blocks)].astype(np.float32)
            * np.ldexp(np.float32(0.5), scales.astype(np.int32) - 127)[..., None]
        )
        return torch.from_numpy(values.reshape(*blocks.shape[:-2], -1)).to(dtype)


def _codes(blocks: np.ndarray) -> np.ndarray:
    """The E2M1 codes (0..15) of blocks [..., 16] as [..., 32]: byte j's low nibble is value 2j, its high 2j + 1."""
    out = np.empty((*blocks.shape[:-1], 32), dtype=np.uint8)
    out[..., 0::2], out[..., 1::2] = blocks & 15, blocks >> 4
    return out


def rewrite(tensors: dict, dtype: torch.dtype, source: str) -> Counter:
    """Each `<name>_blocks` / `<name>_scales` pair becomes `<name>`: an Mxfp4Stack (the model builder unstacks
    it), or in float32 runs, the reference mode, its float32 values in transformers' parameter layout
    [*lead, in, out] (as its dequantization transposes them)."""
    kinds: Counter = Counter()
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        scales = tensors.pop(f"{base}_scales", None)
        if scales is None:
            raise ModelLoadError(f"{source}: {name} has no {base}_scales beside it; the checkpoint is incomplete")
        blocks = tensors.pop(name)
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
            raise ModelLoadError(
                f"{source}: {name} {list(blocks.shape)} ({blocks.dtype}) and its scales {list(scales.shape)} "
                f"({scales.dtype}) are not MXFP4 blocks: uint8 [..., out, in / 32, 16] and uint8 [..., out, in / 32]"
            )
        if blocks.shape[-1] != 16:
            raise ModelLoadError(f"{source}: {name} has blocks of {blocks.shape[-1]} bytes; MXFP4 blocks have 16")
        stack = Mxfp4Stack(blocks.numpy(), scales.numpy())
        tensors[base] = stack if dtype != torch.float32 else stack.dequantize(torch.float32).transpose(-1, -2)
        kinds[stack.kind] += 1
    return kinds
