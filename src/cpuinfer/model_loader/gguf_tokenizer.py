"""Build a `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata.

GGUF carries no tokenizer.json, only llama.cpp's description: the vocabulary, merges (for byte-level
BPE), scores, token types and the pre-tokenizer name. Two families cover our models:
"gpt2" (byte-level BPE: SmolLM2, Llama 3, Qwen) and "llama" (SentencePiece BPE with byte fallback:
Llama 2, Mistral, Gemma). This mirrors what transformers' GGUF loader does, without transformers.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from .errors import ModelLoadError

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")}
_SPLITS.update({name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen", "megrez")})

CONTROL, USER_DEFINED = 3, 4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte (the alphabet of byte-level BPE vocabularies)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=False))


def tokenizer_from_gguf(get, path: str) -> Tokenizer:
    """The tokenizer described by a GGUF file's metadata (`get(key, default)` reads one field)."""
    model = get("tokenizer.ggml.model")
    tokens = get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF file has no tokenizer (tokenizer.ggml.tokens missing)")
    types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model == "gpt2":
        tok = _byte_level(tokens, get("tokenizer.ggml.merges") or [], get("tokenizer.ggml.pre"))
        spelled = set(_bytes_to_unicode().values())
    elif model == "llama":
        tok, tokens = _sentencepiece(get, tokens)
        spelled = None
    else:
        raise ModelLoadError(f"{path}: GGUF tokenizer model {model!r} is not supported; supported: gpt2, llama")
    # Only tokens the vocabulary has (as spelled there): anything else would get a new id past the model's vocab.
    vocab = tok.get_vocab()
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=False)
               if ty == CONTROL and t in vocab and (spelled is None or set(t) <= spelled)]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types, strict=False)
            if ty == USER_DEFINED and t in vocab]
    tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    bos_id = get("tokenizer.ggml.bos_token_id")
    add_bos = get("tokenizer.ggml.add_bos_token", model == "llama")
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, bos_id)])
    return tok


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
    split = _SPLITS.get(pre or "")
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre == "smollm":
        # SmolLM's own tokenizer.json: digits one at a time, then GPT-2's byte-level split.
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(get, tokens: list[str]) -> tuple[Tokenizer, list[str]]:
    arch = get("general.architecture")
    gemma = str(arch).startswith("gemma")
    if gemma:
        # Gemma files spell multi-space tokens with real spaces; the model's vocabulary uses "▁".
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = [-i for i in range(len(tokens))]  # Gemma's merge order is file order, not its scores
    else:
        scores = get("tokenizer.ggml.scores") or [-i for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    merges = _merges_from_vocab(vocab, dict(zip(tokens, scores, strict=False)))
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if get("tokenizer.ggml.add_space_prefix", not gemma):
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    else:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence(steps)
    return tok, tokens


def _merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best score first."""
    merges = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]
