"""A small, fast GGUF reader: metadata key/values, tensor infos, and memory-mapped tensor bytes.

gguf-py's GGUFReader builds a numpy view per metadata element, which takes minutes on a 262k-token
vocabulary (Gemma 3); this parses the header with struct in one pass and maps the data section once.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

from .errors import ModelLoadError

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9


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
            raise ModelLoadError(f"{path} is not a GGUF file (bad magic {bytes(buf[:4])!r}); "
                                 "pass a .gguf file or a Hugging Face model directory")
        try:
            self._parse(memoryview(buf))
        except (struct.error, IndexError, UnicodeDecodeError, ValueError, OverflowError) as e:
            raise ModelLoadError(f"{path}: GGUF header is truncated or corrupt ({type(e).__name__}: {e}); "
                                 "re-download or re-convert the file") from e

    def _parse(self, buf: memoryview) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        self.pos = 24
        self.fields: dict = {}
        for _ in range(n_kv):
            key = self._str(buf)
            (vtype,) = struct.unpack_from("<I", buf, self.pos)
            self.pos += 4
            self.fields[key] = self._value(buf, vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._str(buf)
            (n_dims,) = struct.unpack_from("<I", buf, self.pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self.pos + 4)
            type_id, offset = struct.unpack_from("<IQ", buf, self.pos + 4 + 8 * n_dims)
            self.pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(d) for d in reversed(dims)), type_id, offset))
        align = int(self.fields.get("general.alignment", 32))
        data_start = -(-self.pos // align) * align
        self.tensors: list[TensorInfo] = []
        size = len(buf)
        for name, shape, type_id, offset in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise ModelLoadError(f"{self.path}: tensor {name!r} has unknown GGUF type id {type_id}") from None
            n = int(np.prod(shape)) if shape else 1
            nbytes = n // block * type_size
            start = data_start + offset
            if start + nbytes > size:
                raise ModelLoadError(f"{self.path}: tensor {name!r} runs past the end of the file "
                                     f"({start + nbytes} > {size} bytes); the file is truncated")
            data = np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=start)
            self.tensors.append(TensorInfo(name, shape, type_id, data))

    def _str(self, buf: memoryview) -> str:
        (n,) = struct.unpack_from("<Q", buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        if self.pos > len(buf):
            raise IndexError("string runs past the end of the file")
        return bytes(buf[start:self.pos]).decode("utf-8", errors="replace")

    def _value(self, buf: memoryview, vtype: int):
        if vtype == _STRING:
            return self._str(buf)
        if vtype == _ARRAY:
            itype, count = struct.unpack_from("<IQ", buf, self.pos)
            self.pos += 12
            if itype == _STRING:
                return [self._str(buf) for _ in range(count)]
            if itype in _NUMPY:
                arr = np.frombuffer(buf, dtype=_NUMPY[itype], count=count, offset=self.pos)
                self.pos += arr.nbytes
                return arr.tolist()
            return [self._value(buf, itype) for _ in range(count)]
        fmt = _SCALAR.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown metadata value type {vtype}")
        (value,) = struct.unpack_from(fmt, buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value
