"""Every architecture, as a tiny random-weight checkpoint written by transformers, against transformers itself."""

from __future__ import annotations

import pytest
import torch

from cpuinfer import ops
from cpuinfer.engine.step import ScheduledSeq
from cpuinfer.model_loader import load_model_spec
from cpuinfer.worker import ModelRunner

from .greedy import greedy, hf_greedy

transformers = pytest.importorskip("transformers")

VOCAB = 256
# head size 64 runs on the compiled paged-attention kernels; Qwen2's 32 exercises the torch fallback.
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    initializer_range=0.1,
)

# name -> (config class, kwargs); each exercises the family's own features.
CASES = {
    "llama": (
        "LlamaConfig",
        dict(
            COMMON,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "llama_bias_linear_rope": (
        "LlamaConfig",
        dict(
            COMMON,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
        ),
    ),
    "mistral": ("MistralConfig", dict(COMMON, sliding_window=16)),
    "qwen2": ("Qwen2Config", dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "qwen3": ("Qwen3Config", dict(COMMON, num_attention_heads=4, head_dim=64)),
    # transformers ignores attn_logit_softcapping for Gemma 3 (its checkpoints set none), so it is left out here.
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            COMMON,
            head_dim=64,
            sliding_window=16,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=20.0,
        ),
    ),
    # Mixture of experts: 8 experts, top 2; Qwen3-MoE with one dense layer (mlp_only_layers) and unnormalized
    # top-k weights, Mixtral renormalized.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            COMMON,
            head_dim=64,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral": ("MixtralConfig", dict(COMMON, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)),
    # gpt-oss: attention sinks, biases, alternating sliding window, YaRN; biased router (top-k logits then
    # softmax), biased experts, the clamped SwiGLU
    "gpt_oss": (
        "GptOssConfig",
        dict(
            COMMON,
            intermediate_size=64,
            num_attention_heads=4,
            head_dim=64,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 128,
                "truncate": False,
            },
        ),
    ),
    "phi3": ("Phi3Config", dict(COMMON, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    # LongRoPE's short factors (the whole 512-token context is the original one) and a partial rotary dimension
    # (Phi-4-mini's 3/4 of each head); the long factors and their attention factor: test_longrope_long_context.
    "phi3_longrope": (
        "Phi3Config",
        dict(
            COMMON,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            original_max_position_embeddings=512,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.05 * i for i in range(24)],
                "long_factor": [1.0 + 0.5 * i for i in range(24)],
            },
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        dict(
            COMMON,
            head_dim=64,
            sliding_window=16,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=20.0,
            final_logit_softcapping=20.0,
        ),
    ),
    "opt": (
        "OPTConfig",
        dict(
            vocab_size=VOCAB,
            hidden_size=128,
            ffn_dim=256,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=512,
            word_embed_proj_dim=128,
            init_std=0.1,
        ),
    ),
}
PROMPTS = [
    [5, 17, 99, 3, 250, 41, 7, 7, 8, 120, 33, 2, 64, 91, 11, 200, 19, 45, 61, 72],
    list(range(30, 67)),
    [9, 8, 7],
]
NEW_TOKENS = 64


def _checkpoint(tmp_path_factory, name: str, shard: bool = False):
    cls_name, kwargs = CASES[name]
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, **({"max_shard_size": "100KB"} if shard else {}))
    return path, model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    path, model = _checkpoint(tmp_path_factory, request.param, shard=request.param == "qwen2")
    spec = load_model_spec(str(path), "float32")
    runner = ModelRunner(spec, block_size=16, num_blocks=64, cache_dtype=torch.float32)
    return request.param, path, model, runner


def test_greedy_matches_transformers(case):
    """Prefill + decode, chunked prefill and a mixed batch all reproduce transformers' greedy tokens."""
    name, _, model, runner = case
    ref = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    for mode in (dict(), dict(chunk=16), dict(batched=True, chunk=7)):
        out, first = greedy(runner, PROMPTS, NEW_TOKENS, **mode)
        for i, (toks, logits) in enumerate(zip(out, first, strict=True)):
            assert toks == ref[i][0], f"{name} {mode} prompt {i}: tokens differ from transformers"
            torch.testing.assert_close(logits, ref[i][1], atol=1e-4, rtol=1e-4)


