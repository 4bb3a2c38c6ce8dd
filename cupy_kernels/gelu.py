"""Bias add fused with GELU (tanh form), and the plain bias add.

Kernel: ``src_cu/gelu.cu``. Tests: ``tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import itertools

import cupy

from . import _build, _checks
from ._build import i32

_SRC = "gelu.cu"
_THREADS = 256
_WAVES = 16  # blocks per SM to aim for (not tuned yet)


def _name(c_type: str, vec: int, gelu: bool) -> str:
    return f"bias_act_kernel<{c_type}, {vec}, {'true' if gelu else 'false'}>"


_build.declare(
    _SRC,
    [
        _name(c, v, g)
        for c, g in itertools.product(_build.CTYPES.values(), (True, False))
        for v in _build.vec_widths(c)
    ],
)


def _bias_act(x, bias, out, gelu: bool) -> cupy.ndarray:
    x = _checks.float_array(x, "x")
    if x.ndim < 1:
        raise ValueError("x must have at least one dimension")
    cols = x.shape[-1]
    bias = _checks.float_array(bias, "bias", ndim=1)
    _checks.same_dtype(x, "x", bias=bias)
    _checks.check_shape(bias, "bias", (cols,))
    out = _checks.output(out, "out", x.shape, x.dtype)
    if x.size == 0:
        return out
    vec = _checks.vec_width(x.dtype, cols, x, bias, out)
    kern = _build.kernel(_SRC, _name(_build.ctype(x.dtype), vec, gelu))
    rows, chunks = x.size // cols, _build.cdiv(cols, vec)
    threads = min(_THREADS, 32 * _build.cdiv(chunks, 32))
    grid_x = _build.cdiv(chunks, threads)
    # enough blocks to keep every SM busy, each walking several rows
    grid_y = min(rows, max(1, _WAVES * _build.sm_count(cupy.cuda.Device().id) // grid_x), 65535)
    kern((grid_x, grid_y), (threads,), (out, x, bias, i32(rows), i32(cols)))
    return out


def bias_gelu(x, bias, *, out=None) -> cupy.ndarray:
    """``gelu(x + bias)`` with ``gelu(v) = 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))``.

    x: [..., N], bias: [N]; one kernel instead of the bias add and 8 element-wise ops.
    ``out`` may be ``x`` (in place).
    """
    return _bias_act(x, bias, out, gelu=True)


def bias_add(x, bias, *, out=None) -> cupy.ndarray:
    """``x + bias`` broadcast over the last axis; ``out`` may be ``x`` (in place)."""
    return _bias_act(x, bias, out, gelu=False)
