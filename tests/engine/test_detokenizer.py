"""Incremental detokenization against the tokenizer's full decode; stop strings across token boundaries."""

from __future__ import annotations

import random

import pytest

from cpuinfer.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! This is a test of incremental decoding.",
    "Ünïcödé: 你好，世界。 Emoji 🎉🚀 and  double  spaces\nnew line\ttab",  # noqa: RUF001 - CJK punctuation on purpose
    "日本語のテキストと한국어 텍스트, mixed with English words.",
    "<|im_start|>user\nhi<|im_end|> special tokens",
]


def stream(tok, prompt, ids, skip=True, stop=None, include=False, valid=True):
    d = IncrementalDetokenizer(tok, prompt, skip, stop, include)
    pieces, hit = [], None
    for t in ids:
        new = d.add_token(t)
        assert not valid or "\ufffd" not in new  # valid text never shows a replacement character
        pieces.append(new)
        if new and stop:
            hit = d.check_stop(len(new))
            if hit:
                break
    return "".join(pieces), d, hit


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_matches_full_decode(smol_tokenizer, text, skip):
    tok = smol_tokenizer
    prompt = tok.encode("Say something:").ids
    ids = tok.encode(text).ids
    got, d, _ = stream(tok, prompt, ids, skip)
    assert got == tok.decode(ids, skip_special_tokens=skip)
    assert d.text == got


def test_random_tokens_never_broken_utf8(smol_tokenizer):
    tok = smol_tokenizer
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(30)]
        got, _, _ = stream(tok, [1, 2], ids, valid=False)
        full = tok.decode(ids, skip_special_tokens=True)
        # Random ids hold invalid byte runs (U+FFFD in the full decode too); everything but a trailing
        # incomplete character is emitted, exactly as the full decode has it.
        assert full.rstrip("\ufffd") == got


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(smol_tokenizer, include):
    tok = smol_tokenizer
    ids = tok.encode("The quick brown fox jumps over the lazy dog").ids
    _text, d, hit = stream(tok, [], ids, stop=["own fox ju"], include=include)
    assert hit == "own fox ju"
    assert d.text == ("The quick brown fox ju" if include else "The quick br")
    # Streaming never showed the partly generated stop string.
    d2 = IncrementalDetokenizer(tok, [], True, ["lazy cat"], False)
    shown = ""
    for t in ids:
        d2.add_token(t)
        shown += d2.take_delta(False)
        assert "lazy c" not in shown
    shown += d2.take_delta(True)
    assert shown == tok.decode(ids)