def test_spec_describes_the_checkpoint(case):
    name, path, model, runner = case
    spec = runner.spec
    cfg = model.config
    assert spec.num_layers == cfg.num_hidden_layers and spec.vocab_size == VOCAB
    assert spec.max_model_len == cfg.max_position_embeddings
    assert spec.dtype == torch.float32  # float32 checkpoint, auto -> float32 too
    assert load_model_spec(str(path)).dtype == torch.float32
    assert load_model_spec(str(path), "bfloat16").dtype == torch.bfloat16
    assert spec.kv_bytes_per_token(torch.bfloat16) == spec.num_layers * 2 * spec.num_kv_heads * spec.head_size * 2
    if name == "mistral":
        assert spec.sliding_window_layers == [16, 16]
    if name == "gemma3":
        assert spec.sliding_window_layers == [16, 0]


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e5m2])
def test_low_precision_runs_stay_close(tmp_path_factory, cache_dtype):
    """bfloat16 weights/activations (and an fp8 KV cache) keep first-token logits near the float32 reference."""
    path, model = _checkpoint(tmp_path_factory, "llama")
    spec = load_model_spec(str(path), "bfloat16")
    runner = ModelRunner(spec, block_size=16, num_blocks=16, cache_dtype=cache_dtype)
    _, first = greedy(runner, PROMPTS[:2], 1)
    for prompt, logits in zip(PROMPTS[:2], first, strict=True):
        _, ref = hf_greedy(model, prompt, 1)
        # bf16 has ~3 significant digits; fp8-e5m2 keys/values ~2.
        tol = 0.05 if cache_dtype == torch.bfloat16 else 0.15
        assert (logits - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize(
    "name",
    ["llama_bias_linear_rope", "mistral", "qwen3", "gemma3", "gemma2", "phi3", "qwen3_moe", "mixtral", "gpt_oss"],
)
@pytest.mark.parametrize("dtype,cache_dtype", [("bfloat16", torch.bfloat16), ("float16", torch.float8_e5m2)])
def test_fused_layers_equal_the_per_op_path(tmp_path_factory, monkeypatch, name, dtype, cache_dtype):
    """bf16/f16 runs go through one fused kernel call per layer; it must equal the per-op path bit for bit.

    Covers the biases, sliding windows, q/k norms, Gemma's sandwich norms and GELU, an fp8 cache, chunked
    prefill mixed with decodes, and block tables in non-identity order (greedy() arranges all of that).
    """
    path, _ = _checkpoint(tmp_path_factory, name)
    spec = load_model_spec(str(path), dtype)
    results = {}
    for fused in (True, False):
        monkeypatch.setenv("CPUINFER_FUSED_LAYERS", "1" if fused else "0")
        runner = ModelRunner(spec, block_size=16, num_blocks=64, cache_dtype=cache_dtype)
        assert all((layer.fused is not None) == fused for layer in runner.model.layers)
        results[fused] = greedy(runner, PROMPTS, 24, batched=True, chunk=7)
    (tokens, first), (ref_tokens, ref_first) = results[True], results[False]
    assert tokens == ref_tokens
    for got, want in zip(first, ref_first, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["llama_bias_linear_rope", "gemma3"])
def test_fused_layer_over_1024_tokens_equals_the_per_op_path(tmp_path_factory, monkeypatch, name):
    """A step of more than 1024 tokens: the fused layer runs its MLP 1024 rows at a time (a long prefill's
    largest scratch); every kernel gives a row the same bits in any batch, so the logits equal the per-op
    path's, and both stay within bf16 accuracy of transformers' on each prompt."""
    path, model = _checkpoint(tmp_path_factory, name)
    spec = load_model_spec(str(path), "bfloat16")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (380, 370, 360)]
    results = {}
    for fused in (True, False):
        monkeypatch.setenv("CPUINFER_FUSED_LAYERS", "1" if fused else "0")
        runner = ModelRunner(spec, block_size=16, num_blocks=72, cache_dtype=torch.bfloat16)
        assert all((layer.fused is not None) == fused for layer in runner.model.layers)
        seqs = [ScheduledSeq(p, 0, list(range(i * 24, (i + 1) * 24)), True) for i, p in enumerate(prompts)]
        first = runner.execute(seqs)
        nxt = [int(t) for t in first.argmax(-1)]
        second = runner.execute(
            [
                ScheduledSeq([t], len(p), list(range(i * 24, (i + 1) * 24)), True)
                for i, (p, t) in enumerate(zip(prompts, nxt, strict=True))
            ]
        )
        results[fused] = (first, second)
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])
    for prompt, logits in zip(prompts, results[True][0], strict=True):
        _, ref = hf_greedy(model, prompt, 1)
        assert (logits - ref).abs().max() <= 0.05 * ref.abs().max()  # bf16, as the other tests here


