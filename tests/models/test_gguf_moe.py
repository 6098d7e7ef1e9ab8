"""Mixture-of-experts GGUF files written by llama.cpp's own converter (tests/models/llama_cpp_convert.py) from
tiny transformers checkpoints: Qwen3-MoE (`qwen3moe`) and Mixtral (`llama` with experts), their expert stacks
split per expert at load and, quantized, kept packed on the integer kernels.

- f32 files in a float32 run: transformers' greedy tokens and logits (the same weights, so exact up to f32
  summation order).
- Q8_0 files in a bfloat16 run (experts, attention and lm_head on the int8 kernels, int8 activations as
  llama.cpp's): the first token's logits within the tolerance tests/models/test_gguf_quantized.py states and
  justifies for real GGUF files (relative L2 error below 0.15, our top token among transformers' top 5), the two
  executors equal bit for bit, and every way of batching gives the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from cpuinfer.model_loader import load_model_spec
from cpuinfer.worker import ModelRunner

from .greedy import executors_equal, greedy, hf_greedy
from .llama_cpp_convert import convert, llama_python, llama_quantize
from .test_tiny_models import CASES, PROMPTS

transformers = pytest.importorskip("transformers")

# llama.cpp renormalizes both families' top-k weights and has no dense layers among Qwen3-MoE's.
MODELS = {
    "qwen3_moe": dict(CASES["qwen3_moe"][1], norm_topk_prob=True, mlp_only_layers=[]),
    "mixtral": CASES["mixtral"][1],
}


@pytest.fixture(scope="module", params=list(MODELS))
def converted(request, tmp_path_factory):
    name = request.param
    config = getattr(transformers, CASES[name][0])(**MODELS[name])
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path / "hf")
    files = {t: convert(str(path / "hf"), str(path / f"{name}.{t}.gguf"), t) for t in ("f32", "q8_0")}
    return name, model, files


def test_f32_gguf_equals_transformers(converted):
    name, model, files = converted
    spec = load_model_spec(files["f32"], "float32")
    assert spec.architecture == {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}[name]
    runner = ModelRunner(spec, block_size=16, num_blocks=64, cache_dtype=torch.float32)
    out, first = greedy(runner, PROMPTS, 32, batched=True, chunk=7)
    for i, prompt in enumerate(PROMPTS):
        tokens, logits = hf_greedy(model, prompt, 32)
        assert out[i] == tokens, f"{name} prompt {i}"
        torch.testing.assert_close(first[i], logits, atol=1e-4, rtol=1e-4)


def test_q8_0_experts_stay_quantized_and_close(converted, monkeypatch):
    name, model, files = converted
    runner, mixed, _ = executors_equal(files["q8_0"], monkeypatch, "Q8_0", 16, batched=True, chunk=7)
    alone, _ = greedy(runner, PROMPTS, 16)
    assert alone == mixed  # batch invariance, quantized experts included
    # The exact reference of the format: the same file in float32, dequantized by gguf-py (the float32 path is
    # transformers' own up to summation order: test_f32_gguf_equals_transformers).
    exact = ModelRunner(
        load_model_spec(files["q8_0"], "float32"), block_size=16, num_blocks=64, cache_dtype=torch.float32
    )
    agree, errors = teacher_forced(runner, exact, model, PROMPTS, 32)
    # Measured on Sapphire Rapids (amx), 3 prompts x 32 positions: agreement 0.885 (qwen3_moe) and 0.948
    # (mixtral), median relative L2 error 0.029 and 0.019. For scale, a plain bf16 run of the unquantized
    # checkpoint against the same reference: 0.948 and 0.917, medians 0.028 and 0.029 -- these tiny random
    # models have flat logits, so near-ties flip under any rounding. A routing decision near a tie can flip too
    # and move one position's logits a lot (a MoE model's logits are discontinuous in its inputs), so the bounds
    # are on the agreement and the median, not the worst position.
    assert agree >= 0.85, f"{name}: teacher-forced agreement {agree:.1%}"
    assert errors.median() < 0.05, f"{name}: median relative L2 error {errors.median():.3f}"


def test_quantized_routers_run_dense(converted):
    """A file whose routers are quantized too (gguf-py's quantizer does every 2-D tensor; llama.cpp's keeps them
    F32) loads with each router dequantized into the run dtype, and picks experts as the file's own float32 run
    does: a router's few rows are read once per token, so packing them would save nothing."""
    from .llama_cpp_convert import with_quantized_routers

    name, model, files = converted
    file = with_quantized_routers(files["q8_0"], files["q8_0"].replace(".gguf", ".q8router.gguf"))
    runner = ModelRunner(load_model_spec(file, "bfloat16"), block_size=16, num_blocks=64, cache_dtype=torch.bfloat16)
    layer = runner.model.layers[0].plan.mlp
    assert isinstance(layer.router_w, torch.Tensor) and layer.router_w.dtype == torch.bfloat16
    exact = ModelRunner(load_model_spec(file, "float32"), block_size=16, num_blocks=64, cache_dtype=torch.float32)
    agree, errors = teacher_forced(runner, exact, model, PROMPTS, 16)
    # The bounds of test_q8_0_experts_stay_quantized_and_close (the same file but for its routers).
    assert agree >= 0.85, f"{name}: teacher-forced agreement {agree:.1%}"
    assert errors.median() < 0.05, f"{name}: median relative L2 error {errors.median():.3f}"


