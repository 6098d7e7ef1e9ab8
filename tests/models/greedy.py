"""Drive a ModelRunner the way an engine would, with a trivial block allocation, and the HF reference loop."""

from __future__ import annotations

import functools
import inspect
import os

import torch

from cpuinfer.engine.step import ScheduledSeq
from cpuinfer.worker import ModelRunner


def greedy(
    runner: ModelRunner, prompts: list[list[int]], new_tokens: int, chunk: int | None = None, batched: bool = False
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens per prompt, plus the logits of the first sampled token of each.

    Each sequence owns a disjoint run of blocks. chunk: prefill in pieces of that many tokens.
    batched: all sequences in one step each time, started one step apart so prefills mix with decodes.
    """
    bs = runner.block_size
    per_seq = -(-(max(len(p) for p in prompts) + new_tokens) // bs)
    assert per_seq * len(prompts) <= runner.num_blocks, "test runner has too few blocks"
    tables = [list(range(i * per_seq, (i + 1) * per_seq))[::-1] for i in range(len(prompts))]  # non-identity order
    state = [{"todo": list(p), "pos": 0, "out": [], "first": None} for p in prompts]

    def work(i):
        s = state[i]
        n = len(s["todo"]) if chunk is None else min(chunk, len(s["todo"]))
        toks, s["todo"] = s["todo"][:n], s["todo"][n:]
        sample = not s["todo"]
        return ScheduledSeq(toks, s["pos"], tables[i], sample), n, sample

    def consume(i, n, logits_row):
        s = state[i]
        s["pos"] += n
        if logits_row is not None:
            if s["first"] is None:
                s["first"] = logits_row.clone()
            tok = int(logits_row.argmax())
            s["out"].append(tok)
            if len(s["out"]) < new_tokens:
                s["todo"] = [tok]

    def active(i):
        return bool(state[i]["todo"])

    if not batched:
        for i in range(len(prompts)):
            while active(i):
                seq, n, sample = work(i)
                logits = runner.execute([seq])
                assert logits.shape == ((1, runner.spec.vocab_size) if sample else (0, runner.spec.vocab_size))
                consume(i, n, logits[0] if sample else None)
    else:
        step = 0
        while any(active(i) for i in range(len(prompts))):
            idx = [i for i in range(min(step + 1, len(prompts))) if active(i)]
            items = [work(i) for i in idx]
            logits = runner.execute([it[0] for it in items])
            assert logits.dtype == torch.float32 and logits.shape[0] == sum(it[2] for it in items)
            row = 0
            for i, (_, n, sample) in zip(idx, items, strict=True):
                consume(i, n, logits[row] if sample else None)
                row += sample
            step += 1
    return [s["out"] for s in state], [s["first"] for s in state]


def hf_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation (no EOS stop) of one prompt, unpadded, and the logits of the first
    generated token."""
    tokens, first = hf_greedy_batch(model, [prompt], new_tokens)
    return tokens[0], first[0]


@functools.lru_cache(maxsize=2)
def hf_gguf_model(path: str):
    """transformers' float32 eager model of a GGUF file (its own dequantization), loaded once per test session:
    the GGUF test modules share it, and Gemma 3's takes about a minute to dequantize in Python."""
    import transformers

    directory, name = os.path.split(path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.inference_mode()
def hf_greedy_batch(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], torch.Tensor]:
    """transformers' greedy continuations (no EOS stop) of several prompts at once, one forward a step for all,
    and the logits of each one's first generated token [P, V]. Prompts of one length run as they stand;
    shorter ones are left-padded (an attention mask and positions), and a padded row's float32 sums may differ
    from its unpadded run's in the last bits, so that a near-tie can pick the other token: such tokens are for
    teacher-forcing, with logits the caller computes unpadded, not for token-exact comparisons."""
    n = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p) :] = torch.tensor(p)
        mask[i, n - len(p) :] = 1
    padded = not bool(mask.all())
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    extra = dict(attention_mask=mask, position_ids=pos) if padded else {}
    # Newer transformers (5.24 here) name the KV cache `cache`, argument and output; `past_key_values` warns
    # there and is to go in 5.40. Older releases know only `past_key_values`.
    cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=ids, use_cache=True, **extra)
    first = out.logits[:, -1].float().clone()
    toks = [first.argmax(-1)]
    for _ in range(new_tokens - 1):
        if padded:
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], 1)
            pos = pos[:, -1:] + 1
            extra = dict(attention_mask=mask, position_ids=pos)
        extra[cache_name] = out[cache_name]
        out = model(input_ids=toks[-1][:, None], use_cache=True, **extra)
        toks.append(out.logits[:, -1].argmax(-1))
    return torch.stack(toks, 1).tolist(), first


def executors_equal(
    path: str, monkeypatch, expert_kind: str | None = None, new_tokens: int = 8, **mode
) -> tuple[ModelRunner, list[list[int]], list[torch.Tensor]]:
    """Run the checkpoint at path in bf16 under both executors (the fused layer, then the Python reference,
    through CPUINFER_FUSED_LAYERS) with greedy(..., **mode) on PROMPTS-like prompts, and assert the same tokens
    and first logits bit for bit. expert_kind: every MoE layer's experts must stay quantized as that kind.
    Returns the fused runner and its (tokens, first logits)."""
    from cpuinfer.model_loader import load_model_spec
    from cpuinfer.quantization import is_quantized

    from .test_tiny_models import PROMPTS

    spec = load_model_spec(path, "bfloat16")
    results, runners = {}, {}
    for fused in (True, False):
        monkeypatch.setenv("CPUINFER_FUSED_LAYERS", "1" if fused else "0")
        runner = runners[fused] = ModelRunner(spec, block_size=16, num_blocks=64, cache_dtype=torch.bfloat16)
        for layer in runner.model.layers:
            assert (layer.fused is not None) == fused
            m = layer.plan.mlp
            if expert_kind is not None:
                assert m.kind == "moe" and all(
                    is_quantized(w) and w.kind == expert_kind for w in (*m.gate_up_w, *m.down_w)
                )
        results[fused] = greedy(runner, PROMPTS, new_tokens, **mode)
    (tokens, first), (ref_tokens, ref_first) = results[True], results[False]
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(first, ref_first, strict=True))
    monkeypatch.setenv("CPUINFER_FUSED_LAYERS", "1")
    return runners[True], tokens, first
