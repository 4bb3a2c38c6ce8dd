"""Token + position embedding.

Kernel: ``src_cu/embedding.cu``. Tests: ``tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import cupy

from . import _build, _checks
from ._build import i32
from .linear import STATS_COLS, _check_stats

_SRC = "embedding.cu"


def _name(c_type: str, vec: int, stats: bool = False) -> str:
    return f"embedding_kernel<{c_type}, {vec}, {'true' if stats else 'false'}>"


_build.declare(_SRC, [_name(c, v) for c in _build.CTYPES.values() for v in _build.vec_widths(c)]
               + [_name(c, 8, True) for c in _build.CTYPES.values() if c != "float"], pdl=True)


def embedding(ids, wte, wpe, positions, *, out=None, stats_out=None) -> cupy.ndarray:
    """``wte[ids] + wpe[positions]``: ids, positions int32 [N]; wte [V, C]; wpe [P, C] -> [N, C].

    ``stats_out`` (float16 / bfloat16 rows of 16-byte vectors; float32 [N, ceil(C / 16), 2]):
    also the rows' statistics for a product that folds its LayerNorm, as a product with a
    residual epilogue leaves them (``linear(..., stats_out=)``; the same bits for the same
    rows): each 16 columns' mean and sum of squared deviations, of the rows as stored.

    Index values are not checked on the GPU (that would need a synchronization): callers
    validate them, as the model does on the host.
    """
    ids = _checks.int_array(ids, "ids", ndim=1)
    positions = _checks.int_array(positions, "positions", ndim=1)
    _checks.check_shape(positions, "positions", ids.shape)
    wte = _checks.float_array(wte, "wte", ndim=2)
    wpe = _checks.float_array(wpe, "wpe", ndim=2)
    _checks.same_dtype(wte, "wte", wpe=wpe)
    C = wte.shape[1]
    if wpe.shape[1] != C:
        raise ValueError(f"wpe has {wpe.shape[1]} columns but wte has {C}")
    out = _checks.output(out, "out", (ids.shape[0], C), wte.dtype)
    if ids.shape[0] == 0:
        return out
    vec = _checks.vec_width(wte.dtype, C, wte, wpe, out)
    if stats_out is not None:
        if wte.dtype.itemsize != 2 or vec != 8:
            raise TypeError("stats_out needs float16 / bfloat16 rows of 16-byte vectors (C % 8 == 0, 16-byte "
                            f"aligned), got {wte.dtype} rows of {C}")
        stats_out = _check_stats(stats_out, "stats_out", ids.shape[0], C)
        threads = _build.row_threads(_build.cdiv(C, STATS_COLS), 1)
    else:
        threads = _build.row_threads(C, vec)
    kern = _build.kernel(_SRC, _name(_build.ctype(wte.dtype), vec, stats_out is not None))
    kern((ids.shape[0],), (threads,), (out, ids, positions, wte, wpe, i32(C), 0 if stats_out is None else stats_out))
    return out