# llama.cpp's logits for every position of one token sequence, through llama-cpp-python's low-level API, in the
# interpreter that has it (CPUINFER_LLAMA_PYTHON, else this one): `nox -s bench` and bench_quant.py build it.
LLAMA_LOGITS = r"""
import json, sys
import llama_cpp as L, numpy as np
path, tokens = sys.argv[1], json.loads(sys.argv[2])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
assert model, f"llama.cpp could not load {path}"
cp = L.llama_context_default_params()
cp.n_ctx = cp.n_batch = cp.n_ubatch = 256
cp.n_threads = cp.n_threads_batch = 2
cp.type_k = cp.type_v = int(sys.argv[3])  # ggml type of the KV cache: F32 (0) or llama.cpp's default F16 (1)
ctx = L.llama_init_from_model(model, cp)
batch = L.llama_batch_init(len(tokens), 0, 1)
for i, t in enumerate(tokens):
    batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, i, 1, 1
    batch.seq_id[i][0] = 0
batch.n_tokens = len(tokens)
assert L.llama_decode(ctx, batch) == 0
vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
np.save(sys.stdout.buffer, np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(len(tokens), vocab)).copy())
"""


def llama_cpp_logits(py: str, path: str, tokens: list[int], f32_cache: bool) -> torch.Tensor:
    import io
    import json
    import subprocess

    import numpy as np

    out = subprocess.run(
        [py, "-c", LLAMA_LOGITS, path, json.dumps(tokens), str(0 if f32_cache else 1)], capture_output=True, timeout=600
    )
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    return torch.from_numpy(np.load(io.BytesIO(out.stdout)))


