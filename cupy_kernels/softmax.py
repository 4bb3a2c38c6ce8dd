"""Row softmax with a scale and an optional causal mask.

Kernel: ``src_cu/softmax.cu``. Tests: ``tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import cupy

from . import _build, _checks
from ._build import f32, i32

_SRC = "softmax.cu"
_U = 4  # vectors in flight per thread (softmax.cu)


def _name(c_type: str, vec: int, in_regs: bool) -> str:
    return f"softmax_kernel<{c_type}, {vec}, {str(in_regs).lower()}>"


_build.declare(
    _SRC, [_name(c, v, g) for c in _build.CTYPES.values() for v in _build.vec_widths(c) for g in (True, False)]
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
    cols = x.shape[-1]
    if x.size == 0:
        return out
    q_len = x.shape[-2] if causal else 1
    vec = _checks.row_vec_width(x.dtype, x, out)
    in_regs = _build.cdiv(cols, vec) <= 1024 * _U  # the row fits in the block's registers
    kern = _build.kernel(_SRC, _name(_build.ctype(x.dtype), vec, in_regs))
    smem = 0 if in_regs else _build.row_smem(cols, "x")
    _build.set_smem(kern, smem)
    kern((x.size // cols,), (_build.row_threads(cols, vec, _U),),
         (out, x, i32(cols), i32(q_len), i32(int(causal)), f32(scale)), shared_mem=smem)
    return out
