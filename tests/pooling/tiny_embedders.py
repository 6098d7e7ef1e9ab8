"""Tiny decoder embedders made here: a random-weight Qwen3 (transformers, fixed seed) with a WordLevel tokenizer
that appends end-of-text as Qwen3-Embedding's does, wrapped as a sentence-transformers checkpoint."""

from __future__ import annotations

import json
import pathlib

import torch

VOCAB = 256
WORDS = [f"w{i}" for i in range(VOCAB - 3)]  # ids 0..252; then unk, pad, end-of-text
UNK, PAD, EOS = VOCAB - 3, VOCAB - 2, VOCAB - 1
TEXTS = [
    "w1 w2 w3",
    "w10 w20 w30 w40 w50 w60 w70 w80 w90 w100",
    "w5",
    " ".join(f"w{(7 * i) % 250}" for i in range(40)),
    "w200 w201 w202 w203 w204 w205",
]


def write_tokenizer(path: pathlib.Path) -> None:
    """tokenizer.json (WordLevel over whitespace, end-of-text appended) and the config transformers reads."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({"<unk>": UNK, "<pad>": PAD, "<|endoftext|>": EOS})
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<pad>", "<|endoftext|>"])
    tok.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B <|endoftext|>", special_tokens=[("<|endoftext|>", EOS)]
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
                "eos_token": "<|endoftext|>",
                "model_max_length": 512,
            }
        )
    )


def make_qwen3(path: pathlib.Path, seed: int = 1234, **config) -> pathlib.Path:
    """A tiny Qwen3ForCausalLM (head_dim 64: the compiled attention kernels run it) saved at path, float32."""
    import transformers

    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=512,
        eos_token_id=EOS,
        pad_token_id=PAD,
        **{"initializer_range": 0.1, "tie_word_embeddings": True, **config},
    )
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    model.save_pretrained(path)
    write_tokenizer(path)
    return path


def write_sentence_transformers(path: pathlib.Path, mode: str, normalize: bool, dim: int = 128) -> None:
    """modules.json + 1_Pooling/config.json (+ Normalize) over the checkpoint at path, as sentence-transformers
    writes them; mode: lasttoken, mean or cls; dim: the model's hidden size."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    pooling = {
        "word_embedding_dimension": dim,
        "pooling_mode_cls_token": mode == "cls",
        "pooling_mode_mean_tokens": mode == "mean",
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
        "pooling_mode_lasttoken": mode == "lasttoken",
        "include_prompt": True,
    }
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))


def st_encode(path: pathlib.Path, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' own embeddings of texts (float32, one text at a time: no padding involved)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return torch.stack([torch.as_tensor(model.encode([t], convert_to_numpy=True)[0]) for t in texts])
