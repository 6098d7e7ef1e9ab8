"""A tiny float32 Llama checkpoint and its greedy tokens through cpuinfer's LLM, compared across architectures.

    python tiny_greedy.py make DIR     write the checkpoint (random weights, seed 0; needs transformers)
    python tiny_greedy.py run DIR      print {"variant": ..., "tokens": [[...], ...]} as JSON

`nox -s foreign` makes the checkpoint on x86_64, runs it natively and under qemu-user with the foreign wheel,
and requires the same tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB = 256
PROMPTS = [[1, 17, 42, 99, 3, 250, 7], [5, 5, 6, 200, 31, 64, 128, 9, 11, 2, 77]]
NEW_TOKENS = 12


def make(path: Path) -> None:
    """A 2-layer Llama (GQA, tied embeddings) in float32 safetensors, with a word-level tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        initializer_range=0.1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(path / "tokenizer.json"))


def run(path: Path) -> dict:
    """Greedy continuations of PROMPTS (no EOS stop) and the kernel variant that ran them."""
    import cpuinfer
    from cpuinfer import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return {"variant": cpuinfer.info()["selected"], "tokens": [list(o.outputs[0].token_ids) for o in outs]}


if __name__ == "__main__":
    command, where = sys.argv[1], Path(sys.argv[2])
    if command == "make":
        make(where)
    elif command == "run":
        print(json.dumps(run(where)))
    else:
        sys.exit(f"tiny_greedy.py: unknown command {command!r} (make or run)")
