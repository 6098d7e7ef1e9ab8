"""A small, fast GGUF reader: metadata key/values, tensor infos, and memory-mapped tensor bytes.

gguf-py's GGUFReader builds a numpy view per metadata element, which takes minutes on a 262k-token
vocabulary (Gemma 3); this parses the header with struct in one pass and maps the data section once.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass

import numpy as np

from .errors import ModelLoadError

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# The least bytes one item of each kind takes in the file: counts are checked against the bytes left before
# anything is allocated, so a count of 2**60 is an error, not a 2**60-element list.
_MIN_ITEM_BYTES = {**{t: struct.calcsize(f) for t, f in _SCALAR.items()}, _STRING: 8, _ARRAY: 12}
MAX_ARRAY_DEPTH = 4  # arrays of arrays: llama.cpp reads none; gguf-py writes them; no model of ours uses them
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 20  # llama.cpp asks only for a power of two; real files use 32 (the default) or 64


@dataclass
class TensorInfo:
    """One tensor: GGUF name, torch-order shape, ggml type id and its raw bytes (a view into the mapped file)."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    data: np.ndarray  # uint8


class GGUFReader:
    """Parse a GGUF file's header; tensors' bytes stay in the (read-only) memory map until used."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # empty file
                raise ModelLoadError(f"{path} is not a GGUF file (it is empty)") from e
        buf = self._map
        if buf[:4] != b"GGUF":
            raise ModelLoadError(
                f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r}); "
                "pass a .gguf file or a Hugging Face model directory"
            )
        try:
            self._parse(memoryview(buf))
        except ModelLoadError:
            raise
        except (struct.error, IndexError, UnicodeDecodeError, ValueError, OverflowError) as e:
            raise ModelLoadError(
                f"{path}: GGUF header is truncated or corrupt ({type(e).__name__}: {e}); "
                "re-download or re-convert the file"
            ) from e

    def _parse(self, buf: memoryview) -> None:
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        self.pos = 24
        self._check_count(n_kv, 8 + 4, "metadata key/value pairs", "the header")
        self._check_count(n_tensors, 8 + 4 + 8 + 4 + 8, "tensor infos", "the header")
        self.fields: dict = {}
        for _ in range(n_kv):
            key = self._str(buf)
            (vtype,) = struct.unpack_from("<I", buf, self.pos)
            self.pos += 4
            if key in self.fields:
                raise ModelLoadError(f"{self.path}: GGUF metadata key {key!r} appears twice; the file is corrupt")
            self.fields[key] = self._value(buf, vtype, key)
        infos = []
        names = set()
        for _ in range(n_tensors):
            name = self._str(buf)
            (n_dims,) = struct.unpack_from("<I", buf, self.pos)
            if not 1 <= n_dims <= MAX_DIMS:
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} has {n_dims} dimensions; GGUF allows 1 to "
                    f"{MAX_DIMS}. The file is corrupt: re-download or re-convert it"
                )
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self.pos + 4)
            type_id, offset = struct.unpack_from("<IQ", buf, self.pos + 4 + 8 * n_dims)
            self.pos += 4 + 8 * n_dims + 12
            if name in names:
                raise ModelLoadError(f"{self.path}: tensor {name!r} appears twice; the file is corrupt")
            names.add(name)
            infos.append((name, tuple(int(d) for d in reversed(dims)), type_id, offset))
        align = self._alignment()
        data_start = -(-self.pos // align) * align
        self.tensors: list[TensorInfo] = []
        for name, shape, type_id, offset in infos:
            start, nbytes = data_start + offset, self._tensor_nbytes(name, shape, type_id)
            if start + nbytes > len(buf):
                raise ModelLoadError(
                    f"{self.path}: tensor {name!r} runs past the end of the file "
                    f"({start + nbytes} > {len(buf)} bytes); the file is truncated"
                )
            data = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=start)
            self.tensors.append(TensorInfo(name, shape, type_id, data))

    def _alignment(self) -> int:
        align = self.fields.get("general.alignment", 32)
        if (
            isinstance(align, bool)
            or not isinstance(align, int)
            or not 1 <= align <= MAX_ALIGNMENT
            or align & (align - 1)
        ):
            raise ModelLoadError(
                f"{self.path}: general.alignment = {align!r} is not a power of two between 1 and "
                f"{MAX_ALIGNMENT}; the file is corrupt: re-download or re-convert it"
            )
        return align

    def _tensor_nbytes(self, name: str, shape: tuple[int, ...], type_id: int) -> int:
        """Bytes of one tensor, in Python ints (numpy's int64 products wrap silently: [2**32, 2**32] would be 0)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
        except (ValueError, KeyError):
            raise ModelLoadError(f"{self.path}: tensor {name!r} has unknown GGUF type id {type_id}") from None
        if any(d < 1 for d in shape):
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} has shape {list(shape)} with an empty dimension; "
                "the file is corrupt: re-download or re-convert it"
            )
        if shape[-1] % block:  # ggml's rule: a row holds whole quantization blocks
            raise ModelLoadError(
                f"{self.path}: tensor {name!r} has rows of {shape[-1]} elements, not a multiple of "
                f"its type's block of {block}; the file is corrupt: re-download or re-convert it"
            )
        return math.prod(shape) // block * type_size

    def _check_count(self, count: int, item_bytes: int, what: str, where: str) -> None:
        left = len(self._map) - self.pos
        if count * item_bytes > left:
            raise ModelLoadError(
                f"{self.path}: {where} declares {count} {what}, more than the {left} bytes left in "
                "the file can hold; the file is truncated or corrupt: re-download or re-convert it"
            )

    def _str(self, buf: memoryview, key: str = "a string") -> str:
        (n,) = struct.unpack_from("<Q", buf, self.pos)
        self.pos += 8
        self._check_count(n, 1, "bytes", f"{key}")
        start = self.pos
        self.pos += n
        return bytes(buf[start : self.pos]).decode("utf-8", errors="replace")

    def _str_array(self, count: int, key: str) -> list[str]:
        """`count` strings from self.pos: `_str` in one tight loop, for a vocabulary's 49k-262k strings (SmolLM2's
        whole header, 98k tokens and merges: 0.27-0.64 s with `_str` per string, 0.12-0.32 s this way)."""
        raw, pos, size = self._map, self.pos, len(self._map)  # an mmap slice is bytes: one copy, not two
        unpack = _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            (n,) = unpack(raw, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos
                self._check_count(n, 1, "bytes", f"metadata {key!r}")  # raises, naming the key
            append(raw[pos : pos + n].decode("utf-8", errors="replace"))
            pos += n
        self.pos = pos
        return out

    def _value(self, buf: memoryview, vtype: int, key: str, depth: int = 0):
        if vtype == _STRING:
            return self._str(buf, f"metadata {key!r}")
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise ModelLoadError(
                    f"{self.path}: metadata {key!r} nests arrays more than {MAX_ARRAY_DEPTH} deep; "
                    "no model needs that: the file is corrupt or hostile"
                )
            itype, count = struct.unpack_from("<IQ", buf, self.pos)
            self.pos += 12
            if itype not in _MIN_ITEM_BYTES:
                raise ModelLoadError(
                    f"{self.path}: metadata {key!r} is an array of unknown value type {itype}; "
                    "the file is corrupt, or written by a newer GGUF version"
                )
            self._check_count(count, _MIN_ITEM_BYTES[itype], "array items", f"metadata {key!r}")
            if itype == _STRING:
                return self._str_array(count, key)
            if itype in _NUMPY:
                arr = np.frombuffer(buf, dtype=_NUMPY[itype], count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self._value(buf, itype, key, depth + 1) for _ in range(count)]
        fmt = _SCALAR.get(vtype)
        if fmt is None:
            raise ModelLoadError(
                f"{self.path}: metadata {key!r} has unknown value type {vtype}; "
                "the file is corrupt, or written by a newer GGUF version"
            )
        (value,) = struct.unpack_from(fmt, buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value