def test_logits_close_to_llama_cpps_own(converted, tmp_path):
    """The same GGUF files run by llama.cpp (llama-cpp-python): the f32 file in a float32 run, and Q4_K_M and
    MXFP4_MOE files (experts MXFP4, the rest Q8_0) made by llama.cpp's own quantizer in bfloat16 runs (both
    engines quantize activations to int8 for their blocks), every position of a prompt and transformers'
    greedy continuation. Skipped where no interpreter imports llama_cpp (CI does not build it: set
    CPUINFER_LLAMA_PYTHON, as for bench_quant.py)."""
    py = llama_python()
    if py is None:
        pytest.skip("llama-cpp-python is not installed (CPUINFER_LLAMA_PYTHON: an interpreter that has it)")
    from cpuinfer.engine.step import ScheduledSeq

    name, model, files = converted
    made = {  # llama_ftype LLAMA_FTYPE_MOSTLY_*
        qtype: llama_quantize(py, files["f32"], str(tmp_path / f"{name}.{qtype}.gguf"), ftype)
        for qtype, ftype in (("q4_k_m", 15), ("mxfp4_moe", 38))
    }
    runs = [(files["f32"], torch.float32, 5e-3), (made["q4_k_m"], torch.bfloat16, 0.05)]
    for file, dtype, bound in [*runs, (made["mxfp4_moe"], torch.bfloat16, 0.05)]:
        runner = ModelRunner(load_model_spec(file, str(dtype).removeprefix("torch.")), 16, 64, cache_dtype=dtype)
        if file == made["mxfp4_moe"]:  # its experts stay MXFP4 (4.25 bits), not dequantized
            assert all(w.fp4 for w in runner.model.layers[0].plan.mlp.down_w)
        for prompt in PROMPTS:
            tokens = prompt + hf_greedy(model, prompt, 16)[0][:-1]
            table = list(range(-(-len(tokens) // 16)))
            ours = runner.execute([ScheduledSeq(tokens, 0, table, True, prompt_logits=True)]).float()
            theirs = llama_cpp_logits(py, file, tokens, dtype == torch.float32)
            # f32 (llama.cpp's cache f32 too): our float32 run is transformers' to 1e-4 (test_f32_gguf_equals_
            # transformers); llama.cpp's differs from both by a median relative L2 error of 1.2e-3 (its own
            # rotary angles and summation order); argmax agreement 0.98-1.0. Q4_K_M: both engines run int8
            # activations against the same blocks but round differently (bf16 vs f32 between the ops): measured
            # median 0.022-0.038, agreement 0.89-1.0 (Sapphire Rapids, amx); the bounds of this module's Q8_0 test.
            # MXFP4_MOE (our experts kept as MXFP4 codes and exponents, 4.25 bits): median 0.019-0.034, agreement
            # 0.89-0.97.
            err = ((ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)).median().item()
            agree = (ours.argmax(-1) == theirs.argmax(-1)).double().mean().item()
            what = f"{name} {file.rsplit('/', 1)[-1]} {dtype}"
            print(f"{what}: median relative L2 error {err:.4f}, argmax agreement {agree:.2f} vs llama.cpp")
            assert err < bound, f"{name} {file}: median relative L2 error {err:.4f} against llama.cpp"
            assert agree >= (0.95 if dtype == torch.float32 else 0.85), f"{name} {file}: argmax agreement {agree}"


def teacher_forced(
    runner: ModelRunner, exact: ModelRunner, model, prompts: list[list[int]], n: int
) -> tuple[float, torch.Tensor]:
    """Feed transformers' greedy continuation (n tokens) to both runners token by token: the share of positions
    where runner's next token is exact's, and each position's relative L2 error of runner's logits."""
    from cpuinfer.engine.step import ScheduledSeq

    def logits(r: ModelRunner, i: int, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
        table = list(range(i * 8, (i + 1) * 8))
        out = [r.execute([ScheduledSeq(prompt, 0, table, True)])[0]]
        for j, tok in enumerate(tokens[:-1]):
            out.append(r.execute([ScheduledSeq([tok], len(prompt) + j, table, True)])[0])
        return out

    hits, errors = 0, []
    for i, prompt in enumerate(prompts):
        tokens, _ = hf_greedy(model, prompt, n)
        for got, want in zip(logits(runner, i, prompt, tokens), logits(exact, i, prompt, tokens), strict=True):
            hits += int(got.argmax()) == int(want.argmax())
            errors.append(((got - want).norm() / want.norm()).item())
    return hits / len(errors), torch.tensor(errors)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_experts_stay_packed(tmp_path_factory, monkeypatch, qtype):
    """K-quant expert stacks (random valid blocks: gguf-py writes no K-quants) are sliced per expert and kept
    packed; their bf16 run matches the file's float32 run, whose weights gguf-py dequantizes (the format's own
    tool), within the int8-activation tolerance; the two executors equal bit for bit."""
    from .llama_cpp_convert import with_random_k_quant_experts

    kwargs = dict(MODELS["qwen3_moe"], hidden_size=256, moe_intermediate_size=256, num_attention_heads=4)
    config = transformers.Qwen3MoeConfig(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    path = tmp_path_factory.mktemp(f"k_{qtype}")
    model.save_pretrained(path / "hf")
    f32 = convert(str(path / "hf"), str(path / "f32.gguf"), "f32")
    file = with_random_k_quant_experts(f32, str(path / f"{qtype}.gguf"), qtype)
    exact = ModelRunner(load_model_spec(file, "float32"), block_size=16, num_blocks=64, cache_dtype=torch.float32)
    runner, _, _ = executors_equal(file, monkeypatch, qtype, batched=True, chunk=7)
    agree, errors = teacher_forced(runner, exact, model, PROMPTS, 16)
    # Measured on Sapphire Rapids (amx): agreement 1.0 (Q4_K, Q5_K) and 0.958 (Q6_K), median relative L2 error
    # 0.008.
    assert agree >= 0.85, f"{qtype}: teacher-forced agreement {agree:.1%}"
    assert errors.median() < 0.05, f"{qtype}: median relative L2 error {errors.median():.3f}"
