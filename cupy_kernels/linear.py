"""Row-wise linear layer for a few rows (decode step, LM head), no cuBLAS.

Kernel: ``src_cu/linear.cu``. Tests: ``tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import itertools

import cupy
import numpy

from . import _build, _checks
from ._build import i32

_SRC = "linear.cu"
_WARPS = 8  # outputs per block (linear.cu)


def _name(c_type: str, out_type: str, vec: int, gelu: bool) -> str:
    return f"linear_rows_kernel<{c_type}, {out_type}, {vec}, {'true' if gelu else 'false'}>"


_build.declare(
    _SRC,
    [
        _name(c, o, v, g)
        for c, g in itertools.product(_build.CTYPES.values(), (False, True))
        for o in dict.fromkeys((c, "float"))
        for v in _build.vec_widths(c)
    ],
)


def linear(x, weight, bias=None, *, gelu: bool = False, out_dtype=None, out=None) -> cupy.ndarray:
    """``y = x @ weight.T + bias``, then GELU (tanh form) if ``gelu``.

    x: [B, K] contiguous; weight: [N, K] (out, in) contiguous; bias: [N] or None.
    float32 accumulation; each output's summation order is independent of B, so a row
    gives the same bits alone or in a batch. ``out_dtype`` may be float32 when x is
    half precision (logits). Meant for small B (decode); prefill uses cuBLAS.
    """
    x = _checks.float_array(x, "x", ndim=2)
    weight = _checks.float_array(weight, "weight", ndim=2)
    _checks.same_dtype(x, "x", weight=weight)
    B, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"weight has {weight.shape[1]} input features but x has {K}")
    if bias is not None:
        bias = _checks.float_array(bias, "bias", ndim=1)
        _checks.same_dtype(x, "x", bias=bias)
        _checks.check_shape(bias, "bias", (N,))
    out_dtype = numpy.dtype(x.dtype if out_dtype is None else out_dtype)
    if out_dtype not in (x.dtype, numpy.dtype(numpy.float32)):
        raise TypeError(f"out_dtype must be {x.dtype} or float32, got {out_dtype}")
    out = _checks.output(out, "out", (B, N), out_dtype)
    if B == 0 or N == 0:
        return out
    vec = _checks.vec_width(x.dtype, K, x, weight)
    kern = _build.kernel(_SRC, _name(_build.ctype(x.dtype), _build.ctype(out_dtype), vec, gelu))
    kern((_build.cdiv(N, _WARPS),), (_WARPS * 32,), (out, x, weight, 0 if bias is None else bias,
                                                     i32(B), i32(N), i32(K)))
    return out
