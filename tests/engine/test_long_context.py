"""Long contexts through the whole model: SmolLM2 at ~4k context (what an fp8_e5m2 KV cache costs against the bf16
one, teacher-forced), and a tiny long-context Llama at 8k against transformers (float32 exactly; bf16 and fp8 KV
within a bound)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import textwrap

import pytest
import torch

from cpuinfer.engine.step import ScheduledSeq

from .conftest import BLOCK, NUM_BLOCKS

CONTEXT = 4000  # tokens, within the test runners' 256 blocks of 16
TAIL = 256  # the last positions, whose logits are compared
CHUNK = 512  # prefill chunk before the tail


def tail_logits(runner, ids: list[int], table: list[int] | None = None) -> torch.Tensor:
    """Logits of the last TAIL positions of ids, prefilled in chunks (every chunk reads the cached prefix), in the
    blocks of `table` (default: the first ones, reversed)."""
    table = table or list(range(math.ceil(len(ids) / BLOCK)))[::-1]
    pos = 0
    while len(ids) - pos > TAIL:
        n = min(CHUNK, len(ids) - TAIL - pos)
        runner.execute([ScheduledSeq(ids[pos : pos + n], pos, table, False)])
        pos += n
    return runner.execute([ScheduledSeq(ids[pos:], pos, table, True, prompt_logits=True)])


def test_fp8_cache_accuracy_at_4k(smol_runner, smol_runner_fp8, smol_tokenizer):
    """Code as the long prompt (the source of Python's textwrap and inspect modules): at positions 3744-3999
    (and 256-511, for comparison), fp8's next-token argmax against bf16's (teacher-forced: both see the true
    prefix) and the largest logit difference against the logits' range. Printed, and bounded."""
    text = inspect.getsource(textwrap) + inspect.getsource(inspect)
    ids = smol_tokenizer.encode(text).ids[:CONTEXT]
    assert len(ids) == CONTEXT and math.ceil(CONTEXT / BLOCK) <= NUM_BLOCKS
    short = compare(smol_runner, smol_runner_fp8, ids[:CHUNK])
    long = compare(smol_runner, smol_runner_fp8, ids)
    msg = f"fp8_e5m2 vs bf16 KV, {long}; for comparison, {short}"
    print(msg)
    # Measured on Sapphire Rapids (amx): 87% agreement, max error 25% of the range at 4k (Skylake-SP, avx512:
    # 88.7%, 23.5%); a broken fp8 path (wrong scale, wrong block, stale keys) agrees on next to nothing.
    assert long.agree >= 0.8 and short.agree >= 0.8, msg
    assert long.err <= 0.4 * long.spread, msg


@dataclasses.dataclass
class Cost:
    """fp8 against bf16 at one context: the tail's argmax agreement, max logit error, logit range, and both
    caches' next-token accuracy on the text itself."""

    n: int
    agree: float
    err: float
    spread: float
    top1: tuple[float, float]

    def __str__(self) -> str:
        return (
            f"positions {self.n - TAIL}-{self.n - 1}: argmax agreement {self.agree:.1%}, max logit error "
            f"{self.err:.3f} ({self.err / self.spread:.1%} of the logit range {self.spread:.1f}), next-token "
            f"accuracy bf16 {self.top1[0]:.1%}, fp8 {self.top1[1]:.1%}"
        )


def logit_cost(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float, str]:
    """Teacher-forced argmax agreement, the largest logit error and the logits' mean range, and a line saying them."""
    agree = (ours.argmax(-1) == ref.argmax(-1)).double().mean().item()
    err = (ours - ref).abs().max().item()
    spread = (ref.max(-1).values - ref.min(-1).values).mean().item()
    return (
        agree,
        err,
        spread,
        f"argmax agreement {agree:.1%}, max logit error {err:.3f} ({err / spread:.1%} of the range)",
    )


def compare(bf16_runner, fp8_runner, ids: list[int]) -> Cost:
    """The cost of the fp8 cache at the last TAIL positions of ids."""
    ref, fp8 = tail_logits(bf16_runner, ids), tail_logits(fp8_runner, ids)
    assert ref.shape == fp8.shape == (TAIL, bf16_runner.spec.vocab_size)
    truth = torch.tensor(ids[len(ids) - TAIL + 1 :])
    agree, err, spread, _ = logit_cost(fp8, ref)
    return Cost(
        n=len(ids),
        agree=agree,
        err=err,
        spread=spread,
        top1=tuple((x[:-1].argmax(-1) == truth).double().mean().item() for x in (ref, fp8)),
    )


LONG = 8000  # the long-context checkpoint's prompt: 15 whole partitions of 512 keys and part of another
NEW = 8  # greedy tokens after it


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    """A tiny long-context Llama, float32, written by transformers: 16384 positions and Llama 3's rope_theta,
    four query heads to a KV head of 64 (Llama 3 8B's group), and its query and key projections doubled so that
    a row's softmax picks out a few keys instead of spreading evenly over 8000 (a partition dropped, misplaced or
    merged with the wrong weight then moves the output). Returns its path and the model (SDPA, float32)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=16384,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        initializer_range=0.1,
    )
    torch.manual_seed(37)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(2.0)
            layer.self_attn.k_proj.weight.mul_(2.0)
    path = tmp_path_factory.mktemp("long_llama")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def long_prompt():
    return torch.randint(0, 256, (LONG,), generator=torch.Generator().manual_seed(8)).tolist()


@torch.inference_mode()
def hf_tail_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' logits at the last TAIL positions of ids, one forward."""
    return model(input_ids=torch.tensor([ids])).logits[0, -TAIL:].float()


@pytest.fixture(scope="module")
def long_reference(long_llama, long_prompt):
    """transformers' float32 logits at the prompt's last TAIL positions, and its greedy continuation."""
    from tests.models.greedy import hf_greedy

    _, model = long_llama
    return hf_tail_logits(model, long_prompt), hf_greedy(model, long_prompt, NEW)[0]


def long_runner(path, dtype: str, cache_dtype):
    """A runner for the long-context checkpoint with blocks for the prompt and its continuation, no more."""
    from cpuinfer.model_loader import load_model_spec
    from cpuinfer.worker import ModelRunner

    spec = load_model_spec(str(path), dtype)
    return ModelRunner(spec, BLOCK, math.ceil((LONG + NEW) / BLOCK), cache_dtype)


def test_8k_context_equals_transformers_in_float32(long_llama, long_prompt, long_reference):
    """At 8000 tokens of context, float32 weights and KV cache: the engine's greedy tokens (the prompt prefilled
    in chunks of 512 through the scheduler, then decoded) are transformers', and the logits of the prompt's last
    256 positions (teacher-forced, every chunk reading the cached prefix) match its within float32 rounding."""
    from .test_engine_e2e import engine_on, run

    path, _ = long_llama
    ref_logits, ref_tokens = long_reference
    runner = long_runner(path, "float32", torch.float32)
    engine = engine_on(runner, runner.spec, runner.num_blocks, batched=CHUNK, max_model_len=LONG + NEW)
    assert run(engine, [long_prompt], NEW) == [ref_tokens]
    ours = tail_logits(runner, long_prompt)
    err = (ours - ref_logits).abs().max().item()
    print(
        f"float32 at {LONG} tokens: max logit error {err:.2e} against transformers (logits' range ~"
        f"{(ref_logits.max(-1).values - ref_logits.min(-1).values).mean():.1f})"
    )
    torch.testing.assert_close(ours, ref_logits, atol=1e-4, rtol=1e-4)


def test_8k_context_bf16_logit_error(long_llama, long_prompt, long_reference):
    """bf16 weights and KV cache at 8000 tokens of context against transformers in float32, teacher-forced at the
    prompt's last 256 positions. Printed, and bounded (measured on Skylake-SP, avx512: 90.6%, 7.0% of the range;
    with the kernel's merge made to drop each row's second partition: 38.7%, 71%, and the other two tests fail)."""
    path, _ = long_llama
    ref, _ = long_reference
    agree, err, spread, said = logit_cost(tail_logits(long_runner(path, "bfloat16", torch.bfloat16), long_prompt), ref)
    msg = f"bf16 weights and KV at {LONG} tokens against float32: {said}"
    print(msg)
    assert agree >= 0.8 and err <= 0.15 * spread, msg


def test_8k_context_fp8_cache_is_the_rounded_reference(long_llama, long_prompt, long_reference):
    """An fp8_e5m2 KV cache at 8000 tokens of context (float32 weights) against transformers with its keys and
    values rounded to e5m2 the same way (after RoPE, as the cache stores them; torch's rounding): the engine adds
    nothing to the format's own error, which is printed beside it. On this model, whose softmax picks out a few
    keys, that error is large (e5m2 keeps 2 mantissa bits: measured 41.8% agreement with float32), against 87-89%
    for SmolLM2's real weights at 4k (test_fp8_cache_accuracy_at_4k)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import sdpa_mask

    def rounded_kv(module, query, key, value, *args, **kwargs):
        def e5m2(x):
            return x.to(torch.float8_e5m2).to(x.dtype)

        return sdpa_attention_forward(module, query, e5m2(key), e5m2(value), *args, **kwargs)

    path, model = long_llama
    ref, _ = long_reference
    # SDPA's own mask under the new name too: only the keys and values differ from the float32 reference.
    AttentionInterface.register("cpuinfer_test_e5m2_kv", rounded_kv)
    AttentionMaskInterface.register("cpuinfer_test_e5m2_kv", sdpa_mask)
    model.set_attn_implementation("cpuinfer_test_e5m2_kv")
    try:
        ref_fp8 = hf_tail_logits(model, long_prompt)
    finally:
        model.set_attn_implementation("sdpa")
    ours = tail_logits(long_runner(path, "float32", torch.float8_e5m2), long_prompt)
    agree, err, spread, said = logit_cost(ours, ref_fp8)
    msg = (
        f"fp8_e5m2 KV at {LONG} tokens against the e5m2-rounded reference: {said}; the format's cost against "
        f"float32: {logit_cost(ours, ref)[3]} (transformers' own: {logit_cost(ref_fp8, ref)[3]})"
    )
    print(msg)
    # Measured: 100%, 0.2% of the range (a key computed a rounding apart can round to the other e5m2 value).
    assert agree >= 0.97 and err <= 0.02 * spread, msg
