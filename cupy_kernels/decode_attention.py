"""Decoding attention: one new query per sequence against its KV cache.

Kernel: ``src_cu/decode_attention.cu``. Tests: ``tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import itertools
import math

import cupy

from . import _build, _checks
from ._build import f32, i32, i64

_SRC = "decode_attention.cu"
HEAD_DIMS = (64, 128)


def _name(c_type: str, head_dim: int) -> str:
    return f"decode_attention_kernel<{c_type}, {head_dim}>"


_build.declare(_SRC, [_name(c, d) for c, d in itertools.product(_build.CTYPES.values(), HEAD_DIMS)])


def decode_attention(q, k_cache, v_cache, seq_lens, *, scale: float | None = None, out=None) -> cupy.ndarray:
    """``softmax(q . K[:len] * scale) V[:len]`` for each sequence and head.

    q: [B, H, D], contiguous over (H, D) (a row of the fused qkv buffer qualifies; the batch
    stride is free); k_cache, v_cache: contiguous [B, H, S_max, D]; seq_lens: int32 [B],
    the number of valid cache rows of each sequence (1 <= len <= S_max, not checked on
    the GPU). D in {64, 128}. Returns [B, H, D].
    """
    q = _checks.float_array(q, "q", ndim=3, contiguous=False)
    k_cache = _checks.float_array(k_cache, "k_cache", ndim=4)
    v_cache = _checks.float_array(v_cache, "v_cache", ndim=4)
    _checks.same_dtype(q, "q", k_cache=k_cache, v_cache=v_cache)
    _checks.check_shape(v_cache, "v_cache", k_cache.shape)
    B, H, D = q.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported; supported: {HEAD_DIMS}")
    if k_cache.shape[0] < B or (k_cache.shape[1], k_cache.shape[3]) != (H, D):
        raise ValueError(f"k_cache {k_cache.shape} does not match q {q.shape}")
    seq_lens = _checks.int_array(seq_lens, "seq_lens", ndim=1)
    _checks.check_shape(seq_lens, "seq_lens", (B,))
    item = q.itemsize
    if q.strides[2] != item or q.strides[1] != D * item:
        raise ValueError(f"q must be contiguous over (heads, head_dim), got strides {q.strides}")
    if q.strides[0] % 16 or q.data.ptr % 16:
        raise ValueError("q rows must start on 16-byte boundaries")
    out = _checks.output(out, "out", (B, H, D), q.dtype)
    if B == 0:
        return out
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kern = _build.kernel(_SRC, _name(_build.ctype(q.dtype), D))
    kern((H, B), (128,), (out, q, k_cache, v_cache, seq_lens, i32(H), i32(k_cache.shape[2]),
                          i64(q.strides[0] // item), f32(scale)))
    return out
