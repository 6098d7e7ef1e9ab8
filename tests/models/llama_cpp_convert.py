"""llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py, vendored in the llama-cpp-python sdist).

The sdist is fetched from the package index once (pip download) and unpacked into a cache folder. The
converter runs in a subprocess with its vendored gguf-py first on the path. Tiny random checkpoints have no
tokenizer, so the driver replaces the converter's vocabulary writers with a byte-level placeholder vocabulary
of the model's size: everything else (tensor names, the 3-D expert stacks, llama's Q/K row permutation, the
metadata, Q8_0 quantization) is llama.cpp's code.
"""

from __future__ import annotations

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
    w.add_token_list([f"<{i}>" for i in range(n)])
    w.add_token_types([1] * n)
    w.add_token_merges([])
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
