"""`LLM`: vLLM's offline Python API (`from cpuinfer import LLM, SamplingParams`).

llm = LLM(model="path/or/file.gguf", dtype="bfloat16")   # model=None: the bundled SmolLM2
outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch

from cpuinfer.config import EngineArgs
from cpuinfer.engine.limits import check_pooling_text
from cpuinfer.engine.llm_engine import LLMEngine, Prompt, tokenize_prompt
from cpuinfer.entrypoints.score_inputs import encode_pairs, pair_texts
from cpuinfer.errors import RequestFailedError
from cpuinfer.outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from cpuinfer.sampling_params import PoolingParams, SamplingParams

logger = logging.getLogger(__name__)

# vLLM arguments that mean nothing on this engine; accepted so existing scripts run.
_IGNORED = {
    "trust_remote_code",
    "enforce_eager",
    "disable_log_stats",
    "tokenizer_mode",
    "swap_space",
    "gpu_memory_utilization",
    "disable_custom_all_reduce",
}


def _check_data_parallel(args: EngineArgs, rank_given: bool) -> None:
    """Offline data parallelism is one LLM per process, as in vLLM: each is told its rank."""
    if args.data_parallel_backend == "ray":
        raise ValueError(
            "LLM(data_parallel_backend='ray') is not supported: Ray data parallelism is for `cpuinfer serve`; "
            "offline, start one process per rank with LLM(data_parallel_size=N, data_parallel_rank=i)"
        )
    if args.data_parallel_size > 1 and not rank_given:
        raise ValueError(
            f"LLM(data_parallel_size={args.data_parallel_size}) runs one engine per process, as vLLM's offline "
            "data parallelism does: start one process per rank with LLM(data_parallel_size=N, "
            "data_parallel_rank=i) (each takes its share of the cores) and give each its share of the prompts; "
            "or serve with `cpuinfer serve -dp N`, which routes requests between N engine cores"
        )


def _as_prompt_list(prompts) -> list:
    """One prompt (a str, a dict or a token-id list) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)
    ):
        return [prompts]
    return list(prompts)


