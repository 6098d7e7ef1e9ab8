"""llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py, vendored in the llama-cpp-python sdist).

The sdist is fetched from the package index once (pip download) and unpacked into a cache folder. The
converter runs in a subprocess with its vendored gguf-py first on the path. Tiny random checkpoints have no
tokenizer, so the driver replaces the converter's vocabulary writers with a placeholder vocabulary of the
model's size (with one merge: llama.cpp's loader refuses a BPE vocabulary without any): everything else
(tensor names, the 3-D expert stacks, llama's Q/K row permutation, the metadata, Q8_0 quantization) is
llama.cpp's code.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
CACHE = Path(os.environ.get("CPUINFER_TEST_CACHE", Path.home() / ".cache" / "cpuinfer-tests"))

DRIVER = r"""
import sys
root = sys.argv[1]
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base


def placeholder_vocab(self, *args, **kwargs):
    n = int(self.hparams["vocab_size"])
    w = self.gguf_writer
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    # One real merge ("a" + "b" -> "ab", the last three tokens): llama.cpp refuses a BPE vocabulary without merges.
    w.add_token_list([f"<{i}>" for i in range(n - 3)] + ["a", "b", "ab"])
    w.add_token_types([1] * n)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


for name in ("_set_vocab_gpt2", "_set_vocab_sentencepiece", "_set_vocab_llama_hf", "_set_vocab_qwen"):
    setattr(base.TextModel, name, placeholder_vocab)
import convert_hf_to_gguf

sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def llama_cpp_source() -> Path:
    """The vendored llama.cpp tree of the llama-cpp-python sdist (downloaded and unpacked once)."""
    version = SDIST.split("==")[1]
    tree = CACHE / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (tree / "convert_hf_to_gguf.py").is_file():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", SDIST, "-d", tmp],
            check=True,
            timeout=600,
        )
        (archive,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(CACHE, filter="data")
    return tree


def llama_python(first: str | None = None) -> str | None:
    """An interpreter that imports llama_cpp: first (a benchmark's --llama-python), CPUINFER_LLAMA_PYTHON, else this
    one; None if none does (a path that is no interpreter counts as one without llama_cpp)."""
    for py in (first, os.environ.get("CPUINFER_LLAMA_PYTHON"), sys.executable):
        try:
            if py and subprocess.run([py, "-c", "import llama_cpp"], capture_output=True).returncode == 0:
                return py
        except OSError:
            continue
    return None


def llama_quantize(py: str, src: str, dst: str, ftype: int = 15) -> str:
    """dst: src quantized by llama.cpp's own quantizer (llama_model_quantize in the interpreter py) to the
    llama_ftype ftype (15: Q4_K_M)."""
    quantize = (
        "import ctypes, sys, llama_cpp as L; p = L.llama_model_quantize_default_params(); p.ftype = int(sys.argv[3]); "
        "sys.exit(L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))"
    )
    subprocess.run([py, "-c", quantize, src, dst, str(ftype)], check=True, capture_output=True, timeout=600)
    return dst


def convert(hf_dir: str, out: str, outtype: str = "f32") -> str:
    """Write hf_dir as a GGUF file at out with llama.cpp's converter (outtype f32, f16, bf16 or q8_0)."""
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER, str(llama_cpp_source()), hf_dir, "--outfile", out, "--outtype", outtype],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


# Byte layout of the K-quant blocks (ggml's block_q4_K, block_q5_K, block_q6_K): (bytes per block of 256,
# [(offset of an f16 scale, value)]). Random bytes elsewhere are valid blocks (6-bit scales, quants, high bits).
_K_BLOCKS = {
    "Q4_K": (144, [(0, 1e-4), (2, 2e-4)]),
    "Q5_K": (176, [(0, 5e-5), (2, 1e-4)]),
    "Q6_K": (210, [(208, 1e-5)]),
}


@functools.lru_cache(maxsize=4)
def _gguf_py_reader(path: str, mtime: float):  # noqa: ARG001 - mtime: cache key
    """gguf-py's reader of path (a second to parse a 30k-token vocabulary: tests rewrite one file several ways)."""
    import gguf

    return gguf.GGUFReader(path)


def rewrite_tensors(src: str, dst: str, change=None, fields: dict | None = None) -> str:
    """A copy of the GGUF file src (every metadata key) whose tensors are change(gguf, tensor): (data, type) to
    write instead, None to keep the tensor as it is, False to leave it out. fields: metadata values to write
    instead (same type; None leaves the key out)."""
    sys.path.insert(0, str(llama_cpp_source() / "gguf-py"))
    import gguf

    fields = fields or {}
    reader = _gguf_py_reader(src, os.path.getmtime(src))
    arch = gguf.Keys.General.ARCHITECTURE
    writer = gguf.GGUFWriter(dst, arch=fields.get(arch, reader.get_field(arch).contents()))
    for field in reader.fields.values():
        if field.name == arch or field.name.startswith("GGUF."):
            continue
        value = fields.get(field.name, field.contents())
        if value is None:
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    out = []
    for t in reader.tensors:
        new = change(gguf, t) if change else None
        if new is not False:
            out.append((t.name, *(new if new is not None else (t.data, t.tensor_type))))
    for name, data, qtype in out:
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def with_random_k_quant_experts(src: str, dst: str, qtype: str, seed: int = 0) -> str:
    """A copy of the GGUF file src whose expert stacks are random blocks of a K-quant type (gguf-py writes no
    K-quants, and this tests the format's layout, not a quantizer): every block valid, its scales small."""
    import numpy as np

    rng = np.random.default_rng(seed)
    size, scales = _K_BLOCKS[qtype]

    def change(gguf, t):
        if "_exps." not in t.name:
            return None
        shape = [int(d) for d in reversed(t.shape)]  # torch order [experts, out, in]
        blocks = rng.integers(0, 256, (int(np.prod(shape)) // 256, size), dtype=np.uint8)
        for offset, value in scales:
            blocks[:, offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
        return blocks.reshape(*shape[:-1], shape[-1] // 256 * size), gguf.GGMLQuantizationType[qtype]

    return rewrite_tensors(src, dst, change)


def with_quantized(src: str, dst: str, select, qtype: str = "Q8_0") -> str:
    """A copy of the GGUF file src whose tensors named so that select(name) is true gguf-py quantized to qtype (the
    code convert_hf_to_gguf.py's --outtype q8_0 runs)."""
    import numpy as np

    def change(gguf, t):
        if not select(t.name):
            return None
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])
        qt = gguf.GGMLQuantizationType[qtype]
        return gguf.quants.quantize(w, qt), qt

    return rewrite_tensors(src, dst, change)


def with_quantized_routers(src: str, dst: str, qtype: str = "Q8_0") -> str:
    """A copy of the GGUF file src whose routers (ffn_gate_inp) gguf-py quantized to qtype. llama.cpp's quantizer
    keeps them F32, but other tools quantize every 2-D tensor, and such files exist."""
    return with_quantized(src, dst, lambda name: name.endswith("ffn_gate_inp.weight"), qtype)
