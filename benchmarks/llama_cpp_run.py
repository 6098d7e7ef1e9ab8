"""llama.cpp (llama-cpp-python's low-level API) driven the way the benchmarks compare it with cpuinfer.

Imported by the benchmarks' llama.cpp rows in a process of the interpreter that has llama-cpp-python
(CPUINFER_LLAMA_PYTHON; see bench_quant.py for how to build it), which need not have torch or cpuinfer:
this module imports neither. The library's default context settings otherwise (flash attention auto, f16
KV, mmap, extra buffer types such as the AMX / repacked weights on); greedy, the argmax of the logits.

    python benchmarks/llama_cpp_run.py --long MODEL.gguf --contexts 4096,8000 --steps 32 --threads 2

prints one JSON line: batch-1 decode after a prompt of each context length (long_context()).

    python benchmarks/llama_cpp_run.py --returning MODEL.gguf --context 7000 --suffix 256 --rounds 3

prints one JSON line: the time to first token of a returning conversation whose KV was cleared, recomputed
or restored from a copy of its state in RAM (returning()).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import statistics
import time


def add_llama_args(ap: argparse.ArgumentParser, rows: str) -> None:
    """--llama / --llama-python, as every benchmark with llama.cpp rows takes them (rows: what they measure)."""
    ap.add_argument(
        "--llama",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"{rows} (default: on; skipped where no interpreter imports llama_cpp)",
    )
    ap.add_argument(
        "--llama-python",
        default=None,
        help="interpreter with llama-cpp-python (default: $CPUINFER_LLAMA_PYTHON, else this one; see bench_quant.py)",
    )


class Llama:
    """A loaded model and the calls the benchmarks make on it."""

    def __init__(self, model_path: str, threads: int):
        import llama_cpp as L
        import numpy as np

        self.L, self.np, self.threads = L, np, threads
        L.llama_backend_init()
        t0 = time.perf_counter()
        self.model = L.llama_model_load_from_file(model_path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        self.load = time.perf_counter() - t0
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))

    def context(self, n_ctx: int, n_batch: int, n_seq: int):
        cp = self.L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, min(n_batch, 512), n_seq
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.no_perf = True
        ctx = self.L.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx {n_ctx}, n_batch {n_batch}, n_seq {n_seq})")
        return ctx

    def make_batch(self, n_max: int, n_seq: int):
        batch = self.L.llama_batch_init(n_max, 0, n_seq)
        view = {
            f: self.np.ctypeslib.as_array(getattr(batch, f), shape=(n_max,))
            for f in ("token", "pos", "n_seq_id", "logits")
        }
        return batch, view

    def fill(self, batch, view, seqs: list[tuple[int, list[int], int]]) -> None:
        """seqs: (seq id, tokens, position of the first); logits for the last token of each."""
        i = 0
        for s, toks, p0 in seqs:
            n = len(toks)
            view["token"][i : i + n] = toks
            view["pos"][i : i + n] = self.np.arange(p0, p0 + n)
            view["n_seq_id"][i : i + n] = 1
            view["logits"][i : i + n] = 0
            view["logits"][i + n - 1] = 1
            for j in range(i, i + n):
                batch.seq_id[j][0] = s
            i += n
        batch.n_tokens = i

    def decode(self, ctx, batch, n_out: int):
        rc = self.L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return self.np.ctypeslib.as_array(self.L.llama_get_logits(ctx), shape=(n_out, self.vocab)).argmax(axis=1)

    def generate(self, ctx, batch, view, ps: list[list[int]], n_new: int, steps: list | None = None):
        """Greedy n_new tokens for each prompt at once; (total seconds, seconds to the first tokens). The
        prompts go in as one llama_decode (llama.cpp splits it into ubatches of 512 itself). steps, if
        given, gets (seconds, process CPU seconds) of the first tokens and then of each later step."""
        self.L.llama_memory_clear(self.L.llama_get_memory(ctx), True)
        t, c = time.perf_counter(), time.process_time()
        self.fill(batch, view, [(s, p, 0) for s, p in enumerate(ps)])
        nxt = self.decode(ctx, batch, len(ps))
        first = time.perf_counter() - t
        if steps is not None:
            steps.append((first, time.process_time() - c))
        for step in range(n_new - 1):
            ts, cs = time.perf_counter(), time.process_time()
            self.fill(batch, view, [(s, [int(nxt[s])], len(p) + step) for s, p in enumerate(ps)])
            nxt = self.decode(ctx, batch, len(ps))
            if steps is not None:
                steps.append((time.perf_counter() - ts, time.process_time() - cs))
        return time.perf_counter() - t, first

    def free(self, batch, ctx) -> None:
        self.L.llama_batch_free(batch)
        self.L.llama_free(ctx)

    def close(self) -> None:
        self.L.llama_model_free(self.model)


def long_context(model_path: str, contexts: list[int], steps: int, threads: int, seed: int = 0) -> dict:
    """Batch 1: a prompt of each context length (random token ids, the same as the engine's for the same
    seed: bench_long_context.prompt_ids), its time to first token, then `steps` greedy tokens; decode
    tokens/s from the median step (a shared host's hiccups are outliers); the same from process CPU time
    (cpu_tps, ttft_cpu: with one thread, what a shared host's load leaves out; llama.cpp's thread pool spins,
    so with more its CPU time is no measure)."""
    llama = Llama(model_path, threads)
    n_ctx = max(contexts) + steps + 256
    ctx = llama.context(n_ctx, n_ctx, 1)
    batch, view = llama.make_batch(n_ctx, 1)
    llama.generate(ctx, batch, view, [prompt_ids(16, llama.vocab, seed)], 4)  # warm-up
    rows = []
    for c in contexts:
        times: list[tuple[float, float]] = []
        llama.generate(ctx, batch, view, [prompt_ids(c, llama.vocab, seed)], steps + 1, times)
        (first, first_cpu), wall, cpu = times[0], sorted(t for t, _ in times[1:]), sorted(c for _, c in times[1:])
        rows.append(
            dict(ctx=c, ttft=first, tps=1 / wall[len(wall) // 2], ttft_cpu=first_cpu, cpu_tps=1 / cpu[len(cpu) // 2])
        )
    llama.free(batch, ctx)
    info = llama.L.llama_print_system_info().decode().strip()
    llama.close()
    return dict(rows=rows, threads=threads, system_info=info)


def returning(model_path: str, context: int, suffix: int, rounds: int, threads: int) -> dict:
    """The time to first token of a returning conversation: A (`context` tokens, one answer token), then A again
    with its answer and `suffix` new tokens after the context was cleared (another conversation took it: one
    sequence, so clearing is all it does to A). Either recomputed from nothing, or A's sequence state (saved to
    RAM once, after its turn) loaded back and only the rest decoded: what llama-server's --cache-ram (its
    prompt cache) and llama-cpp-python's LlamaRAMCache do. Alternating rounds; the medians, wall-clock and
    process CPU time, and the saved state's bytes."""
    llama = Llama(model_path, threads)
    L = llama.L
    n_ctx = context + suffix + 64
    ctx = llama.context(n_ctx, n_ctx, 1)
    batch, view = llama.make_batch(n_ctx, 1)
    mem = L.llama_get_memory(ctx)
    a = prompt_ids(context, llama.vocab, 0)
    more = prompt_ids(suffix, llama.vocab, 2)
    llama.generate(ctx, batch, view, [prompt_ids(16, llama.vocab, 3)], 2)  # warm-up
    L.llama_memory_clear(mem, True)
    llama.fill(batch, view, [(0, a, 0)])
    answer = int(llama.decode(ctx, batch, 1)[0])
    size = L.llama_state_seq_get_size(ctx, 0)
    saved = (ctypes.c_uint8 * size)()
    state_bytes = L.llama_state_seq_get_data(ctx, saved, size, 0)
    times: dict[str, list[tuple[float, float]]] = {"recompute": [], "cache_ram": []}
    for _ in range(rounds):
        for mode in times:
            t, c = time.perf_counter(), time.process_time()
            L.llama_memory_clear(mem, True)
            if mode == "recompute":
                llama.fill(batch, view, [(0, [*a, answer, *more], 0)])
            else:
                if L.llama_state_seq_set_data(ctx, saved, state_bytes, 0) == 0:
                    raise RuntimeError("llama_state_seq_set_data failed")
                llama.fill(batch, view, [(0, [answer, *more], len(a))])
            llama.decode(ctx, batch, 1)
            times[mode].append((time.perf_counter() - t, time.process_time() - c))
    llama.free(batch, ctx)
    llama.close()
    return dict(
        ttft={m: statistics.median(w for w, _ in v) for m, v in times.items()},
        cpu={m: statistics.median(c for _, c in v) for m, v in times.items()},
        state_bytes=state_bytes,
    )


def prompt_ids(length: int, vocab: int, seed: int) -> list[int]:
    """`length` random token ids in [1000, vocab)."""
    rng = random.Random(seed * 1_000_003 + length)
    return [rng.randrange(1000, vocab) for _ in range(length)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--long", metavar="MODEL", help="GGUF file: decode after long prompts")
    mode.add_argument("--returning", metavar="MODEL", help="GGUF file: a returning conversation's TTFT")
    ap.add_argument("--context", type=int, default=7000, help="--returning: the conversation's first prompt")
    ap.add_argument("--suffix", type=int, default=256, help="--returning: its new tokens when it returns")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contexts", default="4096,8000")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if args.returning:
        print(json.dumps(returning(args.returning, args.context, args.suffix, args.rounds, args.threads)))
        return 0
    contexts = [int(c) for c in args.contexts.split(",")]
    print(json.dumps(long_context(args.long, contexts, args.steps, args.threads)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
