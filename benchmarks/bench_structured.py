"""Structured-output cost on SmolLM2: decode tokens/s with and without a JSON schema, and schema compile time.

    python benchmarks/bench_structured.py [--batch 1 32 --output-len 64 --backend llguidance]

decode:  `batch` requests of a short prompt, output-len tokens each (the schema asks for a long string, so a
         constrained sequence runs to output-len like an unconstrained one with ignore_eos); output tokens/s of
         the decode steps (prefill excluded), with and without the schema, in the same run; prints the ratio
         (also with the mask filled after the forward pass instead of during it); alternating rounds, best of each.
compile: a fresh schema (cold: backend built, nothing cached) and the same schema again (cached).
Targets (issue 14): constrained >= 0.9x unconstrained per output token at batch 1 and 32; cached compile <= 1 ms.
"""

from __future__ import annotations

import argparse
import json
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "story": {"type": "string", "minLength": 2000},
    },
    "required": ["title", "year", "tags", "story"],
    "additionalProperties": False,
}


def decode_rate(engine, batch: int, output_len: int, constrained: bool) -> float:
    """Output tokens/s of the decode steps of `batch` requests (prefill steps excluded)."""
    from cpuinfer.sampling_params import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA) if constrained else None
    params = SamplingParams(
        temperature=1.0, seed=0, max_tokens=output_len, ignore_eos=not constrained, structured_outputs=so
    )
    prompt = engine.config.spec.encode_chat([{"role": "user", "content": "Write a long story as JSON."}])[1]
    for i in range(batch):
        engine.add_request(f"{constrained}-{batch}-{i}", prompt, params)
    engine.step()  # the prefill (and first token) of the whole batch
    tokens, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += sum(len(o.token_ids) for o in out.outputs) if out.finished else 0
    elapsed = time.perf_counter() - t0
    return (tokens - batch) / elapsed  # the first token of each came from the prefill step


def compile_times(engine) -> tuple[float, float, float]:
    """Seconds to build the backend (once per process: the tokenizer's token trie), to compile a new schema
    (cold) and the same schema again (cached)."""
    from cpuinfer.sampling_params import StructuredOutputsParams

    grammars = engine.core.grammars
    t0 = time.perf_counter()
    grammars.backend  # noqa: B018 - built on first use
    build = time.perf_counter() - t0
    schema = dict(SCHEMA, title="cold")
    t0 = time.perf_counter()
    grammars.compile(StructuredOutputsParams(json=schema))
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(100):
        grammars.compile(StructuredOutputsParams(json=json.dumps(schema)))
    return build, cold, (time.perf_counter() - t0) / 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model (default: the bundled SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--backend", default="llguidance", choices=["llguidance", "xgrammar"])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per batch size (best of each)")
    args = ap.parse_args()

    from cpuinfer.config import EngineArgs
    from cpuinfer.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=args.model, max_model_len=1024, seed=0, structured_outputs_backend=args.backend)
    )
    build, cold, cached = compile_times(engine)
    print(
        f"backend {args.backend}: built in {build * 1e3:.0f} ms (once per process); schema compile cold "
        f"{cold * 1e3:.1f} ms, cached {cached * 1e3:.3f} ms"
    )
    for batch in args.batch:
        decode_rate(engine, batch, 8, False)  # warm-up
        free = constrained = serial = 0.0
        for _ in range(args.rounds):  # alternating, best of each: the machine may be shared
            free = max(free, decode_rate(engine, batch, args.output_len, False))
            constrained = max(constrained, decode_rate(engine, batch, args.output_len, True))
            engine.core.grammars.overlap = False
            serial = max(serial, decode_rate(engine, batch, args.output_len, True))
            engine.core.grammars.overlap = True
        print(
            f"batch {batch:3d}: decode {free:7.1f} tok/s free, {constrained:7.1f} tok/s with the schema "
            f"({constrained / free:.2f}x; {serial / free:.2f}x with the mask filled after the forward pass)"
        )


if __name__ == "__main__":
    main()
