"""The inputs of scoring (LLM.score, /score, /rerank): vLLM's pairing of text_1 with text_2, and a cross-encoder
pair's tokens as its tokenizer joins them (the template's separators; BERT's token types 0 and 1)."""

from __future__ import annotations

from cpuinfer.errors import InvalidRequestError


def _texts(value, param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidRequestError(f"{param} must be a non-empty string or a non-empty list of strings", param)
    for t in texts:
        if not t.strip():
            raise InvalidRequestError(f"{param} contains an empty string; every text to score must be non-empty", param)
    return texts


def pair_texts(text_1, text_2, names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[str, str]]:
    """vLLM's score pairs: one text_1 against each text_2 (1:1, 1:N), or text_1[i] with text_2[i] (N:N)."""
    first, second = _texts(text_1, names[0]), _texts(text_2, names[1])
    if len(first) == 1:
        return [(first[0], t) for t in second]
    if len(first) != len(second):
        raise InvalidRequestError(
            f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: give one {names[0]}, or as many as "
            f"{names[1]} (scored pairwise)",
            names[1],
        )
    return list(zip(first, second, strict=True))


def encode_pairs(
    tokenizer, pairs: list[tuple[str, str]], type_vocab_size: int
) -> list[tuple[list[int], list[int] | None]]:
    """(token ids, token types) of each pair as one cross-encoder input; types only for a model that reads them
    (type_vocab_size > 1: BERT), else None (XLM-R, a decoder reranker)."""
    encs = tokenizer.encode_batch(pairs, add_special_tokens=True)
    return [(list(e.ids), list(e.type_ids) if type_vocab_size > 1 else None) for e in encs]
