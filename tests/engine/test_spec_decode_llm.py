"""Speculative decoding through LLM(speculative_config=...) on tiny random-weight transformers checkpoints
(float32) and the bundled SmolLM2: greedy outputs equal plain decoding's with n-gram lookup and with a draft
model, and bad configs are one clear error."""

from __future__ import annotations

import json
import random

import pytest
import torch

from cpuinfer import LLM, SamplingParams
from cpuinfer.spec_decode.config import SpeculativeConfig

from ..models.test_tiny_models import CASES, VOCAB

transformers = pytest.importorskip("transformers")


def _tokenizer(path, n_tokens: int, prefix: str = "t") -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"{prefix}{i}": i for i in range(n_tokens)}
    Tokenizer(WordLevel(vocab, unk_token=f"{prefix}0")).save(str(path / "tokenizer.json"))


def _checkpoint(tmp_path_factory, seed: int, layers: int = 2, tok_prefix: str = "t") -> str:
    cls_name, kwargs = CASES["llama"]
    config = getattr(transformers, cls_name)(**dict(kwargs, num_hidden_layers=layers))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    path = tmp_path_factory.mktemp(f"llama{seed}")
    model.save_pretrained(path)
    _tokenizer(path, VOCAB, tok_prefix)
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Target (4 layers), a draft with the same tokenizer (2 layers, other weights), one with another tokenizer."""
    return {
        "target": _checkpoint(tmp_path_factory, 1234, layers=4),
        "draft": _checkpoint(tmp_path_factory, 99),
        "alien": _checkpoint(tmp_path_factory, 7, tok_prefix="x"),
    }


def prompts():
    rng = random.Random(0)
    out = []
    for i in range(6):
        motif = [rng.randrange(VOCAB) for _ in range(3 + i)]
        out.append([*(motif * 6)[: 10 + 5 * i], rng.randrange(VOCAB)])  # repetitive: n-grams match
    return out


def generate(llm, ps, **kw):
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, **kw)
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]


def engine_llm(model, speculative=None, **kw):
    return LLM(model=model, dtype="float32", max_model_len=256, block_size=16, speculative_config=speculative, **kw)


@pytest.fixture(scope="module")
def plain(tiny):
    return generate(engine_llm(tiny["target"]), prompts(), logprobs=1)


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        {"method": "ngram", "num_speculative_tokens": 8},
        "draft",
        "self",
    ],
)
def test_tiny_llama_float32_identical(tiny, plain, speculative):
    if speculative == "draft":
        speculative = {"model": tiny["draft"], "num_speculative_tokens": 4}
    elif speculative == "self":  # the target drafting for itself: every proposal accepted
        speculative = {"model": tiny["target"], "num_speculative_tokens": 5}
    llm = engine_llm(tiny["target"], speculative)
    got = generate(llm, prompts(), logprobs=1)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    # float32 runs op by op through torch's GEMMs, whose last bits depend on the row count (the fused bf16
    # kernels' do not: test_spec_decode_smol compares logprobs exactly).
    for g, p in zip(got, plain, strict=True):
        a = [lp[t].logprob for t, lp in zip(g.token_ids, g.logprobs, strict=True)]
        b = [lp[t].logprob for t, lp in zip(p.token_ids, p.logprobs, strict=True)]
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    st = llm.llm_engine.core.spec.stats
    assert st.num_draft_tokens > 0
    if speculative.get("model") == tiny["target"]:
        assert st.num_accepted_tokens == st.num_draft_tokens


def test_draft_with_other_tokenizer_refused(tiny):
    with pytest.raises(ValueError, match="tokenizer"):
        engine_llm(tiny["target"], {"model": tiny["alien"], "num_speculative_tokens": 2})


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0 must be"),
        ('{"method": "ngram", "num_speculative_tokens": 17}', "num_speculative_tokens=17 must be"),
        ('{"method": "ngram"}', "num_speculative_tokens=None must be"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
            "min <= max",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}', "unknown key"),
        ('{"model": "", "num_speculative_tokens": 2}', "needs 'model'"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "revision": "main"}', "revision='main'"),
        ("{method: ngram}", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_configs_one_clear_error(value, match):
    with pytest.raises(ValueError, match=match) as info:
        SpeculativeConfig.parse(value)
    assert str(info.value).startswith("--speculative-config ")


def test_draft_model_by_hugging_face_id(tiny, plain, tmp_path, monkeypatch):
    """A draft named by a hub id resolves as --model does (the cache under --download-dir, at its revision) and
    drafts; a path that does not exist, or an id that is not cached, is one clear error naming the flag."""
    import os

    from ..server.test_model_ids import COMMIT, add_repo

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    files = {}
    for name in os.listdir(tiny["draft"]):  # copies: the loader refuses weights linked from outside the repository
        with open(os.path.join(tiny["draft"], name), "rb") as f:
            files[name] = f.read()
    snap = add_repo(str(tmp_path), "org/tiny-draft", files)
    spec = {"model": "org/tiny-draft", "revision": COMMIT, "num_speculative_tokens": 4}
    llm = engine_llm(tiny["target"], spec, download_dir=str(tmp_path))
    assert llm.llm_engine.config.speculative.model == snap
    assert [o.token_ids for o in generate(llm, prompts())] == [o.token_ids for o in plain]
    assert llm.llm_engine.core.spec.stats.num_draft_tokens > 0
    for model, match in [("/no/such/model", "no such file"), ("org/not-cached", "not in the Hugging Face cache")]:
        with pytest.raises(ValueError, match=match) as info:
            engine_llm(tiny["target"], {"model": model, "num_speculative_tokens": 2}, download_dir=str(tmp_path))
        assert str(info.value).startswith("--speculative-config model ")


def test_vllm_spellings():
    c = SpeculativeConfig.parse(json.dumps({"method": "ngram", "num_speculative_tokens": 4}))
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 4, 2, 4)
    c = SpeculativeConfig.parse({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 2, 3)


def test_smollm2_self_draft_identical(smol_path):
    """The bundled SmolLM2 (GGUF, bf16) drafting for itself: every proposal accepted, output unchanged."""
    text = ["Write the numbers from one to twenty in words:", "def add(a, b):\n    return a + b\n\ndef sub(a, b):"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref = LLM(model=smol_path, max_model_len=512, block_size=16).generate(text, params, use_tqdm=False)
    llm = LLM(
        model=smol_path,
        max_model_len=512,
        block_size=16,
        speculative_config={"model": smol_path, "num_speculative_tokens": 4},
    )
    got = llm.generate(text, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    st = llm.llm_engine.core.spec.stats
    assert st.num_accepted_tokens == st.num_draft_tokens > 0
