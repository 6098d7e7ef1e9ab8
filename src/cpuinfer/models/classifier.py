"""A sequence-classification head on a pooled vector, and the activation a cross-encoder's scores go through.

Cross-encoders (BERT / XLM-RoBERTa `*ForSequenceClassification`: bge-reranker) put a dense layer with tanh and a
linear classifier on their first token; a decoder reranker (Qwen3-Reranker in vLLM's form) a linear `score` on
its last token, made from two rows of its language-model head. The activation is sentence-transformers'
CrossEncoder's: the config's `sentence_transformers.activation_fn` when it names a torch activation, else sigmoid
for one label; for several labels vLLM's softmax (CrossEncoder would return the raw logits there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ACTIVATIONS = ("sigmoid", "softmax", "identity")
_TORCH_NAMES = {"Sigmoid": "sigmoid", "Softmax": "softmax", "Identity": "identity"}


@dataclass
class ClassifierHead:
    """logits = out(tanh(dense(x))) (dense absent: out(x)), in float32 on [n, hidden] pooled vectors."""

    out_w: torch.Tensor  # [num_labels, hidden]
    out_b: torch.Tensor | None = None
    dense_w: torch.Tensor | None = None
    dense_b: torch.Tensor | None = None

    @property
    def num_labels(self) -> int:
        """Width of the logits."""
        return self.out_w.shape[0]

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [n, num_labels] of pooled vectors [n, hidden]."""
        x = x.float()
        if self.dense_w is not None:
            x = torch.tanh(torch.nn.functional.linear(x, self.dense_w, self.dense_b))
        return torch.nn.functional.linear(x, self.out_w, self.out_b)


def num_labels(config: dict) -> int:
    """The classifier's labels: a decoder reranker's from its tokens (vLLM's classifier_from_token: one for
    from_2_way_softmax, the yes-minus-no row; one per token otherwise), else as transformers counts them
    (id2label, else num_labels, else 2)."""
    tokens = config.get("classifier_from_token")
    if tokens:
        return 1 if from_2_way_softmax(config) else len(tokens)
    if config.get("id2label"):
        return len(config["id2label"])
    return int(config.get("num_labels", 2))


def from_2_way_softmax(config: dict) -> bool:
    """True for Qwen3-Reranker's form (vLLM's is_original_qwen3_reranker, or method from_2_way_softmax): the
    score is softmax over the (no, yes) logits, i.e. sigmoid of the yes row minus the no row."""
    return bool(config.get("is_original_qwen3_reranker")) or config.get("method") == "from_2_way_softmax"


def classifier_of(architecture: str, config: dict) -> tuple[int, str] | None:
    """(num_labels, activation) of a sequence-classification architecture; None for any other."""
    if not architecture.endswith("ForSequenceClassification"):
        return None
    labels = num_labels(config)
    return labels, resolve_activation(config, labels)


def resolve_activation(config: dict, labels: int) -> str:
    """sigmoid, softmax or identity: what the model's config declares (sentence-transformers' activation_fn or its
    older sbert_ce_default_activation_function), else sigmoid for one label and softmax for more."""
    declared = (config.get("sentence_transformers") or {}).get("activation_fn") or config.get(
        "sbert_ce_default_activation_function"
    )
    if declared:
        name = str(declared).rsplit(".", 1)[-1]
        if not str(declared).startswith("torch.") or name not in _TORCH_NAMES:
            raise ValueError(
                f"the model's activation_fn {declared!r} is not supported; use one of torch.nn's "
                f"{', '.join(_TORCH_NAMES)}"
            )
        return _TORCH_NAMES[name]
    return "sigmoid" if labels == 1 else "softmax"


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """Scores of logits [n, labels] under sigmoid, softmax (over the labels) or identity."""
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    return logits
