"""Attention over a prompt (prefill) on tensor cores, FlashAttention-2 style, float16 / bfloat16.

Kernel: ``src_cu/flash_attention.cu``. Tests: ``tests/test_flash_attention_gpu.py``.
"""

from __future__ import annotations

import itertools
import math

import cupy

from . import _build, _checks
from ._build import f32, i32, i64

_SRC = "flash_attention.cu"
_BR = 64  # query rows per block (flash_attention.cu: BR)
_BC = 64  # keys per tile (flash_attention.cu: BC)
_THREADS = 2 * _BR  # a warp per 16 query rows
HEAD_DIMS = (64, 128)
DTYPES = tuple(d for d, c in _build.CTYPES.items() if c != "float")  # 16-bit storage only


def _name(c_type: str, head_dim: int, causal: bool) -> str:
    return f"flash_attention_kernel<{c_type}, {head_dim}, {str(causal).lower()}>"


_build.declare(
    _SRC,
    [_name(_build.ctype(d), h, c) for d, h, c in itertools.product(DTYPES, HEAD_DIMS, (False, True))],
)


def _smem_bytes(head_dim: int) -> int:
    return 4 * _BC * head_dim * 2  # two K and two V tiles of 16-bit elements


def _strides(a, name: str) -> tuple[int, int, int]:
    """Element strides (batch, time, head) of a [B, T, H, D] view whose rows cp.async can
    copy in 16-byte pieces: unit stride along D, pointer and strides multiples of 16 bytes."""
    item = a.itemsize
    if a.size == 0:  # nothing is read (k and v with Tk = 0)
        return 0, 0, 0
    if a.strides[3] != item:
        raise ValueError(f"{name} must have unit stride along head_dim, got strides {a.strides}")
    strides = [s if n > 1 else 0 for s, n in zip(a.strides[:3], a.shape)]  # a length-1 axis is never stepped
    if any(s < 0 or s % 16 for s in strides) or a.data.ptr % 16:
        raise ValueError(
            f"{name} must start on a 16-byte boundary with batch, time and head strides that are "
            f"non-negative multiples of 16 bytes (got strides {a.strides}); pass cupy.ascontiguousarray({name})"
        )
    return tuple(s // item for s in strides)


def flash_attention(q, k, v, *, causal: bool = True, scale: float | None = None, out=None) -> cupy.ndarray:
    """Attention on tensor cores: ``softmax(q k^T * scale) v`` per batch and head.

    q: [B, Tq, H, D]; k, v: [B, Tk, H, D]; float16 or bfloat16 (float32 accumulation and
    softmax); D in {64, 128}. Any of them may be a strided view (e.g. the thirds of a fused
    [B, T, 3, H, D] qkv buffer, no copy is made) with unit stride along D and a pointer and
    strides that are multiples of 16 bytes. ``scale`` (> 0) defaults to 1/sqrt(D).

    ``causal``: query i sees keys j <= i + (Tk - Tq), the mask aligned to the bottom right as
    in FlashAttention: with Tq < Tk (a prompt after Tk - Tq cached tokens) the last query sees
    every key; with Tq > Tk the first Tq - Tk queries see no key and get zeros. Without
    ``causal`` every query sees all Tk keys (zeros when Tk = 0).

    Returns a contiguous [B, Tq, H, D] array (view it as [B, Tq, H*D]). For float32, use
    :func:`causal_attention`.
    """
    q = _checks.as_array(q, "q")
    if q.dtype not in DTYPES:
        supported = ", ".join(str(d) for d in DTYPES)
        raise TypeError(f"q has dtype {q.dtype}; flash_attention supports {supported} (for float32: causal_attention)")
    q = _checks.float_array(q, "q", ndim=4, contiguous=False)
    k = _checks.float_array(k, "k", ndim=4, contiguous=False)
    v = _checks.float_array(v, "v", ndim=4, contiguous=False)
    _checks.same_dtype(q, "q", k=k, v=v)
    B, Tq, H, D = q.shape
    Tk = k.shape[1]
    _checks.check_shape(k, "k", (B, Tk, H, D))
    _checks.check_shape(v, "v", k.shape)
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported; supported: {HEAD_DIMS}")
    if H > 65535 or B > 65535:
        raise ValueError(f"at most 65535 heads and 65535 sequences per call, got H={H}, B={B}")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be positive and finite, got {scale}")
    strides = [_strides(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v"))]
    out = _checks.output(out, "out", q.shape, q.dtype)
    if out.data.ptr % 4:
        raise ValueError("out must start on a 4-byte boundary (the kernel stores pairs of elements)")
    if out.size == 0:
        return out
    kern = _build.kernel(_SRC, _name(_build.ctype(q.dtype), D, bool(causal)))
    smem = _smem_bytes(D)
    _build.set_smem(kern, smem)
    args = [out, q, k, v, i32(Tq), i32(Tk), i32(H)]
    for st in strides:
        args += [i64(s) for s in st]
    args.append(f32(scale))
    kern((_build.cdiv(Tq, _BR), H, B), (_THREADS,), tuple(args), shared_mem=smem)
    return out
