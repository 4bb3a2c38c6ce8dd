"""Row softmax with a scale and an optional causal mask.

Kernel: ``src_cu/softmax.cu``. Tests: ``tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import cupy

from . import _build, _checks
from ._build import f32, i32

_SRC = "softmax.cu"
# Vectors per thread, loaded together: 4, or 2 when there are fewer rows than SMs (latency
# bound: each row over twice the threads). results/row_tuning-h200.json, float32 8 x 1024:
# 4.64 us with 2, 5.14 us with 4.
_U, _U_FEW_ROWS = 4, 2


def _name(c_type: str, vec: int, in_regs: bool, u: int = _U) -> str:
    return f"softmax_kernel<{c_type}, {vec}, {str(in_regs).lower()}, {u}>"


_build.declare(
    _SRC,
    [_name(c, v, g, u) for c in _build.CTYPES.values() for v in _build.vec_widths(c) for g in (True, False)
     for u in ((_U, _U_FEW_ROWS) if g else (_U,))],
)


def softmax(x, *, scale: float = 1.0, causal: bool = False, out=None) -> cupy.ndarray:
    """``softmax(scale * x)`` over the last axis, in float32 arithmetic.

    Causal: ``x`` is [..., Tq, Tk] and query i sees keys j <= i + (Tk - Tq) (aligned
    bottom-right, as in attention after a cached prefix); hidden entries are 0.
    """
    x = _checks.float_array(x, "x")
    if x.ndim < (2 if causal else 1):
        raise ValueError(f"x must have {'2' if causal else '1'} or more dimensions, got shape {x.shape}")
    out = _checks.output(out, "out", x.shape, x.dtype)
    if x.size == 0:
        return out
    _launch(out, x, x.shape[-2] if causal else 1, causal, scale)
    return out


def _launch(out, x, q_len: int, causal: bool, scale: float, u: int | None = None, in_regs: bool | None = None):
    """``u`` / ``in_regs`` override the defaults for benchmarks/row_tuning.py."""
    cols = x.shape[-1]
    vec = _checks.row_vec_width(x.dtype, x, out)
    if in_regs is None:
        # float32 rows stay in shared memory: the register version is slower for them
        # (results/row_tuning-h200.json: 16384 x 4096 152.1 us vs 134.5; 65536 x 768 103.4 vs 99.4)
        in_regs = x.dtype.itemsize < 4 and _build.cdiv(cols, vec) <= 1024 * _U
    if u is None:
        few_rows = x.size // cols < _build.sm_count(x.device.id)
        u = _U_FEW_ROWS if in_regs and few_rows and _build.cdiv(cols, vec) <= 1024 * _U_FEW_ROWS else _U
    kern = _build.kernel(_SRC, _name(_build.ctype(x.dtype), vec, in_regs, u))
    smem = 0 if in_regs else _build.row_smem(cols, "x")
    _build.set_smem(kern, smem)
    kern((x.size // cols,), (_build.row_threads(cols, vec, u, 1024 if in_regs else 512),),
         (out, x, i32(cols), i32(q_len), i32(int(causal)), f32(scale)), shared_mem=smem)
