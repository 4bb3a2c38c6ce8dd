"""Token + position embedding.

Kernel: ``src_cu/embedding.cu``. Tests: ``tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import cupy

from . import _build, _checks
from ._build import i32

_SRC = "embedding.cu"


def _name(c_type: str, vec: int) -> str:
    return f"embedding_kernel<{c_type}, {vec}>"


_build.declare(_SRC, [_name(c, v) for c in _build.CTYPES.values() for v in _build.vec_widths(c)], pdl=True)


def embedding(ids, wte, wpe, positions, *, out=None) -> cupy.ndarray:
    """``wte[ids] + wpe[positions]``: ids, positions int32 [N]; wte [V, C]; wpe [P, C] -> [N, C].

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
    kern = _build.kernel(_SRC, _name(_build.ctype(wte.dtype), vec))
    kern((ids.shape[0],), (_build.row_threads(C, vec),), (out, ids, positions, wte, wpe, i32(C)))
    return out
