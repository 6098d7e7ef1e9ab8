"""GPTQ, AWQ and compressed-tensors layers against the formats' own packing and dequantization, and our kernel.

References (quant_reference.py vendors what does not install here): auto-gptq's QuantLinear.pack and
dequantization (GPTQ v1), GPTQModel's dequantize_weight (gptq_v2), AutoAWQ's WQLinear_GEMM.from_linear and
dequantize_gemm; compressed-tensors itself (installed and run): its compressors, its decompressors and its
AutoAWQ converter.

Tolerances: GPTQ and AWQ store f16 scales, so our dequantization equals the reference bit for bit;
compressed-tensors' float32 scales are stored as f16 by us, within 2**-11 of each scale. The kernel's
output equals the product of the int8-quantized activations (per row and block of 32, in the weight's k
order) with the dequantized weight to f32 accuracy, and torch's float product within 2%.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cpuinfer.errors import ModelLoadError
from cpuinfer.quantization import awq, compressed_tensors, gptq
from cpuinfer.quantization.linear_tensors import LinearTensors

from ..kernels.test_quant_linear import int8_rows
from . import quant_reference as ref
from .quant_checkpoints import _ct, awq_tensors, ct_config, gptq_config, gptq_tensors, group_index, rtn

GPTQ_CASES = [
    (bits, group, sym, act)
    for bits in (4, 8)
    for group in (32, 128, -1)
    for sym in (True, False)
    for act in (False, True)
]


def weight(n: int = 96, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def layer(tensors: dict[str, torch.Tensor], method: str) -> LinearTensors:
    return LinearTensors("layer", {f"layer.{k}": v for k, v in tensors.items()}, "test", method)


def check_kernel(w, dense: torch.Tensor, kernels) -> None:
    """Our kernel on w against the product with the reference weight in float64: of the activations as they are
    for a weight-only format (w.act16: within 1e-5 of sum |w x|, float32 rounding), of their int8 rows otherwise;
    and against torch's float product."""
    x = torch.randn(7, dense.shape[1])
    out = torch.empty(7, dense.shape[0])
    kernels.quant_linear(out, x, w, None)
    order = w.perm.long() if w.perm is not None else torch.arange(dense.shape[1])
    xs, ws = x[:, order].double(), dense[:, order].double()
    full = x.double() @ dense.double().T
    if w.act16:
        size = (xs.abs() @ ws.abs().T).max().item()
        torch.testing.assert_close(out.double(), full, rtol=0, atol=1e-5 * size)
        return
    exact = int8_rows(x[:, order]).double() @ ws.T
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())
    assert (out.double() - full).abs().max() <= 0.02 * full.abs().max()


@pytest.mark.parametrize("bits,group,sym,act", GPTQ_CASES)
def test_gptq_packer_is_autogptqs(bits, group, sym, act):
    """Our GPTQ packer writes auto-gptq's qweight and qzeros bit for bit (v1 format)."""
    w = weight()
    g_idx = group_index(256, group, act, seed=1)
    q, scales, zeros = rtn(w, bits, sym, g_idx)
    ours = gptq_tensors(q, scales, zeros, g_idx, bits)
    deq = scales.float()[:, g_idx] * (q - zeros[:, g_idx])  # on the grid: auto-gptq's pack rounds back to q
    qweight, qzeros, sc = ref.autogptq_pack(deq, scales.float(), zeros.float(), torch.from_numpy(g_idx), bits)
    assert torch.equal(ours["qweight"], qweight) and torch.equal(ours["qzeros"], qzeros)
    assert torch.equal(ours["scales"].float(), sc)


@pytest.mark.parametrize("bits,group,sym,act", GPTQ_CASES)
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_layer_matches_reference(kernels, bits, group, sym, act, fmt):
    """Our QuantWeight of a GPTQ layer dequantizes to auto-gptq's (v1) / GPTQModel's (v2) weight exactly; the
    kernel (x read through the act-order perm) matches torch on it."""
    w = weight(seed=bits + group)
    g_idx = group_index(256, group, act, seed=2)
    q, scales, zeros = rtn(w, bits, sym, g_idx)
    t = gptq_tensors(q, scales, zeros, g_idx, bits, v1=fmt == "gptq")
    dequant = ref.autogptq_dequantize if fmt == "gptq" else ref.gptqmodel_dequantize_v2
    dense = dequant(t["qweight"], t["qzeros"], t["scales"].float(), t["g_idx"], bits).T.float()
    s = gptq.scheme(
        {**gptq_config(dict(bits=bits, group=group, sym=sym, act_order=act)), "checkpoint_format": fmt}, "test"
    )
    qw = gptq.read(layer(t, "gptq"), s)
    assert (qw.perm is not None) == (act and group != -1)
    assert torch.equal(qw.dequantize(), dense)
    check_kernel(qw, dense, kernels)


