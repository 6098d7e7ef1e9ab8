"""Per-dtype tolerances against a float32 torch reference.

Kernels compute in f32 and round once to the output dtype, so the error is
at most about one rounding step of that dtype (bf16: 8 bits of mantissa,
2^-8 relative; f16: 11 bits, 2^-11), plus f32 accumulation-order noise.
"""

import torch

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-2, rtol=8e-3),
    torch.float16: dict(atol=1e-3, rtol=1e-3),
}
DTYPES = list(TOL)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Compare in float32 with the tolerance of `dtype`."""
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype])
