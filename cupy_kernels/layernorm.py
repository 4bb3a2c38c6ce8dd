"""LayerNorm over the last axis, plain or fused with GPT-2's residual add.

Kernel: ``src_cu/layernorm.cu``. Tests: ``tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import itertools

import cupy

from . import _build, _checks
from ._build import f32, i32

_SRC = "layernorm.cu"


# Vectors per thread, loaded together (benchmarks/results/row_tuning-h200.json): 4 (float16
# 16384 x 4096: 74.9 us; 2: 95.4 us; 8: 108.1 us). With fewer rows than SMs 2 was faster
# (float16 8 x 1024: 4.93 us vs 6.08 us with 4), but the threads a row is spread over set
# its sums' order, and a row's bits must not depend on how many rows come with it (prompts
# prefilled together get the numbers they get alone), so u follows the columns alone; the
# 2 of few rows stays declared for benchmarks/row_tuning.py. The residual form loads 2 each
# of x and y (the same bytes in flight; 4 of each spilled at 1024 threads).
_U, _U_FEW_ROWS, _U_RESIDUAL = 4, 2, 2


def _name(c_type: str, vec: int, residual: bool, in_regs: bool, u: int = _U) -> str:
    return f"layernorm_kernel<{c_type}, {vec}, {str(residual).lower()}, {str(in_regs).lower()}, {u}>"


_build.declare(
    _SRC,
    [
        _name(c, v, r, g, u)
        for c, r, g in itertools.product(_build.CTYPES.values(), (False, True), (True, False))
        for v in _build.vec_widths(c)
        for u in ((_U_RESIDUAL,) if r else (_U, _U_FEW_ROWS) if g else (_U,))
    ],
)


def _launch(out, sum_out, x, y, bias, weight, b, eps, u: int | None = None, in_regs: bool | None = None):
    """``u`` / ``in_regs`` override the defaults for benchmarks/row_tuning.py."""
    C = x.shape[-1]
    rows = x.size // C
    vec = _checks.row_vec_width(x.dtype, out, sum_out, x, y)
    chunks = _build.cdiv(C, vec)
    if u is None:
        u = _U_RESIDUAL if y is not None else _U
    if in_regs is None:
        in_regs = chunks <= 1024 * u  # the row fits in the block's registers
    kern = _build.kernel(_SRC, _name(_build.ctype(x.dtype), vec, y is not None, in_regs, u))
    smem = 0 if in_regs else _build.row_smem(C, "x")
    _build.set_smem(kern, smem)
    if rows == 0:
        return
    null = 0
    kern(
        (rows,),
        (_build.row_threads(C, vec, u, 1024 if in_regs else 512),),
        (out, null if sum_out is None else sum_out, x, null if y is None else y,
         null if bias is None else bias, weight, b, i32(C), f32(eps)),
        shared_mem=smem,
    )


def _params(x, weight, bias):
    C = x.shape[-1]
    weight = _checks.float_array(weight, "weight", ndim=1)
    bias = _checks.float_array(bias, "bias", ndim=1)
    _checks.same_dtype(x, "x", weight=weight, bias=bias)
    _checks.check_shape(weight, "weight", (C,))
    _checks.check_shape(bias, "bias", (C,))
    return weight, bias


def layernorm(x, weight, bias, *, eps: float = 1e-5, out=None) -> cupy.ndarray:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis of ``x`` [..., C].

    float32 statistics for every storage dtype (float32, float16, bfloat16).
    """
    x = _checks.float_array(x, "x")
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last axis, got shape {x.shape}")
    weight, bias = _params(x, weight, bias)
    out = _checks.output(out, "out", x.shape, x.dtype)
    _launch(out, None, x, None, None, weight, bias, eps)
    return out


def layernorm_residual(x, y, weight, bias, *, proj_bias=None, eps: float = 1e-5, out=None, sum_out=None):
    """GPT-2's residual add fused with the next LayerNorm.

    ``s = x + y (+ proj_bias)`` (rounded to the storage dtype), ``out = layernorm(s)``;
    returns ``(s, out)``. ``sum_out`` may be ``x`` itself (in-place residual stream).
    """
    x = _checks.float_array(x, "x")
    if x.ndim < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last axis, got shape {x.shape}")
    y = _checks.float_array(y, "y")
    _checks.check_shape(y, "y", x.shape)
    weight, bias = _params(x, weight, bias)
    if proj_bias is not None:
        proj_bias = _checks.float_array(proj_bias, "proj_bias", ndim=1)
        _checks.check_shape(proj_bias, "proj_bias", (x.shape[-1],))
    _checks.same_dtype(x, "x", y=y, proj_bias=proj_bias)
    out = _checks.output(out, "out", x.shape, x.dtype)
    sum_out = _checks.output(sum_out, "sum_out", x.shape, x.dtype)
    _launch(out, sum_out, x, y, proj_bias, weight, bias, eps)
    return sum_out, out
