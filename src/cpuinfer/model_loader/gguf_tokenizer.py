"""Build a `tokenizers.Tokenizer` from a GGUF file's tokenizer metadata.

GGUF carries no tokenizer.json, only llama.cpp's description: the vocabulary, merges (for byte-level
BPE), scores, token types and the pre-tokenizer name. Three families cover our models:
"gpt2" (byte-level BPE: SmolLM2, Llama 3, Qwen), "llama" (SentencePiece BPE with byte fallback:
Llama 2, Mistral, Gemma) and "bert" (WordPiece: BERT encoders). This mirrors what transformers' GGUF
loader does, without transformers.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE, WordPiece

from .errors import ModelLoadError

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx")}
_SPLITS.update({name: _QWEN2_SPLIT for name in ("qwen2", "deepseek-r1-qwen", "megrez")})

CONTROL, USER_DEFINED = 3, 4
# The longest token in real vocabularies is a few hundred characters at most (SmolLM2: 81, Gemma 3: 31). Building
# the SentencePiece merges costs length**2 per token (measured: 46 ms at 20,000 characters, so ~5 s at 200,000,
# and a file may hold many); at this bound even 262k tokens of full length stay within about a minute.
MAX_TOKEN_CHARS = 1024


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
    if model not in ("gpt2", "llama", "bert"):
        raise ModelLoadError(f"{path}: GGUF tokenizer model {model!r} is not supported; supported: gpt2, llama, bert")
    _check_tokens(get, tokens, path)
    types = get("tokenizer.ggml.token_type") or [1] * len(tokens)
    try:
        if model == "bert":
            return _wordpiece(get, tokens, types)
        if model == "gpt2":
            tok = _byte_level(tokens, get("tokenizer.ggml.merges") or [], get("tokenizer.ggml.pre"))
            spelled = set(_bytes_to_unicode().values())
        else:
            tok, tokens = _sentencepiece(get, tokens)
            spelled = None
    except Exception as e:  # tokenizers raises a bare Exception for e.g. a merge of tokens not in the vocabulary
        raise ModelLoadError(
            f"{path}: the GGUF tokenizer cannot be built ({e}); the file is corrupt: re-download or re-convert it"
        ) from e
    # Only tokens the vocabulary has (as spelled there): anything else would get a new id past the model's vocab.
    vocab = tok.get_vocab()
    control = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == CONTROL and t in vocab and (spelled is None or set(t) <= spelled)
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=False)
        if ty == USER_DEFINED and t in vocab
    ]
    tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    bos_id = get("tokenizer.ggml.bos_token_id")
    add_bos = get("tokenizer.ggml.add_bos_token", model == "llama")
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return tok


def _check_tokens(get, tokens, path: str) -> None:
    """Token list, merges and special-token ids well-formed and in range, before anything is built from them."""

    def corrupt(what: str) -> ModelLoadError:
        return ModelLoadError(f"{path}: {what}; the file is corrupt or hostile: re-download or re-convert it")

    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise corrupt("tokenizer.ggml.tokens is not a list of strings")
    longest = max(range(len(tokens)), key=lambda i: len(tokens[i]))
    if len(tokens[longest]) > MAX_TOKEN_CHARS:
        raise corrupt(
            f"token {longest} (tokenizer.ggml.tokens) is {len(tokens[longest])} characters long; "
            f"cpuinfer accepts tokens of up to {MAX_TOKEN_CHARS}"
        )
    merges = get("tokenizer.ggml.merges") or []
    if not isinstance(merges, list) or not all(isinstance(m, str) and " " in m for m in merges):
        raise corrupt('tokenizer.ggml.merges is not a list of "left right" strings')
    # Each merge joins two tokens into a third, at one of its len - 1 split points: no more merges than that.
    splits = sum(len(t) - 1 for t in tokens)
    if len(merges) > splits:
        raise corrupt(
            f"tokenizer.ggml.merges has {len(merges)} merges, more than the {splits} ways to split "
            f"the {len(tokens)} tokens in two"
        )
    for key in sorted(
        k
        for k in ("bos", "eos", "eot", "eom", "unknown", "padding", "sep", "cls", "mask")
        if get(f"tokenizer.ggml.{k}_token_id") is not None
    ):
        value = get(f"tokenizer.ggml.{key}_token_id")
        for i in value if isinstance(value, list) else [value]:
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tokens):
                raise corrupt(f"tokenizer.ggml.{key}_token_id = {value!r} is not a token id (0 to {len(tokens) - 1})")


def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
    split = _SPLITS.get(pre or "")
    if split is not None:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre == "smollm":
        # SmolLM's own tokenizer.json: digits one at a time, then GPT-2's byte-level split.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _wordpiece(get, tokens: list[str], types: list[int]) -> Tokenizer:
    """BERT's WordPiece tokenizer from llama.cpp's form of its vocabulary (convert_hf_to_gguf's BertModel.set_vocab):
    a word's first piece is written with a phantom space ("\u2581the"), a continuation without its "##" ("ing"),
    control tokens ([CLS], [SEP], ...) as they are. Normalisation as llama.cpp's WPM tokenizer reads it
    (tokenizer.ggml.normalizer.lowercase, .strip_accents: absent = false and = lowercase), which is
    transformers' BertNormalizer; [CLS] text [SEP] around every input (bos and eos/sep ids; B's tokens of a pair
    get token type 1, as BERT's own tokenizer)."""
    spelled = [
        t if ty == CONTROL else t[1:] if t.startswith("\u2581") else f"##{t}"
        for t, ty in zip(tokens, types, strict=True)
    ]
    vocab = {t: i for i, t in reversed(list(enumerate(spelled)))}  # the first id of a spelling, as llama.cpp's map
    unk_id = get("tokenizer.ggml.unknown_token_id", 100)
    tok = Tokenizer(WordPiece(vocab, unk_token=spelled[unk_id], max_input_chars_per_word=100))
    lowercase = bool(get("tokenizer.ggml.normalizer.lowercase", False))
    strip = bool(get("tokenizer.ggml.normalizer.strip_accents", lowercase))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=strip, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, ty in zip(spelled, types, strict=True) if ty == CONTROL]
    )
    cls_id = get("tokenizer.ggml.bos_token_id", 101)
    sep_id = get("tokenizer.ggml.seperator_token_id", get("tokenizer.ggml.eos_token_id", 102))
    cls, sep = spelled[cls_id], spelled[sep_id]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1", special_tokens=[(cls, cls_id), (sep, sep_id)]
    )
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
        local = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]
