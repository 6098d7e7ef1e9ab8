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
    tokenizer, pairs: list[tuple[str, str]], type_vocab_size: int, max_length: int | None = None
) -> list[tuple[list[int], list[int] | None]]:
    """(token ids, token types) of each pair as one cross-encoder input; types only for a model that reads them
    (type_vocab_size > 1: BERT), else None (XLM-R, a decoder reranker).

    max_length (truncate_prompt_tokens): as transformers' truncation=True, longest_first, which vLLM's scoring
    applies: the longer text loses its last tokens, one at a time, until the pair with its special tokens fits."""
    if max_length is None:
        encs = tokenizer.encode_batch(pairs, add_special_tokens=True)
    else:
        budget = max_length - tokenizer.num_special_tokens_to_add(True)
        if budget < 2:
            raise InvalidRequestError(
                f"truncate_prompt_tokens={max_length} leaves no room for both texts and the pair's special tokens",
                "truncate_prompt_tokens",
            )
        encs = []
        for pair in pairs:
            a, b = tokenizer.encode_batch(list(pair), add_special_tokens=False)
            la, lb = _longest_first(len(a), len(b), budget)
            a.truncate(la)
            b.truncate(lb)
            encs.append(tokenizer.post_process(a, b, add_special_tokens=True))
    return [(list(e.ids), list(e.type_ids) if type_vocab_size > 1 else None) for e in encs]


def _longest_first(la: int, lb: int, budget: int) -> tuple[int, int]:
    """Lengths two texts keep under the tokenizers library's longest_first truncation (what transformers' fast
    tokenizers apply): the shorter stays whole if the longer can take the rest and still be at least as long,
    else both get half (the longer the odd token; of two as long, the second)."""
    if la + lb <= budget:
        return la, lb
    short, long_ = min(la, lb), max(la, lb)
    long_ = short if short > budget else max(short, budget - short)
    if short + long_ > budget:
        short, long_ = budget // 2, budget // 2 + budget % 2
    return (long_, short) if la > lb else (short, long_)
