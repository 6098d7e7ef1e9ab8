"""GGUF block quants rewritten as QuantWeight (values, per-group scale and zero point or minimum).

Each ggml block type is unpacked with numpy into integer values u and the parameters of its
groups, exactly as ggml's own dequantization reads them (the `gguf` package's quants.py is the
reference the tests compare against):

| type | values | group | form                               | exact |
|------|--------|-------|------------------------------------|-------|
| Q4_0 | 4 bit  | 32    | d * (u - 8)                        | yes   |
| Q4_1 | 4 bit  | 32    | d * u + m                          | yes   |
| Q5_0 | 5 bit  | 32    | d * (u - 16)                       | yes   |
| Q5_1 | 5 bit  | 32    | d * u + m                          | yes   |
| Q8_0 | 8 bit  | 32    | d * (u - 128)                      | yes   |
| Q4_K | 4 bit  | 32    | (d * sc) * u - dmin * mn           | scales rounded to f16 |
| Q5_K | 5 bit  | 32    | (d * sc) * u - dmin * mn           | scales rounded to f16 |
| Q6_K | 6 bit  | 16    | (d * sc) * (u - 32)                | scales rounded to f16 |
| MXFP4 | 4-bit E2M1 code | 32 | 2^(e - 128) * kvalues[code] (QuantWeight's fp4: as in the file) | yes |

K-quants keep two levels of scales (an f16 per 256 values times a 6- or 8-bit integer per
sub-block); we store their product per group as f16, a relative error of at most 2^-11 of that
group's scale, eight times below the int8 activation quantization the kernels apply anyway.
Values keep their width (5- and 6-bit ones as a nibble plus bits in a high-bit plane,
csrc/common/quant_tile.h), so a tensor takes bits + 16 / group (+ 8 / group for zero points or
16 / group for minimums) bits per weight: 5.75-6 for the 5-bit types against 5.5-6 in the file,
7.5 for Q6_K against 6.56 (its group scales are f16 here, int8 there); MXFP4 4.25, as in the file.
"""

from __future__ import annotations

import numpy as np

from .weight import QuantWeight, mxfp4, scale16

KEPT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
_BLOCK_BYTES = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "MXFP4": (32, 17),
}


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per row as float16, one column."""
    return np.ascontiguousarray(b).view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-value nibble order: the low nibbles first, then the high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits (a little-endian uint32 per block), one per value."""
    bits = np.ascontiguousarray(qh).view("<u4")
    return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 8 six-bit scales and minimums per super-block, from their 12 packed bytes."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def unpack(type_name: str, data: np.ndarray, rows: int, cols: int, row_order: np.ndarray | None = None) -> QuantWeight:
    """A GGUF tensor's raw blocks (uint8, rows x bytes) as a QuantWeight [rows, cols], rows taken in row_order."""
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"GGUF type {type_name} is not kept quantized")
    per, size = _BLOCK_BYTES[type_name]
    if cols % per:
        raise ValueError(f"{type_name} rows of {cols} values are not whole blocks of {per}")
    b = np.ascontiguousarray(data).reshape(-1, size)
    if b.shape[0] != rows * cols // per:
        raise ValueError(f"{type_name} data holds {b.shape[0]} blocks, the shape needs {rows * cols // per}")
    z = m = None
    if type_name == "Q4_0":
        u, d, z, bits, group = _nibbles(b[:, 2:]), _f16(b[:, :2]), 8, 4, 32
    elif type_name == "Q4_1":
        u, d, m, bits, group = _nibbles(b[:, 4:]), _f16(b[:, :2]), _f16(b[:, 2:4]), 4, 32
    elif type_name == "Q5_0":
        u, d, z, bits, group = _nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6]) << 4), _f16(b[:, :2]), 16, 5, 32
    elif type_name == "Q5_1":
        u = _nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8]) << 4)
        d, m, bits, group = _f16(b[:, :2]), _f16(b[:, 2:4]), 5, 32
    elif type_name == "MXFP4":  # e8m0 exponent byte, 16 bytes of E2M1 codes: kept as they are (QuantWeight's fp4)
        codes, e = _nibbles(b[:, 1:]).reshape(rows, cols), b[:, 0].reshape(rows, cols // 32)
        if row_order is not None:
            codes, e = codes[row_order], e[row_order]
        w = mxfp4(codes, e, type_name)
        if w is None:
            raise ValueError("an MXFP4 exponent is outside 2..254 (2^-126 .. 2^126), where the kernels are exact")
        return w
    elif type_name == "Q8_0":
        u = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        d, z, bits, group = _f16(b[:, :2]), 128, 8, 32
    elif type_name in ("Q4_K", "Q5_K"):
        n = b.shape[0]
        dd = _f16(b[:, :2]).astype(np.float32)
        dmin = _f16(b[:, 2:4]).astype(np.float32)
        sc, mn = _k_scales(b[:, 4:16])
        qs = b[:, -128:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        u = (qs & 15).reshape(n, 8, 32)
        bits = 4
        if type_name == "Q5_K":
            qh = b[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            u = u | ((qh & 1) << 4)
            bits = 5
        u = u.reshape(n, 256)
        d = scale16(dd * sc.astype(np.float32))
        m = scale16(-(dmin * mn.astype(np.float32)))
        group = 32
    else:  # Q6_K
        n = b.shape[0]
        ql = b[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = b[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        u = ((ql & 15).reshape(n, 8, 32) | ((qh & 3).reshape(n, 8, 32) << 4)).reshape(n, 256)
        sc = b[:, 192:208].view(np.int8).astype(np.float32)
        d = scale16(_f16(b[:, 208:210]).astype(np.float32) * sc)
        z, bits, group = 32, 6, 16
    groups = cols // group
    u = u.reshape(rows, cols)
    d = d.reshape(rows, groups)
    zs = None if z is None else np.full((rows, groups), z, dtype=np.uint8)
    ms = None if m is None else m.reshape(rows, groups)
    if row_order is not None:
        u, d = u[row_order], d[row_order]
        zs = None if zs is None else zs[row_order]
        ms = None if ms is None else ms[row_order]
    return QuantWeight.pack(u, d, zs, ms, bits=bits, group=group, kind=type_name)