def test_fused_layer_keeps_only_the_sampled_rows(tmp_path_factory):
    """keep: past the cache write, the fused layer carries only the sampled rows (each sequence's last query
    row), as a step's last layer does. Three sequences (a prefill, a decode, a prefill chunk), kept in
    subsets down to none: the kept rows' h and residual are the full batch's bit for bit, in the first rows,
    and every row's keys and values still reach the cache; keep that names other rows is refused."""
    path, _ = _checkpoint(tmp_path_factory, "llama")
    spec = load_model_spec(str(path), "bfloat16")
    runner = ModelRunner(spec, block_size=16, num_blocks=4, cache_dtype=torch.bfloat16)
    layer = runner.model.layers[0].fused
    k0, v0 = (torch.randn_like(c, dtype=torch.float32).to(c.dtype) for c in runner.kv_caches[0])
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(10, 128, generator=g).bfloat16()
    res0 = torch.randn(10, 128, generator=g).bfloat16()
    pos = torch.tensor([0, 1, 2, 3, 4, 3, 0, 1, 2, 3])
    slots = torch.tensor([0, 1, 2, 3, 4, 19, 32, 33, 34, 35])
    qsl = torch.tensor([0, 5, 6, 10], dtype=torch.int32)
    lens = torch.tensor([5, 4, 4], dtype=torch.int32)
    table = torch.tensor([[0], [1], [2]], dtype=torch.int32)

    def run(keep):
        h, res, k, v = h0.clone(), res0.clone(), k0.clone(), v0.clone()
        layer.forward(h, res, False, pos, slots, qsl, lens, table, k, v, keep)
        return h, res, k, v

    h, res, k, v = run(None)
    for keep in ([4, 5], [5], [4], [5, 9], []):
        hk, rk, kk, vk = run(torch.tensor(keep, dtype=torch.int64))
        assert torch.equal(kk, k) and torch.equal(vk, v), f"keep={keep}: the cache differs"
        assert torch.equal(hk[: len(keep)], h[keep]) and torch.equal(rk[: len(keep)], res[keep]), f"keep={keep}"
    for bad in ([3], [5, 4], [4, 4], [8], [4, 5, 10]):
        with pytest.raises(ValueError, match="last query row"):
            run(torch.tensor(bad, dtype=torch.int64))
    with pytest.raises(TypeError, match="int64"):
        run(torch.tensor([4], dtype=torch.int32))


