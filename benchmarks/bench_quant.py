"""Quantized models against our own bf16 and against llama.cpp on the same GGUF files, measured in the same run.

    python benchmarks/bench_quant.py [--model FILE.gguf] [--configs bf16,quant,q8_0,q4_0,q4_k_m,gptq4,gptq4-w4a8,w8a8]
                                     (also mxfp4_moe, for a mixture-of-experts --model)
                                     [--llama | --no-llama] [--llama-python PY] [--threads 2] [--work-dir DIR]

Each row runs in its own process (peak RSS is per process), with bench_engine.py's loop:
W1 = batch 1, 128-token prompt, 128 greedy tokens (decode tok/s, prefill excluded); TTFT of a
512-token prompt; W2 = 32 prompts x 128 in x 128 out at once (output tok/s); peak RSS.

cpuinfer configurations: `bf16` (the GGUF's quants dequantized: CPUINFER_GGUF_DEQUANTIZE=1), `quant`
(the --model file, by default the bundled SmolLM2 Q4_1 with a Q8_0 embedding, kept quantized on the
integer kernels), `q8_0`, `q4_0`, `q4_k_m` (GGUF files of the same model, kept quantized), and the
same model as Hugging Face checkpoints `gptq4` (GPTQ 4 bit, group 128, act-order; a weight-only format,
run with 16-bit activations) and `w8a8` (compressed-tensors int8 per-channel weights, int8 dynamic
activations). `gptq4-w4a8` is the `gptq4` checkpoint under CPUINFER_INT4_W4A8=1 (int8 activations per
block of 32, the path GPTQ took before 16-bit activations became the default): the line
`gptq4 / gptq4-w4a8` gives the speed of the default against the opt-in, same run.

Made once into --work-dir from the --model file: its weights dequantized by the `gguf` package
(gguf.quants.dequantize) into an F32 GGUF with every metadata key copied (tokenizer included); from
those weights `q8_0` (every 2-D tensor Q8_0), `q4_0` (2-D tensors Q4_0, the embedding Q8_0 as in
the bundled Q4_1 file) and `gguf_bf16` (2-D tensors BF16: bench_long_context.py's llama.cpp rows) with
gguf.quants.quantize, and `q4_k_m` with llama.cpp's own quantizer
(llama_cpp.llama_model_quantize, LLAMA_FTYPE_MOSTLY_Q4_K_M: the gguf package has no K-quant
quantizer; rows of 576 are not a multiple of 256, so llama.cpp stores those tensors as Q5_0/Q8_0 and
only the 1536-wide ffn_down as Q4_K/Q6_K), and `mxfp4_moe` likewise (LLAMA_FTYPE_MOSTLY_MXFP4_MOE: a
mixture-of-experts model's expert tensors MXFP4, the other 2-D tensors Q8_0; bench_moe.py's rows). The
HF checkpoints are converted from the GGUF by
transformers and quantized by round to nearest with the tests' helper (tests/models/quant_checkpoints.py,
which needs transformers and compressed-tensors).

llama.cpp rows (`--llama`, the default): for every GGUF configuration in --configs (quant, q8_0, q4_0,
q4_k_m, mxfp4_moe) a `llama:<config>` row on the same file, in its own process of --llama-python (default:
$CPUINFER_LLAMA_PYTHON, else this interpreter), through llama-cpp-python's low-level API: the same
prompt token ids as ours, n_threads = n_threads_batch = --threads, greedy (argmax of the logits),
the library's default context settings otherwise (flash attention auto, f16 KV, mmap, extra
buffer types such as the AMX / repacked weights on). W1: the 128-token prompt in one llama_decode,
then one token per llama_decode; TTFT: one llama_decode of the 512-token prompt (n_batch 512); W2:
llama_batch with 32 sequences (n_seq_max 32): the 32 prompts in one llama_decode, then 32 tokens
per llama_decode until each has 128. llama-cpp-python must be built from its sdist on the machine
that measures, so that ggml uses this CPU's AVX-512 / VNNI / AMX as llama.cpp users get it. `nox -s
bench` does it (noxfile.llama_cpp_build_env: with clang, because GCC 12 drops the stores that fill
ggml's AMX tile configuration and that build segfaults in ggml_backend_amx_mul_mat on its first
prompt; with ggml's spelling of the AMX macros, which clang < 18 does not define under -march=native,
so that the AMX path is built). By hand on this machine, in a venv of its own so that pip never touches
torch:

    AMX="-D__AMX_TILE__ -D__AMX_INT8__ -D__AMX_BF16__"; CC=clang CXX=clang++ CFLAGS="$AMX" CXXFLAGS="$AMX" \\
    CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=1 pip install --no-binary llama-cpp-python \\
        --no-deps llama-cpp-python==0.3.36 numpy typing-extensions diskcache jinja2

llama.cpp's thread pool spins: with 2 threads on this 2-core machine while a compiler ran on one core,
its Q4_0 decode fell to 1.5 tok/s (127 with 1 thread), so run this on a quiet machine (the load
average is printed).

Targets of issue 12 measured here (2 threads): Q4 (q4_0 and the Q4_1 `quant`) W1 decode >= 1.2x
llama.cpp on the same file and >= 2.5x our own bf16; Q8_0 W1 decode >= 1.2x llama.cpp; W2 on Q4
>= 1.5x llama.cpp's batched decode; TTFT 512 on Q4 <= llama.cpp's; peak RSS <= 1.3 x file + KV
cache + 300 MB. Exit status 0 when every target that the selected rows measure is met.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import resource
import subprocess
import sys
import time

from llama_cpp_run import add_llama_args

HF_FORMATS = {
    "gptq4": ("gptq", dict(bits=4, group=128, sym=True, act_order=True)),
    "w8a8": ("compressed-tensors", dict(scheme="W8A8")),
}
W4A8_ROWS = {"gptq4-w4a8": "gptq4"}  # row -> the HF_FORMATS checkpoint it runs under CPUINFER_INT4_W4A8=1
# GGUF files made from the --model file: config -> (GGUF file type, how it is made).
GGUF_MADE = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "gguf_bf16": "BF16", "mxfp4_moe": "MXFP4_MOE"}
BY_LLAMA = ("Q4_K_M", "MXFP4_MOE")  # the types made by llama.cpp's own quantizer (the others by gguf-py's)
GGUF_CONFIGS = ("quant", *GGUF_MADE)  # the configurations that run from a GGUF file kept quantized
# llama_ftype of general.file_type
LLAMA_FTYPE = {"F32": 0, "Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "BF16": 32, "MXFP4_MOE": 38}
LLAMA_PIP = "the command in this script's docstring (or nox -s bench)"


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """bench_engine.prompts (random ids >= 1000), here too because bench_engine imports torch, which the
    llama.cpp venv does not have; `one` checks the two agree."""
    rng = random.Random(0)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(n)]


def rss_mb() -> float:
    """Peak resident set size of this process so far, in MB: VmHWM where there is one, because on Linux
    ru_maxrss carries over from the parent through fork + exec (a child of a parent that held the F32
    model reported the parent's 814 MB)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- model files, made once into --work-dir -------------------------------------------------------------


def _stem(path: str) -> str:
    return os.path.basename(path).removesuffix(".gguf")


def hf_checkpoint(config: str, gguf: str, work_dir: str) -> str:
    """The GGUF model as the HF checkpoint of an HF_FORMATS configuration (made once into work_dir)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.models.quant_checkpoints import hf_from_gguf, quantize_dir

    base = os.path.join(work_dir, _stem(gguf))
    hf, out = base + "-hf", f"{base}-{config}"
    if not os.path.isfile(os.path.join(hf, "config.json")):
        hf_from_gguf(gguf, hf)
    if not os.path.isfile(os.path.join(out, "config.json")):
        method, opts = HF_FORMATS[config]
        quantize_dir(hf, out, method, **opts)
    return out


def write_gguf(src: str, dst: str, qtype: str | None) -> None:
    """src's weights dequantized by the gguf package, written to dst with every metadata key of src:
    all tensors F32 when qtype is None, else every 2-D tensor quantized to qtype by gguf.quants.quantize
    (the token embedding to Q8_0, as in the bundled Q4_1 file, unless qtype is BF16) and the 1-D ones
    (norms) F32."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize, quantize

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):  # the writer's own
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    writer.add_file_type(LLAMA_FTYPE[qtype or "F32"])
    for t in reader.tensors:
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        if qtype is None or w.ndim < 2:
            writer.add_tensor(t.name, w)
            continue
        tt = GGMLQuantizationType["Q8_0" if t.name == "token_embd.weight" and qtype != "BF16" else qtype]
        writer.add_tensor(t.name, quantize(w, tt), raw_dtype=tt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_file(config: str, src: str, work_dir: str, llama_python: str | None) -> str:
    """The GGUF file of a GGUF_MADE configuration (made once into work_dir, see the module docstring)."""
    os.makedirs(work_dir, exist_ok=True)
    base = os.path.join(work_dir, _stem(src))
    qtype = GGUF_MADE[config]
    out = f"{base}-{qtype}.gguf"
    if os.path.isfile(out):
        return out
    tmp = out + ".part"
    t = time.perf_counter()
    if qtype in BY_LLAMA:
        f32 = f"{base}-F32.gguf"
        if not os.path.isfile(f32):
            write_gguf(src, f32 + ".part", None)
            os.replace(f32 + ".part", f32)
        if llama_python is None:
            raise RuntimeError(
                f"{config} is made by llama.cpp's quantizer, which needs llama-cpp-python: install it with {LLAMA_PIP}"
            )
        r = subprocess.run(
            [llama_python, __file__, "--llama-quantize", f32, tmp, qtype], capture_output=True, text=True
        )
        if r.returncode != 0:
            raise RuntimeError(f"llama.cpp's quantizer failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    else:
        write_gguf(src, tmp, qtype)
    os.replace(tmp, out)
    print(f"made {out} ({os.path.getsize(out) / 2**20:.0f} MB) in {time.perf_counter() - t:.0f}s", flush=True)
    return out


# --- one row, in its own process --------------------------------------------------------------------------


def one(config: str, model: str, args) -> dict:
    """Measure one cpuinfer configuration in this process."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if config == "bf16":
        os.environ["CPUINFER_GGUF_DEQUANTIZE"] = "1"
    else:
        os.environ.pop("CPUINFER_GGUF_DEQUANTIZE", None)
    if config in W4A8_ROWS:
        os.environ["CPUINFER_INT4_W4A8"] = "1"
    else:
        os.environ.pop("CPUINFER_INT4_W4A8", None)
    import torch
    from bench_engine import bench_engine
    from bench_engine import prompts as engine_prompts

    assert engine_prompts(2, 8, 49152) == prompts(2, 8, 49152), "bench_engine.prompts changed: update prompts()"
    a = argparse.Namespace(
        input_len=args.input_len,
        output_len=args.output_len,
        long_input_len=args.long_input_len,
        batch=args.batch,
        repeat=args.repeat,
    )
    # peak_rss_mb as rss_mb() measures it (bench_engine's ru_maxrss may be the parent's peak, see rss_mb)
    return dict(bench_engine(model, a), threads=torch.get_num_threads(), peak_rss_mb=rss_mb())


def llama_quantize(src: str, dst: str, qtype: str) -> None:
    """llama.cpp's own quantizer (llama-quantize's library call) from src to dst."""
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = LLAMA_FTYPE[qtype]
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {dst}, {qtype}) returned {rc}")


def one_llama(model_path: str, args) -> dict:
    """The same measurements with llama.cpp (llama-cpp-python's low-level API) in this process."""
    from llama_cpp_run import Llama

    llama = Llama(model_path, args.threads)
    vocab = llama.vocab
    # W1 and the long-prompt TTFT: one sequence.
    n_ctx = max(args.input_len + args.output_len, args.long_input_len, 16 + args.output_len) + 256
    n_batch = max(args.input_len, args.long_input_len, 512)
    ctx = llama.context(n_ctx, n_batch, 1)
    batch, view = llama.make_batch(n_batch, 1)
    llama.generate(ctx, batch, view, prompts(1, 16, vocab), args.output_len)  # warm-up, as bench_engine
    total, prefill = llama.generate(ctx, batch, view, prompts(1, args.input_len, vocab), args.output_len)
    _, long_prefill = llama.generate(ctx, batch, view, prompts(1, args.long_input_len, vocab), 1)
    llama.free(batch, ctx)
    # W2: `batch` sequences, each with a KV stream of its own (the default, kv_unified off).
    per_seq = -(-(args.input_len + args.output_len) // 256) * 256
    ctx = llama.context(args.batch * per_seq, args.batch * args.input_len, args.batch)
    batch, view = llama.make_batch(args.batch * args.input_len, args.batch)
    ttotal, _ = llama.generate(ctx, batch, view, prompts(args.batch, args.input_len, vocab), args.output_len)
    llama.free(batch, ctx)
    weights = llama.L.llama_model_size(llama.model)
    info = llama.L.llama_print_system_info().decode().strip()
    llama.close()
    return dict(
        load=llama.load,
        latency=total,
        ttft=prefill,
        ttft_long=long_prefill,
        decode_tps=(args.output_len - 1) / (total - prefill),
        throughput=args.batch * args.output_len / ttotal,
        weights_mb=weights / 2**20,
        kv_mb=float("nan"),
        peak_rss_mb=rss_mb(),
        threads=args.threads,
        system_info=info,
    )


def gguf_type(path: str) -> str:
    """The file type a GGUF file declares (general.file_type): Q4_1, Q8_0, Q4_K_M, ..."""
    from gguf import GGUFReader, LlamaFileType

    field = GGUFReader(path).fields.get("general.file_type")
    return "?" if field is None else LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")


# --- the run ----------------------------------------------------------------------------------------------


def find_llama_python(arg: str | None) -> tuple[str | None, str]:
    """The interpreter that imports llama_cpp (the tests' rule: arg, $CPUINFER_LLAMA_PYTHON, else this one), or
    None and why not."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.models.llama_cpp_convert import llama_python

    py = llama_python(arg)
    if py is None:
        tried = ", ".join(p for p in (arg, os.environ.get("CPUINFER_LLAMA_PYTHON"), sys.executable) if p)
        return None, f"no interpreter imports llama_cpp (tried {tried}); install it with {LLAMA_PIP}"
    return py, ""


def run_row(python: str, row: str, path: str, args, env: dict) -> dict:
    """One row in a child process; its last stdout line is the JSON result."""
    cmd = [
        python,
        os.path.abspath(__file__),
        "--one",
        row,
        "--model",
        path,
        "--threads",
        str(args.threads),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--long-input-len",
        str(args.long_input_len),
        "--batch",
        str(args.batch),
        "--repeat",
        str(args.repeat),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode == -11 and row.startswith("llama:") and "amx" in r.stderr:
        raise RuntimeError(
            f"row {row}: llama.cpp segfaulted (with AMX buffers; GCC 12 builds of ggml's AMX code do): "
            f"rebuild it with clang: {LLAMA_PIP}"
        )
    if r.returncode != 0:
        raise RuntimeError(f"row {row} failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if row.startswith("llama:"):  # where llama.cpp put the weights (CPU, CPU_REPACK, AMX buffers), from its log
        log = r.stderr.splitlines()
        res["buffers"] = [line.split(":", 1)[-1].strip() for line in log if "model buffer size" in line]
    return res


def main() -> int:
    """Make the files, run every row in a subprocess, print the table and the target ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2 Q4_1)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--llama-quantize", nargs=3, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kv-space", default="0.5", help="VLLM_CPU_KVCACHE_SPACE for each run (GiB)")
    ap.add_argument(
        "--configs",
        default="bf16,quant,q8_0,q4_0,q4_k_m,gptq4,gptq4-w4a8,w8a8",
        help="comma-separated rows; each GGUF one (quant, q8_0, q4_0, q4_k_m) also gets a llama.cpp "
        "row with --llama; `llama:<config>` names a llama.cpp row alone",
    )
    add_llama_args(ap, "llama.cpp rows on the same GGUF files")
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines (default 2)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--long-input-len", type=int, default=512, help="prompt length of the TTFT row")
    ap.add_argument("--batch", type=int, default=32, help="prompts at once in W2")
    ap.add_argument("--repeat", type=int, default=3, help="prompts per TTFT figure of our rows (bench_engine's)")
    ap.add_argument(
        "--work-dir",
        default=os.path.join(os.path.expanduser("~"), ".cache", "cpuinfer-bench"),
        help="where the GGUF files and the gptq4 / w8a8 checkpoints are made (once)",
    )
    args, _ = ap.parse_known_args()  # nox passes its posargs to every benchmark
    if args.llama_quantize:
        llama_quantize(*args.llama_quantize)
        return 0
    if args.one and args.one.startswith("llama:"):
        print(json.dumps(one_llama(args.model, args)))
        return 0
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_space)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) != args.threads:  # else our default binding (one thread per physical core) is already right
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus[: args.threads])))
    if args.one:
        print(json.dumps(one(args.one, args.model, args)))
        return 0
    if args.model:  # the llama.cpp rows and the files need no cpuinfer in this process
        src = args.model
    else:
        from cpuinfer.config import default_model_path

        src = default_model_path()
    load = os.getloadavg()[0]
    if load > 0.5:  # llama.cpp's spinning thread pool loses up to 6x on a busy 2-core machine (cpuinfer less)
        print(
            f"warning: load average {load:.1f} before the run; the numbers (llama.cpp's most) need a quiet machine",
            file=sys.stderr,
        )
    rows = []
    for config in args.configs.split(","):
        rows.append(config)
        if args.llama and config in GGUF_CONFIGS:
            rows.append(f"llama:{config}")
    llama_python, why = (None, "--no-llama")
    if any(r.startswith("llama:") or GGUF_MADE.get(r) in BY_LLAMA for r in rows):
        llama_python, why = find_llama_python(args.llama_python)
    paths, failed = {}, {}
    for row in rows:
        config = row.removeprefix("llama:")
        try:
            if config not in paths:
                paths[config] = (
                    hf_checkpoint(W4A8_ROWS.get(config, config), src, args.work_dir)
                    if config in HF_FORMATS or config in W4A8_ROWS
                    else gguf_file(config, src, args.work_dir, llama_python)
                    if config in GGUF_MADE
                    else src
                )
        except Exception as e:  # noqa: BLE001 - a file that cannot be made fails its rows, not the run
            failed[row] = f"{type(e).__name__}: {e}"
    results = {}
    for row in rows:
        config = row.removeprefix("llama:")
        if row in failed or config in failed:
            continue
        if row.startswith("llama:") and llama_python is None:
            failed[row] = why
            continue
        python = llama_python if row.startswith("llama:") else sys.executable
        try:
            results[row] = run_row(python, row, paths[config], args, dict(os.environ))
        except Exception as e:  # noqa: BLE001
            failed[row] = str(e)
        print(f"{row}: {json.dumps(results.get(row))}", file=sys.stderr, flush=True)

    size_mb = {c: os.path.getsize(p) / 2**20 for c, p in paths.items() if os.path.isfile(p)}
    types = {c: gguf_type(p) if p.endswith(".gguf") else c for c, p in paths.items()}
    types["bf16"] = "BF16"
    print(f"load average before the run {load:.2f}; {os.cpu_count()} CPUs")
    print(
        f"model {os.path.basename(src)} ({size_mb.get('quant', os.path.getsize(src) / 2**20):.0f} MB); "
        f"W1 = 1 x {args.input_len} in, {args.output_len} out; TTFT of {args.long_input_len} tokens; "
        f"W2 = {args.batch} x {args.input_len} in, {args.output_len} out"
    )
    ttft = f"TTFT {args.long_input_len} ms"
    print(
        f"{'row':<17}{'file':>10}{'file MB':>9}{'threads':>8}{'W1 tok/s':>10}{ttft:>13}{'W2 tok/s':>10}"
        f"{'weights MB':>12}{'RSS MB':>9}"
    )
    for row, r in results.items():
        config = row.removeprefix("llama:")
        mb = f"{size_mb[config]:.0f}" if config in size_mb else ""
        print(
            f"{row:<17}{types.get(config, ''):>10}{mb:>9}{r['threads']:>8}{r['decode_tps']:>10.1f}"
            f"{r['ttft_long'] * 1000:>13.0f}{r['throughput']:>10.1f}{r['weights_mb']:>12.0f}"
            f"{r['peak_rss_mb']:>9.0f}"
        )
    for row, why_failed in failed.items():
        print(f"{row:<17}not measured: {why_failed}")
    info = next((r["system_info"] for r in results.values() if "system_info" in r), None)
    if info:
        print(f"llama.cpp: {info}")
    for row, r in results.items():
        if r.get("buffers"):
            print(f"{row} weights: {'; '.join(r['buffers'])}")

    checks = []  # (description, ratio, target, met)

    def ratio(label: str, num: float, den: float, target: float, higher: bool) -> None:
        x = num / den
        checks.append((label, x, target, x >= target if higher else x <= target))

    b = results.get("bf16")
    for config in GGUF_CONFIGS:
        ours, ref = results.get(config), results.get(f"llama:{config}")
        if not ours:
            continue
        # Q4 targets for the Q4_0 / Q4_1 files: the made q4_0, and `quant` when it is the bundled Q4_1.
        is_q4 = types[config] in ("Q4_0", "Q4_1")
        if ref and config in ("q4_k_m", "mxfp4_moe"):
            print(
                f"{config} / llama.cpp (no target): W1 decode {ours['decode_tps'] / ref['decode_tps']:.2f}x, "
                f"TTFT {ours['ttft_long'] / ref['ttft_long']:.2f}x, "
                f"W2 {ours['throughput'] / ref['throughput']:.2f}x"
            )
        elif ref:
            ratio(f"{config} W1 decode / llama.cpp", ours["decode_tps"], ref["decode_tps"], 1.2, True)
        if ref and is_q4:
            ratio(f"{config} W2 / llama.cpp batched", ours["throughput"], ref["throughput"], 1.5, True)
            ratio(
                f"{config} TTFT {args.long_input_len} / llama.cpp",
                ours["ttft_long"],
                ref["ttft_long"],
                1.0,
                False,
            )
        if b and is_q4:
            ratio(f"{config} W1 decode / our bf16", ours["decode_tps"], b["decode_tps"], 2.5, True)
        budget = 1.3 * size_mb[config] + ours["kv_mb"] + 300
        checks.append(
            (
                f"{config} peak RSS MB (1.3 x file + KV {ours['kv_mb']:.0f} + 300)",
                ours["peak_rss_mb"],
                budget,
                ours["peak_rss_mb"] <= budget,
            )
        )
    if b:
        for config in (*GGUF_CONFIGS, *HF_FORMATS):
            r = results.get(config)
            if r:
                print(
                    f"{config} / bf16 (no target): W1 decode {r['decode_tps'] / b['decode_tps']:.2f}x, "
                    f"TTFT {r['ttft_long'] / b['ttft_long']:.2f}x, W2 {r['throughput'] / b['throughput']:.2f}x"
                )
    for a16, a8 in ((w, r) for r, w in W4A8_ROWS.items()):
        x, y = results.get(a16), results.get(a8)
        if x and y:
            print(
                f"{a16} (16-bit activations) / {a8} (int8, no target): W1 decode "
                f"{x['decode_tps'] / y['decode_tps']:.2f}x, TTFT {x['ttft_long'] / y['ttft_long']:.2f}x, "
                f"W2 {x['throughput'] / y['throughput']:.2f}x"
            )
    for label, x, target, met in checks:
        rel = "<=" if "TTFT" in label or "RSS" in label else ">="
        value = f"{x:.0f}" if "RSS" in label else f"{x:.2f}x"
        target_s = f"{target:.0f}" if "RSS" in label else f"{target:g}"
        print(f"{label:<52}{value:>8}  target {rel} {target_s:<6} {'met' if met else 'MISSED'}")
    return 0 if all(c[3] for c in checks) and not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
