"""Which quantization a checkpoint uses, and its quantized linear layers rewritten as QuantWeight.

The one place that knows the methods (`--quantization`, as vLLM names them): "gguf" (a .gguf
file, read by model_loader/gguf_file.py through gguf_blocks.py) and the Hugging Face formats,
declared by config.json's quantization_config.quant_method, each read by its module here:
gptq.py, awq.py, compressed_tensors.py. Every quantized linear layer reaches the models as a
QuantWeight under its plain `<prefix>.weight` name, so models need no per-format code.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from types import ModuleType

import torch

from .. import envs
from ..errors import ModelLoadError
from . import awq, compressed_tensors, gptq, mxfp4
from .linear_tensors import LinearTensors
from .weight import QuantWeight

logger = logging.getLogger(__name__)

HF_READERS: dict[str, ModuleType] = {
    "gptq": gptq,
    "awq": awq,
    "compressed-tensors": compressed_tensors,
    "mxfp4": mxfp4,  # gpt-oss's experts: stacks the model builder unstacks (mxfp4.Mxfp4Stack)
}
METHODS = ("gguf", *HF_READERS)


def declared(config: dict, source: str) -> str | None:
    """The method config.json's quantization_config declares (None: not quantized); unknown ones refused."""
    qcfg = config.get("quantization_config")
    if qcfg is None:
        return None
    method = qcfg.get("quant_method") if isinstance(qcfg, dict) else None
    if method not in HF_READERS:
        raise ModelLoadError(
            f"{source}: quantization_config.quant_method {method!r} is not supported; cpuinfer "
            f"reads {', '.join(HF_READERS)} checkpoints (and GGUF files)"
        )
    return method


def resolve(requested: str | None, found: str | None, source: str) -> str | None:
    """The method to load with: the checkpoint's; --quantization, when given, must name it."""
    if requested is not None and requested not in METHODS:
        raise ModelLoadError(f"--quantization={requested!r} is not one of {', '.join(METHODS)}")
    if requested is not None and requested != found:
        has = f"is a {found} checkpoint" if found else "is not quantized"
        fix = f"pass --quantization={found} or drop the flag" if found else f"pass a {requested} checkpoint"
        raise ModelLoadError(
            f"--quantization={requested} but {source} {has}; {fix} (the method is read from the "
            "checkpoint when the flag is omitted)"
        )
    return found


def quantized_weights(
    method: str, config: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype, source: str
) -> dict[str, torch.Tensor | QuantWeight]:
    """tensors (as stored) with each quantized linear's tensors replaced by `<prefix>.weight`: a QuantWeight
    (or, in float32 runs, the reference mode, its float32 dequantization); other matrices in dtype."""
    reader = HF_READERS[method]
    s = reader.scheme(config["quantization_config"], source)
    if hasattr(reader, "rewrite"):  # stacked formats (MXFP4): the reader rewrites the stacks itself
        kinds = reader.rewrite(tensors, dtype, source)
        if not kinds:
            raise ModelLoadError(
                f"{source}: quantization_config says {method} but no tensor ends in {reader.MARKER}; the "
                "checkpoint is not quantized as its config says: re-download it"
            )
        _to_dtype(tensors, dtype)
        log_kinds(os.path.basename(os.path.normpath(source)), method, kinds, dtype)
        return tensors
    marker = "." + reader.MARKER
    prefixes = sorted(n[: -len(marker)] for n in tensors if n.endswith(marker))
    kinds: Counter = Counter()
    act16: set[bool] = set()  # the activation paths the layers take
    w4a8 = envs.INT4_W4A8.get()
    for prefix in prefixes:
        t = LinearTensors(prefix, tensors, source, method)
        try:
            w = reader.read(t, s)
        except ModelLoadError:
            raise
        except ValueError as e:  # QuantWeight.pack's checks: a value past its bits, a bad order
            raise ModelLoadError(f"{source}: {method} layer {prefix!r}: {e}") from None
        t.pop_all(reader.SUFFIXES)
        if w4a8 and w.bits == 4 and w.act16:  # the opt-in: 4-bit weight-only layers with int8 activations
            w.act16 = False
        tensors[f"{prefix}.weight"] = w if dtype != torch.float32 else w.dequantize(torch.float32)
        kinds[w.kind] += 1
        act16.add(w.act16)
    _to_dtype(tensors, dtype)
    if not prefixes:
        raise ModelLoadError(
            f"{source}: quantization_config says {method} but no tensor ends in {marker}; the "
            "checkpoint is not quantized as its config says: re-download it"
        )
    log_kinds(os.path.basename(os.path.normpath(source)), method, kinds, dtype, act16)
    return tensors