def test_decoder_stack_equals_the_layers_one_by_one(tmp_path_factory):
    """ops.DecoderStack (a stage's fused layers in one call, what the engine runs) gives the bits of each layer's
    forward called in turn, keep on the last (Gemma 3: a sliding-window layer and a full one, so each layer's
    checks differ), and checks every layer's arguments before any layer runs: a call that is bad only for the
    last layer's cache leaves h, residual and both caches as they were."""
    path, _ = _checkpoint(tmp_path_factory, "gemma3")
    spec = load_model_spec(str(path), "bfloat16")
    runner = ModelRunner(spec, block_size=16, num_blocks=8, cache_dtype=torch.bfloat16)
    layers, stack = [layer.fused for layer in runner.model.layers], runner.model.stack
    assert stack is not None and len(stack) == len(layers) == 2
    g = torch.Generator().manual_seed(0)
    caches = [tuple(torch.randn(c.shape, generator=g).to(c.dtype) for c in kv) for kv in runner.kv_caches]
    h0, res0 = torch.randn(6, 128, generator=g).bfloat16(), torch.randn(6, 128, generator=g).bfloat16()
    # A 5-token prefill in block 0 and a decode at position 20 (its second block: physical block 3).
    pos = torch.tensor([0, 1, 2, 3, 4, 20])
    slots = torch.tensor([0, 1, 2, 3, 4, 3 * 16 + 4])
    qsl, lens = torch.tensor([0, 5, 6], dtype=torch.int32), torch.tensor([5, 21], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    keep = torch.tensor([4, 5])

    def state():
        return h0.clone(), res0.clone(), [tuple(c.clone() for c in kv) for kv in caches]

    h, res, kv = state()
    for i, layer in enumerate(layers):
        last = i == len(layers) - 1
        layer.forward(h, res, i == 0, pos, slots, qsl, lens, table, *kv[i], keep if last else None)
    hs, rs, kvs = state()
    stack.forward(hs, rs, True, pos, slots, qsl, lens, table, [k for k, _ in kvs], [v for _, v in kvs], keep)
    assert torch.equal(hs[:2], h[:2]) and torch.equal(rs[:2], res[:2])
    for got, want in zip(kvs, kv, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    # The last layer's cache holds 2 blocks: its block table check fails (the first layer's passed), before
    # either layer has run.
    hs, rs, kvs = state()
    small = [kvs[0], (kvs[1][0][:2], kvs[1][1][:2])]
    # The positions as slots: every one inside the small cache (32 slots), so the table is what fails.
    with pytest.raises(IndexError, match=r"block_tables\[1, 0\] = 2 is not a block of the cache \(2 blocks\)"):
        stack.forward(hs, rs, True, pos, pos, qsl, lens, table, [k for k, _ in small], [v for _, v in small])
    assert torch.equal(hs, h0) and torch.equal(rs, res0)
    for got, want in zip(kvs, caches, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match="2 layers but 1 key caches and 2 value caches"):
        stack.forward(hs, rs, True, pos, slots, qsl, lens, table, [kvs[0][0]], [k for k, _ in kvs])
    with pytest.raises(TypeError, match="DecoderStack takes DecoderLayer objects"):
        ops.DecoderStack([layers[0], "layer"])


def test_fused_layer_rejects_bad_calls(tmp_path_factory):
    """The fused layer validates what changes per call: shapes, the cache geometry and every index."""
    path, _ = _checkpoint(tmp_path_factory, "llama")
    spec = load_model_spec(str(path), "bfloat16")
    runner = ModelRunner(spec, block_size=16, num_blocks=4, cache_dtype=torch.bfloat16)
    layer = runner.model.layers[0].fused
    assert layer is not None
    k, v = runner.kv_caches[0]
    h = torch.randn(2, 128, dtype=torch.bfloat16)
    res = torch.empty_like(h)
    pos = torch.tensor([0, 1])
    slots = torch.tensor([0, 1])
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    lens = torch.tensor([2], dtype=torch.int32)
    table = torch.tensor([[3]], dtype=torch.int32)
    layer.forward(h, res, True, pos, slots, qsl, lens, table, k, v)  # a good call
    assert torch.isfinite(h.float()).all()
    with pytest.raises(ValueError, match="hidden size 64"):
        layer.forward(h[:, :64], res[:, :64], True, pos, slots, qsl, lens, table, k, v)
    with pytest.raises(TypeError, match="float32"):
        layer.forward(h.float(), res.float(), True, pos, slots, qsl, lens, table, k, v)
    with pytest.raises(IndexError, match="slot_mapping"):
        layer.forward(h, res, True, pos, torch.tensor([0, 64]), qsl, lens, table, k, v)
    with pytest.raises(IndexError, match="block_tables"):
        layer.forward(h, res, True, pos, slots, qsl, lens, torch.tensor([[4]], dtype=torch.int32), k, v)
    with pytest.raises(IndexError, match="positions"):
        layer.forward(h, res, True, torch.tensor([0, 512]), slots, qsl, lens, table, k, v)
    with pytest.raises(ValueError, match="beyond its block table"):
        layer.forward(h, res, True, pos, slots, qsl, torch.tensor([17], dtype=torch.int32), table, k, v)
    with pytest.raises(ValueError, match="KV cache holds"):
        layer.forward(
            h, res, True, pos, slots, qsl, lens, table, k[:, :, :, :32].contiguous(), v[:, :, :, :32].contiguous()
        )
    with pytest.raises(ValueError, match="overlap"):
        layer.forward(h, h, True, pos, slots, qsl, lens, table, k, v)
    # Construction checks the plan's weights against each other once, naming the field.
    import dataclasses

    from cpuinfer import ops

    plan = runner.model.layers[0].plan
    ops.DecoderLayer(plan)

    def changed(**fields):
        attn = dataclasses.replace(plan.attn, **fields.pop("attn", {}))
        mlp = dataclasses.replace(plan.mlp, **fields.pop("mlp", {}))
        return dataclasses.replace(plan, attn=attn, mlp=mlp, **fields)

    for change, error, match in [
        (dict(attn=dict(o_w=plan.attn.o_w[:, :64].contiguous())), ValueError, "attn.o_w must be"),
        (dict(attn=dict(num_heads=3, num_kv_heads=2)), ValueError, "multiple of attn.num_kv_heads"),
        (dict(mlp=dict(act="relu")), ValueError, "mlp.act must be"),
        (dict(attn=dict(head_size=32, num_heads=4, num_kv_heads=2)), ValueError, "head_size 32"),
        (dict(mlp=dict(down_w=plan.mlp.down_w.half())), TypeError, "mlp.down_w has dtype float16"),
        (dict(pre_ff_norm=plan.in_norm), ValueError, "come together"),
        (dict(mlp=dict(kind="sparse")), ValueError, "mlp.kind must be"),
    ]:
        with pytest.raises(error, match=match):
            ops.DecoderLayer(changed(**change))
    with pytest.raises(ValueError, match="attn has no field 'q_norm'"):
        ops.DecoderLayer(dataclasses.replace(plan, attn=object()))


def test_info_lists_each_layers_plan(tmp_path_factory):
    """`cpuinfer info --model M --layers`: each layer's kind, format and executor (Qwen3-MoE: a MoE layer and
    a dense one, as its mlp_only_layers say)."""
    from cpuinfer.cli.info import layer_plans

    path, _ = _checkpoint(tmp_path_factory, "qwen3_moe")
    lines = layer_plans(str(path))
    assert len(lines) == 2
    assert lines[0].startswith("layer 0: attention 2q/1kv x 64, full, q/k norm; silu MoE 8 experts top-2 (softmax)")
    assert lines[0].endswith("bfloat16 packed; pre-norm; fused C++ layer")
    assert lines[1].startswith("layer 1: ") and "silu dense bfloat16 packed" in lines[1]


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_engine_preemption_and_prefix_caching(tmp_path_factory, name):
    """A bf16 MoE model through the engine: preempted (a 4-block pool) and prefix-cached runs give each
    prompt's tokens run alone, and a mixed batch does too (a token's experts' sums do not depend on its step)."""
    from tests.engine.test_engine_e2e import engine_on, run

    path, _ = _checkpoint(tmp_path_factory, name)
    spec = load_model_spec(str(path), "bfloat16")
    runner = ModelRunner(spec, block_size=16, num_blocks=32, cache_dtype=torch.bfloat16)
    prompts = [[7 + i, 30 + 3 * i, 99, 5, 250 - i, 41, 7, 8, 120 + i, 33, 2, 64, 91, 11] for i in range(4)]
    alone = [run(engine_on(runner, spec, caching=False), [p])[0] for p in prompts]
    for caching in (False, True):
        eng = engine_on(runner, spec, num_blocks=4, caching=caching)
        assert run(eng, prompts) == alone
        assert eng.get_stats().num_preemptions > 0
    eng = engine_on(runner, spec, batched=16)  # a mixed batch, in chunks of 16 tokens
    long = [p * 3 for p in prompts[:2]]  # 42 tokens: two full blocks to share
    first = run(eng, long)
    assert run(eng, prompts + long) == alone + first
    assert eng.get_stats().prefix_cache_hits >= 2 * 32


def test_longrope_long_context(tmp_path_factory):
    """A context past LongRoPE's original one runs on the long factors at every position (as llama.cpp): the
    first token of a prompt longer than the original context equals transformers' (which switches to them
    for the whole sequence then)."""
    cls, kwargs = CASES["phi3_longrope"]
    config = getattr(transformers, cls)(
        **dict(kwargs, max_position_embeddings=512, original_max_position_embeddings=32)
    )
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    path = tmp_path_factory.mktemp("longrope")
    model.save_pretrained(path)
    runner = ModelRunner(load_model_spec(str(path), "float32"), block_size=16, num_blocks=16, cache_dtype=torch.float32)
    prompt = PROMPTS[1] + PROMPTS[0]  # 57 tokens
    _, (first,) = greedy(runner, [prompt], 1)
    _, ref = hf_greedy(model, prompt, 1)
    torch.testing.assert_close(first, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("prepack", ["0", "1"])
def test_moe_prepack_setting(tmp_path_factory, monkeypatch, prepack):
    """CPUINFER_MOE_PREPACK (vLLM's VLLM_CPU_MOE_PREPACK): 1 packs a MoE layer's experts at load, 0 keeps them
    row-major (the GEMV kernel); either way the fused layer runs and stays within bf16 accuracy of transformers."""
    monkeypatch.setenv("VLLM_CPU_MOE_PREPACK", prepack)
    path, model = _checkpoint(tmp_path_factory, "mixtral")
    runner = ModelRunner(
        load_model_spec(str(path), "bfloat16"), block_size=16, num_blocks=16, cache_dtype=torch.bfloat16
    )
    for layer in runner.model.layers:
        assert layer.plan.packed == (prepack == "1") and layer.fused is not None
    _, first = greedy(runner, PROMPTS[:2], 1)
    for prompt, logits in zip(PROMPTS[:2], first, strict=True):
        _, ref = hf_greedy(model, prompt, 1)
        assert (logits - ref).abs().max() <= 0.05 * ref.abs().max()


@pytest.mark.parametrize("config_class", ["BertConfig", "XLMRobertaConfig"])  # named as CASES name theirs
def test_bert_encoder_matches_transformers(tmp_path, config_class):
    """BertModel and XLMRobertaModel (encoders: whole prompts, bidirectional) through the model runner's pooling
    path: every row's final hidden state equals transformers' last_hidden_state, sequences batched flat without
    padding (XLM-R's positions counted from padding_idx + 1); attention on the paged kernel and by torch's SDPA."""
    cfg = getattr(transformers, config_class)(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=514,
        pad_token_id=VOCAB - 1,  # no prompt holds it: transformers' RoBERTa numbers positions around padding
    )
    torch.manual_seed(1234)
    model_class = config_class.removesuffix("Config") + "Model"
    model = getattr(transformers, model_class)(cfg, add_pooling_layer=False).float().eval()
    model.save_pretrained(tmp_path)
    spec = load_model_spec(str(tmp_path), "float32")
    assert spec.is_encoder
    runner = ModelRunner(spec, block_size=16, num_blocks=64, cache_dtype=torch.float32, pooling=True)
    seqs, ref = [], []
    for i, p in enumerate(PROMPTS):
        seqs.append(ScheduledSeq(p, 0, list(range(i * 16, i * 16 + 16)), sample=True, prompt_logits=True))
        with torch.inference_mode():
            ref.append(model(torch.tensor([p])).last_hidden_state[0])
    # Attention on the paged kernel (causal=False, over the step's cache blocks: head size 64 takes it) and by
    # torch's SDPA per sequence: both transformers' states.
    assert runner.model.paged_attention
    torch.testing.assert_close(runner.execute(seqs), torch.cat(ref), atol=1e-5, rtol=1e-5)
    runner.model.paged_attention = False
    torch.testing.assert_close(runner.execute(seqs), torch.cat(ref), atol=1e-5, rtol=1e-5)
