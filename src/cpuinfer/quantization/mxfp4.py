"""MXFP4 checkpoints (gpt-oss's experts: `quantization_config.quant_method == "mxfp4"`).

OCP microscaling FP4: per block of 32 inputs, 16 bytes of E2M1 values (two a byte, the low nibble first)
and one E8M0 scale byte e, w = fp4 * 2^(e - 127). transformers stores a stack of experts' weights as
`<name>_blocks` (uint8 [*lead, out, in / 32, 16]) and `<name>_scales` (uint8 [*lead, out, in / 32]).

The weights stay as the file has them, 4.25 bits each: the codes packed two a byte and the exponent bytes
(QuantWeight's fp4 form). The integer kernels of every variant look each code up as twice its value, an
integer in [-12, 12] (one byte shuffle per 64 weights), and take 2^(e - 128) as the group's scale, with the
int8 activations llama.cpp also runs MXFP4 with; the result is exact up to that int8 rounding. A matrix with
an exponent outside 2..254 (2^-126 .. 2^126; 255 is NaN) is dequantized to the run dtype instead.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ModelLoadError
from .weight import QuantWeight, mxfp4

logger = logging.getLogger(__name__)

MARKER = "_blocks"
SUFFIXES = ("_blocks", "_scales")
# E2M1 codes 0..15 (sign in bit 3) as twice their value: exact small integers.
E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)


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
        """stack[index] (one [out, in] matrix), rows `rows` of it, packed as it is (4.25 bits); None when an
        exponent is outside what the kernels take exactly (the caller dequantizes)."""
        blocks, scales = self.blocks[index][rows], self.scales[index][rows]
        return mxfp4(_codes(blocks).reshape(blocks.shape[0], -1), scales, self.kind)

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
