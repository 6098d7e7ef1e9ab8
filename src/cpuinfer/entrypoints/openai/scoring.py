"""POST /score, /rerank and /classify (vLLM's routes): text pairs scored by a cross-encoder (or, on an embedding
model, by the cosine similarity of their embeddings, as vLLM), documents ranked against a query, texts classified.

Each pair or text is one pooling request on the engine (openai/pooling.py's job); the engine decides what the model
serves and what fits (engine/limits.py), this turns bodies into inputs and scores into responses.
"""

from __future__ import annotations

import torch

from cpuinfer.engine.limits import check_pooling_text
from cpuinfer.entrypoints.openai.errors import APIError, to_api_error
from cpuinfer.entrypoints.openai.job import Prompt
from cpuinfer.entrypoints.openai.pooling import check_count, run_pooling
from cpuinfer.entrypoints.openai.protocol import UsageInfo, random_id
from cpuinfer.entrypoints.openai.scoring_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from cpuinfer.entrypoints.score_inputs import pair_texts
from cpuinfer.errors import InvalidRequestError
from cpuinfer.sampling_params import PoolingParams


def _keep(serving, truncate: int | None) -> int | None:
    """truncate_prompt_tokens as a token count (-1: the model's length; None or 0: no truncation)."""
    return serving.engine.max_model_len if truncate == -1 else truncate or None


async def score_pairs(serving, pairs, truncate, activation, request_id, raw, field):
    """(scores, tokens run, job id) of text pairs, or None when the client left: a cross-encoder's score of each
    pair as one input, or on an embedding model the cosine similarity of the two texts' vectors."""
    check_count(len(pairs), field)
    keep = _keep(serving, truncate)
    pooler = serving.engine.limits.pooler
    if pooler is not None and pooler.task == "embed":
        firsts = list(dict.fromkeys(a for a, _ in pairs))
        texts = [*firsts, *(b for _, b in pairs)]
        ids = await serving.encode_many(texts, True)
        prompts = [Prompt(i[-keep:] if keep else i, t) for i, t in zip(ids, texts, strict=True)]
        job = await run_pooling(serving, request_id, prompts, PoolingParams(truncate_prompt_tokens=keep), raw, field)
        if job is None:
            return None
        vecs = [s.pooled for s in job.states]
        first = dict(zip(firsts, vecs, strict=False))
        scores = [
            float(torch.nn.functional.cosine_similarity(first[a], v, dim=0))
            for (a, _), v in zip(pairs, vecs[len(firsts) :], strict=True)
        ]
        return scores, job.prompt_tokens, job.request_id
    params = PoolingParams(truncate_prompt_tokens=keep, task="score", activation=activation)
    prompts = [
        Prompt(ids, None, PoolingParams(task="score", activation=activation, token_type_ids=types).as_sampling())
        for ids, types in await serving.encode_pairs(pairs, keep)
    ]
    job = await run_pooling(serving, request_id, prompts, params, raw, field)
    if job is None:
        return None
    return [float(s.pooled[0]) for s in job.states], job.prompt_tokens, job.request_id


def _pairs(first, second, names: tuple[str, str]) -> list[tuple[str, str]]:
    try:
        return pair_texts(first, second, names)
    except InvalidRequestError as e:
        raise to_api_error(e) from e


async def create_score(serving, req: ScoreRequest, raw=None) -> ScoreResponse | None:
    """POST /score: one score per pair, in request order."""
    serving.check_model(req.model)
    serving.check_ready()
    if isinstance(req.text_2, list):
        check_count(len(req.text_2), "text_2")
    pairs = _pairs(req.text_1, req.text_2, ("text_1", "text_2"))
    rid = req.request_id or random_id("score")
    out = await score_pairs(serving, pairs, req.truncate_prompt_tokens, req.activation, rid, raw, "text_2")
    if out is None:
        return None
    scores, n, rid = out
    return ScoreResponse(
        id=rid,
        model=serving.model_name,
        data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)],
        usage=UsageInfo(prompt_tokens=n, total_tokens=n),
    )


async def create_rerank(serving, req: RerankRequest, raw=None) -> RerankResponse | None:
    """POST /rerank: the documents by relevance to the query, highest first, the top_n of them (0: all)."""
    serving.check_model(req.model)
    serving.check_ready()
    check_count(len(req.documents), "documents")
    pairs = _pairs(req.query, req.documents, ("query", "documents"))
    rid = req.request_id or random_id("rerank")
    out = await score_pairs(serving, pairs, req.truncate_prompt_tokens, req.activation, rid, raw, "documents")
    if out is None:
        return None
    scores, n, rid = out
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or None]
    results = [
        RerankResult(
            index=i,
            document=RerankDocument(text=req.documents[i]) if req.return_documents else None,
            relevance_score=scores[i],
        )
        for i in order
    ]
    return RerankResponse(id=rid, model=serving.model_name, usage=RerankUsage(total_tokens=n), results=results)


async def create_classify(serving, req: ClassificationRequest, raw=None) -> ClassificationResponse | None:
    """POST /classify: each input's label scores and its best label's name (the config's id2label)."""
    serving.check_model(req.model)
    serving.check_ready()
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    check_count(len(texts), "input")
    try:
        for text in texts:
            check_pooling_text(text)
    except InvalidRequestError as e:
        raise to_api_error(e) from e
    keep = _keep(serving, req.truncate_prompt_tokens)
    ids = await serving.encode_many(texts, True)
    prompts = [Prompt(i[-keep:] if keep else i, t) for i, t in zip(ids, texts, strict=True)]
    params = PoolingParams(truncate_prompt_tokens=keep, task="classify", activation=req.activation)
    job = await run_pooling(serving, req.request_id or random_id("classify"), prompts, params, raw, "input")
    if job is None:
        return None
    names = serving.engine.tokenization.spec.hf_config.get("id2label") or {}
    data = []
    for i, s in enumerate(job.states):
        probs = s.pooled.tolist()
        best = max(range(len(probs)), key=probs.__getitem__) if probs else None
        data.append(ClassificationData(index=i, label=names.get(str(best)), probs=probs, num_classes=len(probs)))
    if not data:
        raise APIError("no input was classified", 500)
    n = job.prompt_tokens
    return ClassificationResponse(
        id=job.request_id, model=serving.model_name, data=data, usage=UsageInfo(prompt_tokens=n, total_tokens=n)
    )
