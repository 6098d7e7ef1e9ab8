"""The tensors of one quantized linear layer in a Hugging Face checkpoint, checked as they are taken.

Every format reader (gptq.py, awq.py, compressed_tensors.py) takes its tensors through LinearTensors,
so a missing tensor, a wrong dtype or a shape that does not fit the quantization config is one
ModelLoadError naming the tensor, what it is and what was expected, never a crash further down.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ModelLoadError
from .weight import scale16

FLOATS = (torch.float16, torch.bfloat16, torch.float32)


class LinearTensors:
    """`<prefix>.<suffix>` tensors of one layer, from a checkpoint's name -> tensor dict."""

    def __init__(self, prefix: str, tensors: dict[str, torch.Tensor], source: str, method: str):
        self.prefix, self.tensors, self.source, self.method = prefix, tensors, source, method

    def name(self, suffix: str) -> str:
        """The tensor's full name."""
        return f"{self.prefix}.{suffix}"

    def has(self, suffix: str) -> bool:
        """True if the checkpoint holds this tensor."""
        return self.name(suffix) in self.tensors

    def error(self, suffix: str, problem: str) -> ModelLoadError:
        """A ModelLoadError naming the tensor and the format."""
        return ModelLoadError(
            f"{self.source}: {self.method} tensor {self.name(suffix)!r} {problem}; the checkpoint is "
            "corrupt or does not match its quantization_config: re-download or re-quantize it"
        )

    def get(
        self, suffix: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None = None, what: str = ""
    ) -> torch.Tensor:
        """The tensor, checked to have one of dtypes and (where given) exactly shape."""
        t = self.tensors.get(self.name(suffix))
        if t is None:
            raise self.error(suffix, "is missing")
        if t.dtype not in dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise self.error(suffix, f"is {str(t.dtype).removeprefix('torch.')}, expected {names}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            why = f" ({what})" if what else ""
            raise self.error(suffix, f"has shape {list(t.shape)}, expected {list(shape)}{why}")
        return t

    def scales(self, suffix: str, shape: tuple[int, ...], what: str = "") -> np.ndarray:
        """A float scale tensor as float16 numpy, refused when a value does not fit float16."""
        t = self.get(suffix, FLOATS, shape, what)
        try:
            return scale16(t.float().numpy())
        except ValueError:
            raise self.error(
                suffix,
                f"holds a scale of magnitude {t.float().abs().max().item():g}, past "
                "float16's 65504, which the quantized kernels store scales in",
            ) from None

    def words(self, suffix: str, shape: tuple[int, ...], what: str = "") -> np.ndarray:
        """An int32 tensor of packed values as uint32 numpy (the bits as stored)."""
        return self.get(suffix, (torch.int32,), shape, what).numpy().view(np.uint32)

    def pop_all(self, suffixes: tuple[str, ...]) -> None:
        """Drop this layer's quantization tensors from the checkpoint dict (they live on in the QuantWeight)."""
        for s in suffixes:
            self.tensors.pop(self.name(s), None)


def unpack_words(words: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """uint32 words holding 32 / bits values each (value j at bits j * bits, low first) unpacked along axis.

    order[j] is the position within its run of 32 / bits that value j of a word lands at (AWQ's
    interleave); None is the plain order. The result is uint8 with the axis 32 / bits times longer.
    """
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * bits
    w = np.moveaxis(words, axis, -1)
    vals = ((w[..., None] >> shifts) & np.uint32((1 << bits) - 1)).astype(np.uint8)  # [..., words, per]
    if order is not None:
        out = np.empty_like(vals)
        out[..., list(order)] = vals
        vals = out
    vals = vals.reshape(*w.shape[:-1], w.shape[-1] * per)
    return np.moveaxis(vals, -1, axis)


def group_order(t: LinearTensors, suffix: str, k: int, group: int, groups: int) -> np.ndarray | None:
    """The k order that makes a g_idx tensor's groups contiguous (act-order), or None when they already are.

    Each group must hold exactly `group` inputs (the last one the rest), as GPTQ's act-order writes them.
    """
    g_idx = t.get(suffix, (torch.int32, torch.int64), (k,), "in_features").numpy().astype(np.int64)
    if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
        bad = int(g_idx[(g_idx < 0) | (g_idx >= groups)][0])
        raise t.error(suffix, f"holds group {bad}, outside the {groups} groups that the scales have")
    if groups == 1 or np.array_equal(g_idx, np.arange(k) // group):
        return None
    counts = np.bincount(g_idx, minlength=groups)
    expected = np.minimum(group, k - np.arange(groups) * group)
    if (counts != expected).any():
        g = int(np.nonzero(counts != expected)[0][0])
        raise t.error(suffix, f"puts {counts[g]} inputs in group {g}, expected {expected[g]} (group_size = {group})")
    return np.argsort(g_idx, kind="stable").astype(np.int32)