def _to_dtype(tensors: dict, dtype: torch.dtype) -> None:
    """The checkpoint's other matrices in the run dtype (norms and biases stay as stored)."""
    for name, v in tensors.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.is_floating_point():
            tensors[name] = v.to(dtype)


def log_kinds(name: str, method: str, kinds: Counter, dtype: torch.dtype, act16: set[bool] | None = None) -> None:
    """One load-log line: the format, and which kernel path its linear layers take."""
    counts = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    if dtype == torch.float32:
        logger.info(
            "%s: %s; %s linear layers dequantized to float32 (float32 runs are the reference mode)",
            name,
            method,
            counts,
        )
    else:
        paths = "; ".join(kernel_path(a, dtype) for a in sorted(act16 or {False}))
        logger.info("%s: %s; %s linear layers kept quantized (%s)", name, method, counts, paths)


def kernel_path(act16: bool = False, dtype: torch.dtype = torch.bfloat16) -> str:
    """The kernel quantized linear layers run on this CPU, e.g. 'int8 activations, integer kernels, avx512vnni tile'."""
    from .. import _C

    if act16:
        return f"16-bit activations, {_C.quant_wide_impl(str(dtype).removeprefix('torch.'))} tile"
    return f"int8 activations, integer kernels, {_C.quant_tile_impl()} tile"


def _activation_paths(method: str, s) -> set[bool]:
    """Which activation paths (act16 or not) a scheme's layers take, as the readers and the W4A8 opt-in set them."""
    w4a8 = envs.INT4_W4A8.get()
    if method in ("gptq", "awq"):
        return {not (w4a8 and getattr(s, "bits", 4) == 4)}
    if method == "compressed-tensors":
        return {ws.activations == "none" and not (w4a8 and ws.bits == 4) for _, ws in s.groups}
    return {False}


def describe(path: str) -> dict[str, str]:
    """For `cpuinfer info --model`: the checkpoint's method, how its linear layers are stored, and the kernel
    path they take in a bf16/f16 run (read from config.json or the GGUF header: no weights are loaded)."""
    if os.path.isdir(path):
        from ..model_loader.hf_dir import read_json

        config = read_json(os.path.join(path, "config.json"))
        method = declared(config, path)
        if method is None:
            return {"path": path, "quantization": "none", "linear layers": "dense", "kernel": "bf16/f16 GEMM"}
        s = HF_READERS[method].scheme(config["quantization_config"], path)
        kinds = [ws.kind for _, ws in s.groups] if method == "compressed-tensors" else [s.kind]
        kernel = "; ".join(kernel_path(a) for a in sorted(_activation_paths(method, s)))
        return {"path": path, "quantization": method, "linear layers": ", ".join(kinds), "kernel": kernel}
    from gguf import GGMLQuantizationType, GGUFReader

    from .gguf_blocks import KEPT_TYPES

    types = Counter(
        GGMLQuantizationType(t.tensor_type).name for t in GGUFReader(path).tensors if len(t.shape) in (2, 3)
    )
    kept = {k: n for k, n in types.items() if k in KEPT_TYPES}
    rest = {k: n for k, n in types.items() if k not in KEPT_TYPES}
    parts = [f"{n} {k}" for k, n in sorted(kept.items())] + [f"{n} {k} (dequantized)" for k, n in sorted(rest.items())]
    return {
        "path": path,
        "quantization": "gguf",
        "linear layers": ", ".join(parts),
        "kernel": kernel_path() if kept else "bf16/f16 GEMM",
    }
