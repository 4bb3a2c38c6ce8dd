"""Decoding attention whose bits do not depend on its block width: the decode step's
attention for models whose cache has their dtype, its width following the batch.

Kernel: ``src_cu/fixed_attention.cu`` (each tile of 16 keys' sums, 8 in float32, rounded once
to 64-bit fixed point, the tiles added as integers). Tests: ``tests/test_fixed_attention_gpu.py``.
Benchmarks: ``benchmarks/fixed_attention.py``, ``benchmarks/step_variants.py``.
"""

from __future__ import annotations

import math

import numpy

from . import _build, _checks
from ._build import f32, i32

_SRC = "fixed_attention.cu"
THREADS = (128, 256, 512)
MAX_KEYS = 1024  # cache rows a sequence may have (S_max)
HEAD_DIM = 64


def _name(c_type: str, threads: int) -> str:
    return f"fixed_attention_kernel<{c_type}, {threads}>"


_build.declare(_SRC, [_name(c, t) for c in _build.CTYPES.values() for t in THREADS], pdl=True)


def fixed_attention(q, k_cache, v_cache, seq_lens, *, threads: int = 128, positions=None, trigger_early: bool = False,
                    out=None):
    """``softmax(q . K[:len] / 8) V[:len]`` for each sequence and head, with the same bits for
    every ``threads`` (128, 256 or 512 a block).

    q: [B, H, 64] float32 / float16 / bfloat16 (rows may be strided, e.g. the q of a q|k|v row);
    k_cache, v_cache: contiguous [B, H, S_max, 64] in q's dtype, S_max <= 1024; seq_lens: int32
    [B], the keys of each sequence (at most S_max; 0 gives zeros). positions (int32 [B] or
    None): in a decode step, the row the kernel ahead appends to each sequence (seq_lens =
    positions + 1); the rows below it are requested before that kernel ends (programmatic
    dependent launch). trigger_early: under programmatic dependent launch, the next kernel may
    start once every block has requested those rows, before its wait for the kernel ahead,
    instead of after that wait (the same numbers). Returns out [B, H, 64] in q's dtype (a NaN
    or infinity in the rows read gives NaN)."""
    q = _checks.float_array(q, "q", ndim=3, contiguous=False)
    B, H, D = q.shape
    if D != HEAD_DIM or q.strides[2] != q.itemsize or q.strides[1] != D * q.itemsize:
        raise ValueError(f"q must be [B, H, {HEAD_DIM}] with contiguous heads (any batch stride), got shape "
                         f"{q.shape}, strides {q.strides}")
    if q.strides[0] % 16 or q.data.ptr % 16:
        raise ValueError("q's rows must start on 16-byte boundaries")
    k_cache = _checks.float_array(k_cache, "k_cache", ndim=4)
    v_cache = _checks.float_array(v_cache, "v_cache", ndim=4)
    for name, a in (("k_cache", k_cache), ("v_cache", v_cache)):
        if a.dtype != q.dtype:
            raise TypeError(f"{name} must be {q.dtype} like q, got {a.dtype}")
        if a.shape[:2] != (B, H) or a.shape[3] != D:
            raise ValueError(f"{name} must have shape [{B}, {H}, S_max, {D}], got {a.shape}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    S_max = k_cache.shape[2]
    if not 1 <= S_max <= MAX_KEYS:
        raise ValueError(f"fixed_attention takes caches of 1 to {MAX_KEYS} rows, got {S_max}")
    seq_lens = _checks.int_vector(seq_lens, "seq_lens", B)
    if positions is not None:
        positions = _checks.int_vector(positions, "positions", B)
    if not isinstance(trigger_early, (bool, numpy.bool_)):
        raise TypeError(f"trigger_early must be a bool, got {trigger_early!r}")
    if threads not in THREADS:
        raise ValueError(f"threads must be one of {THREADS}, got {threads!r}")
    out = _checks.output(out, "out", (B, H, D), q.dtype)
    if B * H == 0:
        return out
    kern = _build.kernel(_SRC, _name(_build.ctype(q.dtype), threads))
    kern((H, B), (threads,), (out, q, k_cache, v_cache, seq_lens, i32(H), i32(S_max), f32(1.0 / math.sqrt(D)),
                              numpy.int64(q.strides[0] // q.itemsize), 0 if positions is None else positions,
                              i32(bool(trigger_early))))
    return out