def test_gptq_v1_zero_point_past_8_bits():
    """v1 stores z - 1; a stored 255 (8 bit) reads as 256 (auto-gptq's rule): kept in minimum form, within f16."""
    w = weight(32, 64)
    g_idx = np.arange(64) // 32
    q, scales, zeros = rtn(w, 8, False, g_idx)
    zeros[3, 1] = 256
    t = gptq_tensors(q, scales, zeros, g_idx, 8)
    dense = ref.autogptq_dequantize(t["qweight"], t["qzeros"], t["scales"].float(), t["g_idx"], 8).T.float()
    qw = gptq.read(layer(t, "gptq"), gptq.scheme(gptq_config(dict(bits=8, group=32, sym=False, act_order=False)), ""))
    assert qw.m is not None
    torch.testing.assert_close(qw.dequantize(), dense, rtol=0, atol=2.0**-11 * 256 * scales.float().max().item())


@pytest.mark.parametrize("group", [64, 128])
def test_awq_packer_and_layer_match_autoawq(kernels, group):
    """Our AWQ packer writes AutoAWQ's tensors bit for bit; our dequantization equals AutoAWQ's dequantize_gemm
    and compressed-tensors' own AutoAWQ converter + decompressor (run here); the kernel matches torch."""
    w = weight(seed=group)
    q, scales, zeros = rtn(w, 4, False, np.arange(256) // group)
    ours = awq_tensors(q, scales, zeros)
    deq = scales.float()[:, np.arange(256) // group] * (q - zeros[:, np.arange(256) // group])
    qweight, qzeros, sc = ref.autoawq_pack(deq, 4, group, scales.float().T.contiguous(), zeros.T.contiguous())
    assert torch.equal(ours["qweight"], qweight) and torch.equal(ours["qzeros"], qzeros)
    assert torch.equal(ours["scales"], sc)
    dense = ref.dequantize_gemm(ours["qweight"], ours["qzeros"], ours["scales"].float(), 4, group).T.float()
    qw = awq.read(layer(ours, "awq"), awq.scheme({"quant_method": "awq", "group_size": group}, "test"))
    assert torch.equal(qw.dequantize(), dense)
    check_kernel(qw, dense, kernels)

    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    conv = AutoAWQConverter(bits=4, group_size=group).process({f"l.{k}": v for k, v in ours.items()})
    scheme = ct.quantization.QuantizationScheme(
        targets=["Linear"],
        weights=ct.quantization.QuantizationArgs(
            num_bits=4, type="int", symmetric=False, strategy="group", group_size=group
        ),
    )
    got = BaseCompressor.load_from_registry("pack-quantized").decompress(
        {k.removeprefix("l."): v for k, v in conv.items()}, scheme
    )["weight"]
    assert got.dtype == torch.float16 and torch.equal(qw.dequantize().half(), got)  # it multiplies in f16


CT_CASES = [
    dict(scheme="W8A8"),
    dict(scheme="W8A8", sym=False),
    dict(scheme="W4A16", group=32),
    dict(scheme="W4A16", group=128, sym=False),
    dict(scheme="W4A16", sym=False),
    dict(scheme="W4A16", bits=8),
]


@pytest.mark.parametrize("opts", CT_CASES, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_compressed_tensors_layer_matches_decompress(kernels, opts):
    """compressed-tensors' own compressor writes the layer, its decompressor is the reference: our dequantization
    within the f16 rounding of its float32 scales; the kernel matches torch."""
    pytest.importorskip("compressed_tensors")
    t, dense = _ct(weight(seed=3), opts, seed=0)
    qw = compressed_tensors.read(layer(t, "compressed-tensors"), compressed_tensors.scheme(ct_config(opts), "test"))
    dense = dense.float()
    scale = t["weight_scale"].float().abs().max().item()
    torch.testing.assert_close(qw.dequantize(), dense, rtol=2.0**-11, atol=2.0**-11 * scale * 2 ** opts.get("bits", 8))
    check_kernel(qw, qw.dequantize(), kernels)


def test_compressed_tensors_scale_past_f16_is_refused():
    """A scale float16 cannot hold is a clear error naming the tensor (never inf in the kernel)."""
    pytest.importorskip("compressed_tensors")
    opts = dict(scheme="W8A8")
    t, _ = _ct(weight(), opts, seed=0)
    t["weight_scale"] = t["weight_scale"] * 1e9  # ~4e5, past float16's 65504
    with pytest.raises(ModelLoadError, match=r"'layer\.weight_scale' holds a scale of magnitude .* past float16"):
        compressed_tensors.read(layer(t, "compressed-tensors"), compressed_tensors.scheme(ct_config(opts), "test"))


@pytest.mark.parametrize("act", [False, True])
def test_gptq_short_last_group(kernels, act):
    """group_size 128 over 192 inputs (GPTQ allows a short last group, as SmolLM2's 576 in g128 has): stored
    as groups of gcd(192, 128) = 64, still exactly auto-gptq's weight."""
    w = weight(48, 192)
    g_idx = group_index(192, 128, act, seed=5)
    q, scales, zeros = rtn(w, 4, False, g_idx)
    t = gptq_tensors(q, scales, zeros, g_idx, 4)
    dense = ref.autogptq_dequantize(t["qweight"], t["qzeros"], t["scales"].float(), t["g_idx"], 4).T.float()
    qw = gptq.read(layer(t, "gptq"), gptq.scheme(gptq_config(dict(bits=4, group=128, sym=False, act_order=act)), ""))
    assert qw.group == 64 and torch.equal(qw.dequantize(), dense)
    check_kernel(qw, dense, kernels)
