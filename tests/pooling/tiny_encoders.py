"""Tiny random-weight encoders made here with transformers (fixed seeds): XLM-RoBERTa (bge-m3's form) with a
WordLevel tokenizer laid out as XLM-R's (<s> <pad> </s> <unk> first; pairs as <s> A </s></s> B </s>), and the
cross-encoder forms (`*ForSequenceClassification`, one label: bge-reranker's)."""

from __future__ import annotations

import json
import os
import pathlib

import torch

from .tiny_embedders import TEXTS  # noqa: F401 - the same texts for the encoders' tests

SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # XLM-R's ids 0..3 (padding_idx 1)
VOCAB = 260
WORDS = [f"w{i}" for i in range(VOCAB - len(SPECIALS))]


def write_roberta_tokenizer(path: pathlib.Path) -> None:
    """tokenizer.json + tokenizer_config.json with XLM-R's special tokens and pair template (token types all 0)."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    vocab.update({w: i + len(SPECIALS) for i, w in enumerate(WORDS)})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    tok.save(str(path / "tokenizer.json"))
    names = {"bos_token": "<s>", "cls_token": "<s>", "eos_token": "</s>", "sep_token": "</s>"}
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "model_max_length": 512,
                **names,
            }
        )
    )


def make_xlmr(path: pathlib.Path, architecture: str = "XLMRobertaModel", seed: int = 7, **config) -> pathlib.Path:
    """A tiny XLM-RoBERTa (XLMRobertaModel or XLMRobertaForSequenceClassification) saved at path, float32."""
    import transformers

    cfg = transformers.XLMRobertaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=514,
        type_vocab_size=1,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        initializer_range=0.1,
        **config,
    )
    torch.manual_seed(seed)
    getattr(transformers, architecture)(cfg).float().eval().save_pretrained(path)
    write_roberta_tokenizer(path)
    return path


def make_bert_classifier(path: pathlib.Path, tokenizer_dir: str, seed: int = 11, **config) -> pathlib.Path:
    """A tiny BertForSequenceClassification (one label unless config says) with the tokenizer files of
    tokenizer_dir (a real BERT WordPiece vocabulary: pairs get token types 0 and 1)."""
    import transformers

    cfg = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=512,
        initializer_range=0.1,
        **{"num_labels": 1, **config},
    )
    torch.manual_seed(seed)
    transformers.BertForSequenceClassification(cfg).float().eval().save_pretrained(path)
    link_bert_tokenizer(path, tokenizer_dir)
    return path


def link_bert_tokenizer(path: pathlib.Path, tokenizer_dir: str) -> None:
    """The tokenizer files of tokenizer_dir (a BERT WordPiece checkpoint's), linked into path."""
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (path / name).symlink_to(os.path.join(tokenizer_dir, name))