class LLM:
    """An engine for offline batch generation."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        quantization: str | None = None,
        max_model_len: int | None = None,
        kv_cache_dtype: str = "auto",
        enable_prefix_caching: bool = True,
        block_size: int = 128,
        seed: int | None = 0,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        tensor_parallel_size: int = 1,
        **kwargs: Any,
    ):
        known = {f for f in EngineArgs.__dataclass_fields__ if f != "extra"}
        extra = {k: v for k, v in kwargs.items() if k in known}
        unknown = sorted(set(kwargs) - known - _IGNORED)
        if unknown:
            raise TypeError(f"LLM() got unexpected argument(s) {', '.join(unknown)}")
        args = EngineArgs(
            model=model,
            dtype=dtype,
            quantization=quantization,
            max_model_len=max_model_len,
            kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=enable_prefix_caching,
            block_size=block_size,
            seed=seed,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            tensor_parallel_size=tensor_parallel_size,
            **extra,
        )
        _check_data_parallel(args, "data_parallel_rank" in kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)

    def get_tokenizer(self):
        """The tokenizers.Tokenizer of the model."""
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults (as vLLM does)."""
        defaults = getattr(self.llm_engine.config.spec, "generation_defaults", None) or {}
        allowed = {
            k: v for k, v in defaults.items() if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        }
        return SamplingParams(**allowed)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in prompt order."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one, or one each")
        return self._run(prompts, params, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (strings or token-id lists) on a pooling model (runner="pooling"); in order.

        truncate_prompt_tokens (or the PoolingParams field) keeps the last k tokens of each prompt, as vLLM."""
        outs = self._pool_prompts(prompts, pooling_params, "embed", use_tqdm, truncate_prompt_tokens)
        return [
            EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.pooled.tolist()), o.prompt_token_ids) for o in outs
        ]

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ClassificationRequestOutput]:
        """A sequence classifier's scores per label of every prompt (`.outputs.probs`: after its activation,
        sigmoid for one label, softmax for more, unless pooling_params.activation is False); in order."""
        outs = self._pool_prompts(prompts, pooling_params, "classify", use_tqdm, truncate_prompt_tokens)
        return [
            ClassificationRequestOutput(o.request_id, ClassificationOutput(o.pooled.tolist()), o.prompt_token_ids)
            for o in outs
        ]

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """Score text pairs (one data_1 against each data_2, or pairwise): a cross-encoder's score of each pair
        as one input (its tokenizer's pair template; truncate_prompt_tokens truncates the pair longest-first, as
        transformers), or on an embedding model the cosine similarity of the two texts' embeddings, as vLLM."""
        pairs = pair_texts(data_1, data_2, ("data_1", "data_2"))
        config = self.llm_engine.config
        if config.pooler is not None and config.pooler.task == "embed":
            firsts = list(dict.fromkeys(a for a, _ in pairs))
            vecs = self.embed([*firsts, *(b for _, b in pairs)], pooling_params, use_tqdm, truncate_prompt_tokens)
            first = {t: torch.tensor(v.outputs.embedding) for t, v in zip(firsts, vecs, strict=False)}
            out = []
            for (a, _), v in zip(pairs, vecs[len(firsts) :], strict=True):
                cos = torch.nn.functional.cosine_similarity(first[a], torch.tensor(v.outputs.embedding), dim=0)
                out.append(ScoringRequestOutput(v.request_id, ScoringOutput(float(cos)), v.prompt_token_ids))
            return out
        base = dataclasses.replace(pooling_params or PoolingParams(), task="score")
        keep = truncate_prompt_tokens or base.truncate_prompt_tokens
        tokenized, params = [], []
        for ids, types in encode_pairs(self.llm_engine.tokenizer, pairs, config.spec.type_vocab_size, keep):
            tokenized.append({"prompt_token_ids": ids})
            params.append(dataclasses.replace(base, token_type_ids=types))
        outs = self._pool(tokenized, params, use_tqdm)
        return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.pooled[0])), o.prompt_token_ids) for o in outs]

    def _pool_prompts(self, prompts, pooling_params, task, use_tqdm, truncate_prompt_tokens) -> list[RequestOutput]:
        """Tokenize prompts (each text non-empty; the last k tokens kept when truncating) and pool them for task."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task=task)
        if truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        keep = params.truncate_prompt_tokens
        tokenized = []
        for p in _as_prompt_list(prompts):
            text, ids = tokenize_prompt(self.llm_engine.tokenizer, p)
            check_pooling_text(text)
            tokenized.append({"prompt": text, "prompt_token_ids": ids[-keep:] if keep else ids})
        return self._pool(tokenized, [params] * len(tokenized), use_tqdm)

    def _pool(self, tokenized: list[dict], params: list[PoolingParams], use_tqdm: bool) -> list[RequestOutput]:
        """Run pooling requests; each output's .pooled is its vector (or scores); a failed one raises."""
        outs = self._run(tokenized, [p.as_sampling() for p in params], use_tqdm)
        for out in outs:
            if out.error_id is not None or out.pooled is None:
                raise RequestFailedError(out.request_id, str(out.error_id), out.error_reason, out.error_param)
        return outs

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate replies."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        spec = self.llm_engine.config.spec
        prompts = []
        for conv in conversations:
            text, ids = spec.encode_chat(conv, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, prompts: list[Prompt], params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        # Every request is checked before the first one starts.
        checked = [engine.validate(p, sp) for p, sp in zip(prompts, params, strict=True)]
        ids = []
        for (text, tokens), sp in zip(checked, params, strict=True):
            rid = engine.next_request_id()
            engine.add_tokenized(rid, text, tokens, sp)
            ids.append(rid)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        n_in = n_out = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if out.error_id is not None:  # the others go on; this one's outputs end with "error"
                            logger.warning(
                                "request %s failed inside the engine (error id %s): %s",
                                out.request_id,
                                out.error_id,
                                out.error_reason or "see the log above",
                            )
                        if bar is not None:
                            n_in += len(out.prompt_token_ids)
                            n_out += sum(len(o.token_ids) for o in out.outputs)
                            elapsed = bar.format_dict["elapsed"] or 1e-9
                            bar.set_postfix_str(
                                f"est. speed input: {n_in / elapsed:.1f} toks/s, output: {n_out / elapsed:.1f} toks/s",
                                refresh=False,
                            )
                            bar.update(1)
        except BaseException:
            engine.abort_request([r for r in ids if r not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in ids]
