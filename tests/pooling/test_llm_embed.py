"""LLM.embed on a tiny Qwen3 embedder against sentence-transformers' encode: every pooling mode, normalised and
not, float32 and bf16; batching, chunked prefill and truncation leave a text's vector alone."""

from __future__ import annotations

import pytest
import torch

from cpuinfer import LLM, PoolingParams, SamplingParams
from cpuinfer.errors import InvalidRequestError

from .tiny_embedders import TEXTS, make_qwen3, st_encode, write_sentence_transformers

pytest.importorskip("sentence_transformers")

MODES = [("lasttoken", True), ("lasttoken", False), ("mean", True), ("mean", False), ("cls", True)]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.05")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def embed(llm: LLM, prompts, **kw) -> torch.Tensor:
    """The embeddings as one float32 tensor."""
    return torch.tensor([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False, **kw)])


@pytest.fixture(scope="module", params=MODES, ids=[f"{m}-{'norm' if n else 'raw'}" for m, n in MODES])
def st_model(request, tmp_path_factory):
    mode, normalize = request.param
    path = make_qwen3(tmp_path_factory.mktemp(f"qwen3-{mode}"))
    write_sentence_transformers(path, mode, normalize)
    return path, st_encode(path, TEXTS)


def test_float32_equals_sentence_transformers(st_model):
    path, ref = st_model
    llm = LLM(str(path), dtype="float32", runner="pooling", block_size=16)
    torch.testing.assert_close(embed(llm, TEXTS), ref, atol=1e-5, rtol=0)
    # Chunked prefill (16-token steps) and one text at a time give the same vectors as the batch.
    small = LLM(str(path), dtype="float32", runner="pooling", block_size=16, max_num_batched_tokens=16)
    torch.testing.assert_close(embed(small, TEXTS), ref, atol=1e-5, rtol=0)
    alone = torch.cat([embed(llm, [t]) for t in TEXTS])
    torch.testing.assert_close(alone, ref, atol=1e-5, rtol=0)


def test_bf16_cosine(st_model):
    path, ref = st_model
    llm = LLM(str(path), dtype="bfloat16", runner="pooling", block_size=16)
    cos = torch.nn.functional.cosine_similarity(embed(llm, TEXTS), ref, dim=-1)
    assert cos.min() >= 0.999, cos


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """A decoder checkpoint with no sentence-transformers files (and Matryoshka declared in its config)."""
    return make_qwen3(tmp_path_factory.mktemp("bare"), matryoshka_dimensions=[32, 64, 128])


def test_bare_decoder_pools_last_token_normalized_and_pooler_config_overrides(bare, tmp_path):
    llm = LLM(str(bare), dtype="float32", runner="pooling", block_size=16)
    got = embed(llm, TEXTS)
    st = tmp_path / "st"
    st.mkdir()
    for f in bare.iterdir():
        (st / f.name).symlink_to(f)
    write_sentence_transformers(st, "lasttoken", True)
    torch.testing.assert_close(got, st_encode(st, TEXTS), atol=1e-5, rtol=0)
    mean = LLM(
        str(bare),
        dtype="float32",
        convert="embed",
        block_size=16,
        pooler_config='{"pooling_type": "MEAN", "normalize": false}',
    )
    write_sentence_transformers(st, "mean", False)
    torch.testing.assert_close(embed(mean, TEXTS), st_encode(st, TEXTS), atol=1e-5, rtol=0)
    # Matryoshka: the first k of the unnormalised vector, renormalised (vLLM's reading of dimensions).
    cut = embed(llm, TEXTS, pooling_params=PoolingParams(dimensions=32, normalize=False))
    full = embed(llm, TEXTS, pooling_params=PoolingParams(normalize=False))
    torch.testing.assert_close(cut, full[:, :32], atol=1e-6, rtol=0)
    renorm = embed(llm, TEXTS, pooling_params=PoolingParams(dimensions=64))
    torch.testing.assert_close(renorm, torch.nn.functional.normalize(full[:, :64], dim=-1), atol=1e-6, rtol=0)
    with pytest.raises(InvalidRequestError, match=r"dimensions=48 is not supported.*32, 64, 128"):
        llm.embed(TEXTS, PoolingParams(dimensions=48), use_tqdm=False)


def test_truncation_keeps_the_last_tokens(bare):
    llm = LLM(str(bare), dtype="float32", runner="pooling", block_size=16, max_model_len=32)
    ids = llm.get_tokenizer().encode(TEXTS[3]).ids
    assert len(ids) > 32
    with pytest.raises(InvalidRequestError, match=r"maximum context length is 32.*41 tokens"):
        llm.embed(TEXTS[3], use_tqdm=False)
    torch.testing.assert_close(embed(llm, TEXTS[3], truncate_prompt_tokens=20), embed(llm, [ids[-20:]]))
    torch.testing.assert_close(
        embed(llm, [TEXTS[3], TEXTS[0]], pooling_params=PoolingParams(truncate_prompt_tokens=32))[0],
        embed(llm, [ids[-32:]])[0],
    )


def test_runner_mismatch_and_bad_input_are_refused(bare):
    llm = LLM(str(bare), dtype="float32", runner="pooling", block_size=16)
    with pytest.raises(InvalidRequestError, match="pooling runner"):
        llm.generate("w1 w2", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.embed([[1, 2, 999]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.embed([[]], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.embed([""], use_tqdm=False)
    gen = LLM(str(bare), dtype="float32", block_size=16)
    with pytest.raises(InvalidRequestError, match="generate runner"):
        gen.embed(TEXTS, use_tqdm=False)
    no_matryoshka = make_qwen3(bare.parent / "plain")
    plain = LLM(str(no_matryoshka), dtype="float32", runner="pooling", block_size=16)
    with pytest.raises(InvalidRequestError, match="matryoshka"):
        plain.embed(TEXTS, PoolingParams(dimensions=32), use_tqdm=False)
    with pytest.raises(ValueError, match="disagree"):
        LLM(str(bare), runner="generate", task="embed")
    with pytest.raises(ValueError, match="pooling_type='MAX'"):
        LLM(str(bare), runner="pooling", pooler_config={"pooling_type": "MAX"})


def test_checkpoint_saved_by_sentence_transformers(tmp_path):
    """SentenceTransformer.save writes the decoder as a base model (Qwen3Model, names without "model."): it loads,
    pools by default (the auto runner), and refuses to generate."""
    from sentence_transformers import SentenceTransformer, models

    src = make_qwen3(tmp_path / "src")
    st = SentenceTransformer(
        modules=[models.Transformer(str(src)), models.Pooling(128, pooling_mode="lasttoken"), models.Normalize()],
        device="cpu",
    )
    st.save(str(tmp_path / "st"))
    ref = torch.tensor(st.encode(TEXTS, batch_size=1))
    llm = LLM(str(tmp_path / "st"), dtype="float32", block_size=16)
    assert llm.llm_engine.config.runner == "pooling"
    torch.testing.assert_close(embed(llm, TEXTS), ref, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="base model"):
        LLM(str(tmp_path / "st"), runner="generate")
