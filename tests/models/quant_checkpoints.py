"""Quantized Hugging Face checkpoints for the tests: GPTQ, AWQ and compressed-tensors, with their references.

quantize_dir(src, dst, method, ...) rewrites every decoder projection of a float checkpoint (a tiny
random Llama written by transformers, or SmolLM2 converted from its GGUF file) into one format, by
round-to-nearest, and writes beside it the reference: the same checkpoint with each projection
replaced by the format's own dequantization (quant_reference.py's vendored auto-gptq / GPTQModel /
AutoAWQ code; compressed-tensors' own decompressor), which transformers then runs.

GPTQ and AWQ tensors are packed by our packers below (the tools do not run here; test_quant_formats.py
shows the packers bit-for-bit equal to the tools' own); compressed-tensors checkpoints are written by
compressed-tensors itself (its qparams, its compressors, its config).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from . import quant_reference as ref

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def rtn(w: torch.Tensor, bits: int, sym: bool, g_idx: np.ndarray):
    """GPTQ's quantizer grid (Quantizer.find_params) per group, round to nearest: q [N, K], scales f16 and
    zeros int [N, G]. Zero points are kept >= 1 (auto-gptq's v1 packing cannot store 0)."""
    n, _k = w.shape
    groups = int(g_idx.max()) + 1
    maxq = 2**bits - 1
    scales = torch.empty(n, groups)
    zeros = torch.empty(n, groups)
    for g in range(groups):
        cols = w[:, torch.from_numpy(np.nonzero(g_idx == g)[0])]
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        s = ((hi - lo) / maxq).clamp(min=1e-6)
        scales[:, g] = s
        zeros[:, g] = torch.full_like(s, (maxq + 1) // 2) if sym else torch.round(-lo / s).clamp(1, maxq)
    scales = scales.half()
    gi = torch.from_numpy(g_idx).long()
    q = torch.clamp(torch.round(w / scales.float()[:, gi]) + zeros[:, gi], 0, maxq).to(torch.int32)
    return q, scales, zeros.to(torch.int32)


def pack_words(values: np.ndarray, bits: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Our packer: the last axis, 32 / bits values per int32, value j at bits j * bits (order: AWQ's
    interleave, word value j = position order[j] of its run)."""
    per = 32 // bits
    v = values.astype(np.uint32).reshape(*values.shape[:-1], -1, per)
    if order is not None:
        v = v[..., list(order)]
    words = (v << (np.arange(per, dtype=np.uint32) * bits)).sum(-1, dtype=np.uint32)
    return words.view(np.int32)


def gptq_tensors(q, scales, zeros, g_idx, bits: int, v1: bool = True) -> dict[str, torch.Tensor]:
    """Our GPTQ packer: qweight [K * bits / 32, N], qzeros [G, N * bits / 32] (v1: minus 1), scales, g_idx."""
    z = zeros.numpy().T - (1 if v1 else 0)
    z = z & (2**bits - 1)
    qweight = pack_words(np.ascontiguousarray(q.numpy()), bits).T  # [N, K/per] -> [K/per, N]
    return {
        "qweight": torch.from_numpy(np.ascontiguousarray(qweight)),
        "qzeros": torch.from_numpy(pack_words(np.ascontiguousarray(z), bits)),
        "scales": scales.T.contiguous(),
        "g_idx": torch.from_numpy(g_idx.astype(np.int32)),
    }


def awq_tensors(q, scales, zeros) -> dict[str, torch.Tensor]:
    """Our AWQ packer: qweight [K, N / 8], qzeros [G, N / 8] in AWQ's order, scales [G, N]."""
    return {
        "qweight": torch.from_numpy(pack_words(np.ascontiguousarray(q.numpy().T), 4, AWQ_ORDER)),
        "qzeros": torch.from_numpy(pack_words(np.ascontiguousarray(zeros.numpy().T), 4, AWQ_ORDER)),
        "scales": scales.T.contiguous(),
    }


def group_index(k: int, group: int, act_order: bool, seed: int) -> np.ndarray:
    """g_idx: k // group, or with act-order the groups of a random input order (as GPTQ's desc_act writes)."""
    group = k if group == -1 else group
    if not act_order:
        return np.arange(k) // group
    order = np.random.default_rng(seed).permutation(k)
    g_idx = np.empty(k, np.int64)
    g_idx[order] = np.arange(k) // group
    return g_idx


def _gptq(w: torch.Tensor, opts: dict, seed: int):
    bits, group, sym, act, v1 = opts["bits"], opts["group"], opts["sym"], opts["act_order"], opts.get("v1", True)
    g_idx = group_index(w.shape[1], group, act, seed)
    q, scales, zeros = rtn(w, bits, sym, g_idx)
    t = gptq_tensors(q, scales, zeros, g_idx, bits, v1)
    dequant = ref.autogptq_dequantize if v1 else ref.gptqmodel_dequantize_v2
    deq = dequant(t["qweight"], t["qzeros"], t["scales"].float(), t["g_idx"], bits).T
    return t, deq


def _awq(w: torch.Tensor, opts: dict, seed: int):  # noqa: ARG001 - METHODS' common signature
    group = opts["group"]
    q, scales, zeros = rtn(w, 4, False, np.arange(w.shape[1]) // group)
    t = awq_tensors(q, scales, zeros)
    return t, ref.dequantize_gemm(t["qweight"], t["qzeros"], t["scales"].float(), 4, group).T


def gptq_config(opts: dict) -> dict:
    """quantization_config as optimum / gptqmodel write it."""
    return {
        "quant_method": "gptq",
        "bits": opts["bits"],
        "group_size": opts["group"],
        "sym": opts["sym"],
        "desc_act": opts["act_order"],
        "checkpoint_format": "gptq" if opts.get("v1", True) else "gptq_v2",
    }


def awq_config(opts: dict) -> dict:
    """quantization_config as AutoAWQ writes it."""
    return {"quant_method": "awq", "bits": 4, "group_size": opts["group"], "zero_point": True, "version": "gemm"}


def ct_scheme(opts: dict):
    """compressed-tensors' own QuantizationScheme for opts: W8A8 (int-quantized) or W4A16 (pack-quantized)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w8a8 = opts["scheme"] == "W8A8"
    args = QuantizationArgs(
        num_bits=8 if w8a8 else opts.get("bits", 4),
        type="int",
        symmetric=opts.get("sym", True),
        strategy="group" if opts.get("group") else "channel",
        group_size=opts.get("group"),
    )
    acts = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True) if w8a8 else None
    return QuantizationScheme(
        targets=["Linear"], weights=args, input_activations=acts, format="int-quantized" if w8a8 else "pack-quantized"
    )


def _ct(w: torch.Tensor, opts: dict, seed: int):  # noqa: ARG001 - METHODS' common signature
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = ct_scheme(opts)
    group = opts.get("group") or w.shape[1]
    wg = w.reshape(w.shape[0], -1, group)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), scheme.weights)
    comp = BaseCompressor.load_from_registry(scheme.format)
    t = comp.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    return t, comp.decompress(dict(t), scheme)["weight"]


def ct_config(opts: dict) -> dict:
    """compressed-tensors' own QuantizationConfig, lm_head ignored."""
    from compressed_tensors.quantization import QuantizationConfig

    scheme = ct_scheme(opts)
    cfg = QuantizationConfig(
        config_groups={"group_0": scheme}, format=scheme.format, ignore=["lm_head"], quantization_status="compressed"
    )
    return cfg.model_dump(mode="json")


METHODS = {"gptq": (_gptq, gptq_config), "awq": (_awq, awq_config), "compressed-tensors": (_ct, ct_config)}


def hf_from_gguf(gguf_path: str, out: str) -> str:
    """A GGUF model as a float32 Hugging Face checkpoint in out, converted by transformers (gguf_file=...)."""
    import transformers

    from .greedy import hf_gguf_model  # the session's float32 model of the file: not a second parse of it

    directory, file = os.path.split(gguf_path)
    model = hf_gguf_model(gguf_path)
    os.makedirs(out, exist_ok=True)
    # save_pretrained refuses a model loaded from GGUF: write its float32 tensors and config ourselves.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    state = {
        k: v.contiguous()
        for k, v in model.state_dict().items()
        if not (k == "lm_head.weight" and config.get("tie_word_embeddings"))
    }
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    transformers.AutoTokenizer.from_pretrained(directory, gguf_file=file).save_pretrained(out)
    return out


def quantize_dir(src: str, dst: str, method: str, **opts) -> str:
    """Write dst (the quantized checkpoint) and dst + "-ref" (its reference dequantization); returns the latter."""
    quant, config_of = METHODS[method]
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    out, deq = {}, {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix.rsplit(".", 1)[-1] in PROJECTIONS:
            parts, w = quant(t.float(), opts, seed=i)
            out.update({f"{prefix}.{k}": v.contiguous() for k, v in parts.items()})
            deq[name] = w.float().contiguous()
        else:
            out[name] = deq[name] = t.contiguous()
    ref_dir = dst + "-ref"
    for d, weights in ((dst, out), (ref_dir, deq)):
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(src):
            if not f.endswith(".safetensors") and not f.endswith(".index.json"):
                shutil.copy(os.path.join(src, f), d)
        save_file(weights, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = config_of(opts)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return ref_dir
