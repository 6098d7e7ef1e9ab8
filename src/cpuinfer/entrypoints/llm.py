"""`LLM`: vLLM's offline Python API (`from cpuinfer import LLM, SamplingParams`).

llm = LLM(model="path/or/file.gguf", dtype="bfloat16")   # model=None: the bundled SmolLM2
outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from cpuinfer.config import EngineArgs
from cpuinfer.engine.limits import check_pooling_text
from cpuinfer.engine.llm_engine import LLMEngine, Prompt, tokenize_prompt
from cpuinfer.errors import RequestFailedError
from cpuinfer.outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
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
        prompts = _as_prompt_list(prompts)
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = PoolingParams(params.dimensions, params.normalize, truncate_prompt_tokens)
        keep = params.truncate_prompt_tokens
        tokenized = []
        for p in prompts:
            text, ids = tokenize_prompt(self.llm_engine.tokenizer, p)
            check_pooling_text(text)
            tokenized.append({"prompt": text, "prompt_token_ids": ids[-keep:] if keep else ids})
        sp = params.as_sampling()
        outs = self._run(tokenized, [sp] * len(tokenized), use_tqdm)
        results = []
        for out in outs:
            if out.error_id is not None or out.pooled is None:
                raise RequestFailedError(out.request_id, str(out.error_id), out.error_reason, out.error_param)
            results.append(
                EmbeddingRequestOutput(out.request_id, EmbeddingOutput(out.pooled.tolist()), out.prompt_token_ids)
            )
        return results

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
