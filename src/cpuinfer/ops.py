"""Tensor-level entry points to the selected kernel variant.

Each function takes torch tensors (any CPU tensor that speaks DLPack works)
and calls the variant chosen at import. Validation happens in the compiled
binding, so bad shapes, dtypes or strides raise TypeError/ValueError/IndexError
naming the argument instead of crashing.
"""

from __future__ import annotations

import torch

from . import _C
from .platform.memory import empty_weight
from .quantization.weight import is_quantized


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * weight, computed in float32."""
    if out is None:
        out = torch.empty_like(x)
    _C.rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = rms_norm(residual)."""
    _C.fused_add_rms_norm(x, residual, weight, eps)


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """LayerNorm(x + residual) (or of x alone), the sum rounded to x's dtype as an unfused add would be, its
    statistics in float32, float32 weight and bias; out may be x or residual (an encoder's post-norm block)."""
    if out is None:
        out = torch.empty_like(x)
    _C.add_layer_norm(out, x, residual, weight, bias, eps)
    return out


def gelu(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(x), approximate 'none' (erf) or 'tanh' (the gated kernels' own activation); out may be x."""
    kernels = {"none": _C.gelu, "tanh": _C.gelu_tanh}
    if approximate not in kernels:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    if out is None:
        out = torch.empty_like(x)
    kernels[approximate](out, x)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) (int64), with torch's answer (the first index of the maximum, or of the first NaN),
    at memory speed: torch's reduction takes milliseconds over a batch of vocabulary-wide rows."""
    out = torch.empty(logits.shape[:-1].numel(), dtype=torch.int64)
    _C.argmax(out, logits)
    return out.view(logits.shape[:-1])


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """Rotate query (and key) in place by their positions (vLLM's signature)."""
    _C.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def _act(fn, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype)
    fn(out, x)
    return out


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:]."""
    return _act(_C.silu_and_mul, x, out)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none", out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(x[..., :d]) * x[..., d:], with approximate 'none' (erf) or 'tanh'."""
    if approximate == "none":
        return _act(_C.gelu_and_mul, x, out)
    if approximate == "tanh":
        return _act(_C.gelu_tanh_and_mul, x, out)
    raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")


