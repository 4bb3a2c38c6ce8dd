"""Causal attention over a prompt (prefill), Flash Attention V1 style in float32 arithmetic.

Kernel: ``src_cu/attention.cu``. Tests: ``tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import itertools
import math

import cupy

from . import _build, _checks
from ._build import f32, i32, i64

_SRC = "attention.cu"
_BR = 64  # query rows per block (attention.cu)
HEAD_DIMS = (64, 128)


def _name(c_type: str, head_dim: int, vec: int) -> str:
    return f"causal_attention_kernel<{c_type}, {head_dim}, {vec}>"


_build.declare(
    _SRC,
    [
        _name(c, d, v)
        for c, d in itertools.product(_build.CTYPES.values(), HEAD_DIMS)
        for v in _build.vec_widths(c)
    ],
)


def _smem_bytes(head_dim: int) -> int:
    return 4 * (2 * _BR * (head_dim + 1) + _BR * (_BR + 1))  # Q, K/V, P tiles in float32


def _strides(a, name: str) -> tuple[int, int, int]:
    """Element strides (batch, time, head) of a [B, T, H, D] view with unit stride along D."""
    item = a.itemsize
    if a.strides[3] != item:
        raise ValueError(f"{name} must have unit stride along head_dim, got strides {a.strides}")
    if any(s % item for s in a.strides) or any(s < 0 for s in a.strides):
        raise ValueError(f"{name} has unsupported strides {a.strides}")
    return tuple(s // item for s in a.strides[:3])


def causal_attention(q, k, v, *, scale: float | None = None, out=None) -> cupy.ndarray:
    """Causal self-attention: query t sees keys 0..t.

    q, k, v: [B, T, H, D] arrays, possibly strided views (e.g. the thirds of a fused
    [B, T, 3, H, D] qkv buffer: no copy is made); D in {64, 128}; float32, float16 or
    bfloat16 storage, float32 arithmetic. ``scale`` defaults to 1/sqrt(D).
    Returns a contiguous [B, T, H, D] array (view it as [B, T, H*D]).
    """
    q = _checks.float_array(q, "q", ndim=4, contiguous=False)
    k = _checks.float_array(k, "k", ndim=4, contiguous=False)
    v = _checks.float_array(v, "v", ndim=4, contiguous=False)
    _checks.same_dtype(q, "q", k=k, v=v)
    _checks.check_shape(k, "k", q.shape)
    _checks.check_shape(v, "v", q.shape)
    B, T, H, D = q.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported; supported: {HEAD_DIMS}")
    strides = [_strides(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v"))]
    out = _checks.output(out, "out", q.shape, q.dtype)
    if q.size == 0:
        return out
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    itemsize = q.itemsize
    aligned = all(a.data.ptr % 16 == 0 for a in (q, k, v)) and all(
        (s * itemsize) % 16 == 0 for st in strides for s in st
    )
    vec = _build.vec_widths(_build.ctype(q.dtype))[1] if aligned else 1
    kern = _build.kernel(_SRC, _name(_build.ctype(q.dtype), D, vec))
    smem = _smem_bytes(D)
    _build.set_smem(kern, smem)
    args = [out, q, k, v, i32(T), i32(H)]
    for st in strides:
        args += [i64(s) for s in st]
    args.append(f32(scale))
    kern((_build.cdiv(T, _BR), B * H), (256,), tuple(args), shared_mem=smem)
    return out
