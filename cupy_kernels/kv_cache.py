"""KV-cache append.

Kernel: ``src_cu/kv_cache.cu``. Tests: ``tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import cupy

from . import _build, _checks
from ._build import i32, i64

_SRC = "kv_cache.cu"


def _name(c_type: str, vec: int) -> str:
    return f"kv_append_kernel<{c_type}, {vec}>"


_build.declare(_SRC, [_name(c, v) for c in _build.CTYPES.values() for v in _build.vec_widths(c)] + ["kv_advance_kernel"])


def _row_strides(a, name: str) -> tuple[int, int]:
    """(batch, time) element strides of a [B, T, H, D] view whose H*D elements are contiguous."""
    B, T, H, D = a.shape
    item = a.itemsize
    if a.strides[3] != item or a.strides[2] != D * item:
        raise ValueError(f"{name} must be contiguous over (heads, head_dim), got strides {a.strides}")
    if a.strides[0] % item or a.strides[1] % item or a.strides[0] < 0 or a.strides[1] < 0:
        raise ValueError(f"{name} has unsupported strides {a.strides}")
    return a.strides[0] // item, a.strides[1] // item


def kv_append(k_cache, v_cache, k, v, start, *, slots=None, seq_lens=None) -> None:
    """Write k, v [B, T, H, D] into the caches [B_cache, H, S_max, D] at rows start[b]..start[b]+T-1.

    start: int32 [B]; slots: optional int32 [B] cache rows (default: b); seq_lens: optional
    int32 [B], set to start + T. Positions are not checked on the GPU: callers keep
    start[b] + T <= S_max (the model checks lengths on the host).
    """
    k_cache = _checks.float_array(k_cache, "k_cache", ndim=4)
    v_cache = _checks.float_array(v_cache, "v_cache", ndim=4)
    k = _checks.float_array(k, "k", ndim=4, contiguous=False)
    v = _checks.float_array(v, "v", ndim=4, contiguous=False)
    _checks.same_dtype(k_cache, "k_cache", v_cache=v_cache, k=k, v=v)
    _checks.check_shape(v_cache, "v_cache", k_cache.shape)
    _checks.check_shape(v, "v", k.shape)
    B, T, H, D = k.shape
    if (k_cache.shape[1], k_cache.shape[3]) != (H, D):
        raise ValueError(f"k_cache {k_cache.shape} does not hold {H} heads of dim {D}")
    if T > k_cache.shape[2]:
        raise ValueError(f"{T} new rows do not fit a cache of {k_cache.shape[2]} positions")
    start = _checks.int_array(start, "start", ndim=1)
    _checks.check_shape(start, "start", (B,))
    if slots is not None:
        slots = _checks.int_array(slots, "slots", ndim=1)
        _checks.check_shape(slots, "slots", (B,))
    elif B > k_cache.shape[0]:
        raise ValueError(f"{B} sequences but the cache holds {k_cache.shape[0]}")
    if seq_lens is not None:
        seq_lens = _checks.int_array(seq_lens, "seq_lens", ndim=1)
        _checks.check_shape(seq_lens, "seq_lens", (B,))
    ks, vs = _row_strides(k, "k"), _row_strides(v, "v")
    if B * T == 0:
        return
    item = k.itemsize
    aligned = all(a.data.ptr % 16 == 0 for a in (k, v)) and all((s * item) % 16 == 0 for s in (*ks, *vs, D))
    vec = _build.vec_widths(_build.ctype(k.dtype))[1] if aligned else 1
    kern = _build.kernel(_SRC, _name(_build.ctype(k.dtype), vec))
    kern(
        (B * T,), (_build.row_threads(H * D, vec),),
        (k_cache, v_cache, k, v, 0 if slots is None else slots, start, 0 if seq_lens is None else seq_lens,
         i32(T), i32(H), i32(D), i32(k_cache.shape[2]), i64(ks[0]), i64(ks[1]), i64(vs[0]), i64(vs[1])),
    )


def kv_advance(positions, n: int = 1) -> None:
    """``positions += n`` on the GPU (int32 [B]): moves a decode step to the next token."""
    positions = _checks.int_array(positions, "positions", ndim=1)
    if positions.shape[0]:
        kern = _build.kernel(_SRC, "kv_advance_kernel")
        kern((_build.cdiv(positions.shape[0], 128),), (128,), (positions, i32(n), i32(positions.shape[0])))