def swiglu_oai_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU: (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7), for
    x = [gate | up]."""
    return _act(_C.swiglu_oai_and_mul, x, out)


def cache_view(cache: torch.Tensor) -> torch.Tensor:
    """A KV cache as the kernels take it (float8_e5m2 caches as their uint8 bytes)."""
    # DLPack has no portable float8 code: fp8 caches cross as their bytes, and
    # the kernels read uint8 caches as float8_e5m2.
    if cache.dtype == torch.float8_e5m2:
        return cache.view(torch.uint8)
    if cache.dtype == torch.uint8:
        raise TypeError("KV caches must be float32, bfloat16, float16 or float8_e5m2 tensors, not uint8")
    return cache


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, kv_heads, head_size] into the paged caches at slot_mapping (negative = skip)."""
    _C.reshape_and_cache(key, value, cache_view(key_cache), cache_view(value_cache), slot_mapping)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
) -> None:
    """Causal GQA attention of a mixed decode/prefill batch over the paged KV cache, written into out (sinks: a
    float32 logit per query head that joins each row's softmax sum, gpt-oss's attention sinks; causal=False:
    every row sees its whole sequence, an encoder's bidirectional attention over whole prompts)."""
    _C.paged_attention(
        out,
        query,
        cache_view(key_cache),
        cache_view(value_cache),
        query_start_loc,
        seq_lens,
        block_tables,
        float(scale),
        int(sliding_window),
        float(soft_cap),
        sinks,
        bool(causal),
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a matrix of rows [*, in_features] whose last dimension is contiguous (the kernels' input)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def linear(
    x: torch.Tensor,
    weight,
    bias: torch.Tensor | None = None,
    packed: bool = False,
    out_dtype: torch.dtype | None = None,
    rounded: bool = False,
) -> torch.Tensor:
    """x @ weight.T (+ bias): our kernel for bf16/f16 and quantized weights, torch.nn.functional.linear otherwise.

    packed: weight is in the layout pack_weight() writes (our kernel only).
    weight may be a QuantWeight / QuantStack (cpuinfer.quantization): see quant_linear.
    out_dtype: x's dtype (None), or torch.float32 for the f32 sums unrounded (a share that other ranks' shares
    join before the one rounding).
    rounded: with out_dtype float32, the result in x's dtype as float32 (the same values as
    linear(...).float(); our kernel writes them at once, without the x-dtype output and its conversion).
    """
    out_dtype = _out_dtype(x, out_dtype)
    if rounded and out_dtype != torch.float32:
        raise ValueError(f"rounded=True needs out_dtype=torch.float32, got {out_dtype}")
    if rounded and x.dtype == torch.float32:
        rounded = False  # float32 sums are the result already
    if rounded and not _our_dense(x, weight, bias):
        return linear(x, weight, bias, packed).float()
    if is_quantized(weight):
        return quant_linear(x, weight, bias, out_dtype)
    # Dispatch (the rule itself is in csrc/common/linear.cpp, so the fused
    # decoder layer follows it too). bf16/f16 take our kernel at every M:
    # - packed weights (what the model loader keeps): one register-tile kernel
    #   that is the GEMV for a few rows and a blocked GEMM for many (VDPBF16PS
    #   on avx512bf16/amx, f32 FMA elsewhere). Measured on 2 Zen 4 cores
    #   (benchmarks/bench_linear.py, SmolLM2 and Gemma 3 shapes): 3.5-6x torch
    #   bf16 at M = 1, 1.3-1.7x at M = 32, 1.03-1.07x at M = 512 (94-96% of the
    #   measured VDPBF16PS peak; torch runs at ~90% of it there). On CPUs
    #   without native bf16 dot products torch's bf16 GEMM is far slower still.
    # - row-major weights: the GEMV kernel at every M (from M = 32 on
    #   avx512bf16 ~2.5x slower than the packed GEMM, and slower than torch:
    #   pack the weight to get the GEMM).
    # Either way one kernel per weight for every row count, so each row's
    # result is independent of how tokens were batched (the engine's greedy
    # outputs rely on that; tests/kernels/test_linear.py checks it across the
    # GEMV/GEMM boundary). f32 stays on torch (its f32 GEMM is fast and
    # bandwidth is the same).
    if _our_dense(x, weight, bias):
        x2 = _rows(x)
        out = torch.empty(x2.shape[0], weight.shape[0], dtype=out_dtype)
        _C.linear(out, x2, weight, bias, packed, rounded)
        return out.view(*x.shape[:-1], weight.shape[0])
    if packed:
        raise ValueError(
            f"a packed weight needs bfloat16/float16 input, weight and bias of one dtype; got input "
            f"{x.dtype}, weight {weight.dtype}"
        )
    if out_dtype != x.dtype:  # torch rounds to its inputs' dtype: multiply in the output's
        x, weight = x.to(out_dtype), weight.to(out_dtype)
        bias = None if bias is None else bias.to(out_dtype)
    return torch.nn.functional.linear(x, weight, bias)


def _our_dense(x: torch.Tensor, weight, bias: torch.Tensor | None) -> bool:
    """Whether linear() takes our dense bf16/f16 kernel for these operands."""
    return (
        not is_quantized(weight)
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.ndim >= 1
        and weight.dtype == x.dtype
        and weight.ndim == 2
        and weight.is_contiguous()
        and (bias is None or bias.dtype == x.dtype)
    )


def quant_linear(
    x: torch.Tensor, weight, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """x @ W.T (+ bias) for a quantized W: x quantized per row and block of 32 to int8, integer dot products.

    Each row's result depends on that row alone (not on the batch), and is the same on every variant.
    out_dtype: as linear's.
    """
    x2 = _rows(x)
    out = torch.empty(x2.shape[0], weight.n, dtype=_out_dtype(x, out_dtype))
    _C.quant_linear(out, x2, weight, bias)
    return out.view(*x.shape[:-1], weight.n)


def _out_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    if out_dtype is None or out_dtype == x.dtype:
        return x.dtype
    if out_dtype != torch.float32:
        raise ValueError(f"out_dtype must be the input's dtype ({x.dtype}) or torch.float32, got {out_dtype}")
    return out_dtype


def pack_layout(dtype: torch.dtype, kernels=None) -> tuple[int, int]:
    """(panel columns C, pair P) of the packed layout for dtype on a variant (default: the selected one)."""
    kernels = kernels or _C
    return kernels.LINEAR_PACK_COLS, kernels.linear_pack_pair(str(dtype).removeprefix("torch."))


def can_pack(weight: torch.Tensor) -> bool:
    """True if pack_weight() can take this weight: 2-D bf16/f16, in_features a multiple of the layout's pair."""
    if is_quantized(weight) or weight.ndim != 2 or weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    return weight.shape[1] % pack_layout(weight.dtype)[1] == 0 and weight.shape[0] > 0


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] in the panel layout linear(packed=True) reads: the GEMV's one stream, the GEMM's B tiles.

    Output features in panels of C (2 vectors of the variant), each panel k-major with P consecutive k
    per column adjacent (P = 2 where the variant's tile multiplies pairs of k: bf16 on VDPBF16PS, AMX and
    BFDOT, f16 on AMX-FP16; else 1; see pack_layout()); rows past the last full panel stay row-major. The
    layout depends on the kernel variant and, on amx, the CPU: pack in the process that runs the model.
    """
    out = empty_weight(weight.shape, weight.dtype)  # huge pages while ModelRunner builds a model
    _C.linear_pack_weight(out, weight.contiguous())
    return out


def packed_rows(weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """weight_original[ids] read from a packed weight (an embedding table that doubles as the tied lm_head)."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.shape[0], weight.shape[1], dtype=weight.dtype)
    _C.linear_packed_rows(out, weight, ids)
    return out


def DecoderLayer(plan):  # named for the kernel class it constructs
    """One pre-norm decoder layer (a models.plan.LayerPlan, read by field name) as a single kernel call; see
    cpuinfer.models.executor.fused_layer."""
    return _C.DecoderLayer(plan)


def DecoderStack(layers):  # named for the kernel class it constructs
    """A pipeline stage's fused layers (DecoderLayer objects) run in order by one call: one check pass and one GIL
    release a step instead of a Python round trip per layer; see cpuinfer.models.decoder.stage_stack."""
    return _C.DecoderStack(list(layers))


def MoE(mlp, packed: bool = False):  # named for the kernel class it constructs
    """A mixture-of-experts MLP (a models.plan.MoEMLP, read by field name) as one kernel call: .forward(out, x)."""
    return _C.MoE(mlp, packed)
