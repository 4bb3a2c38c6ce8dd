"""Attention over a prompt (prefill) on tensor cores, FlashAttention-2 style: float16 /
bfloat16 with float32 accumulation, and float32 with every product split in three tf32
products (3xTF32), which keeps float32 accuracy.

Kernels: ``src_cu/flash_attention.cu`` (16-bit), ``src_cu/flash_attention_tf32.cu``
(float32). Tests: ``tests/test_flash_attention_gpu.py``. Benchmark: ``benchmarks/attention.py``.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import cupy
import numpy

from . import _build, _checks
from ._build import f32, i32, i64

_SRC = "flash_attention.cu"
_SRC_F32 = "flash_attention_tf32.cu"
HEAD_DIMS = (64, 128)
DTYPES = tuple(_build.CTYPES)  # float32 runs flash_attention_tf32.cu, the 16-bit types flash_attention.cu


class Tiles(NamedTuple):
    """The kernel's block shape (flash_attention.cu: Tiles)."""

    rows: int  # query rows per block (BR)
    keys: int  # keys per K and V tile (BC)
    warps: int  # each owns rows / warps consecutive query rows

    def c_type(self, head_dim: int) -> str:
        return f"Tiles<{head_dim}, {self.rows}, {self.keys}, {self.warps}>"

    def smem_bytes(self, head_dim: int) -> int:
        """Two K and two V tiles and the Q tile, of 16-bit elements (Tiles::SMEM)."""
        return (4 * self.keys + self.rows) * head_dim * 2


# The block shape per head dim. Measured on an H100 SXM (sm_90), float16, S = 4096, TFLOP/s
# against torch SDPA's FlashAttention-2 backend in the same run (flash_attention.cu's header
# explains why 32 query rows per warp lift the shared-memory ceiling):
#   D = 128, non-causal, B 16, H 16 (flash 361.1):
#     64 x 64, 4 warps, 16 rows each, Q in registers (the previous kernel)  303.2
#     same shape in this kernel (conditional rescaling, leaner loader)       348.0
#     128 x 64, 8 warps, 16 rows each, Q in registers                        340.9
#     128 x 128, 8 warps, 16 rows each, Q in registers                       355.3
#     128 x 32, 4 warps, 32 rows each, Q re-read                             375.9
#     128 x 64, 4 warps, 32 rows each, Q re-read                  chosen     388.7 (1.08x flash)
#     256 x 64, 8 warps, 32 rows each, Q re-read                             391.6 (the same within
#       noise, but 128 KiB of shared memory: one block per SM, and over the 99 KiB a block may
#       have on sm_86 / sm_89)
#   128 x 64 at 255 registers, two blocks per SM (96 KiB each); bfloat16 396.6 (flash 310.7).
#   D = 64, causal, B 8, H 12 (flash 280.2):
#     64 x 64, 4 warps, Q in registers (the previous kernel)                 287.4
#     128 x 64, 8 warps, 16 rows each, Q in registers                        231.0
#     256 x 64, 8 warps, 32 rows each, Q re-read                             274.9
#     128 x 32, 4 warps, 32 rows each, Q re-read                             281.0
#     128 x 64, 4 warps, 32 rows each, Q re-read                             296.8
#     128 x 64, 4 warps, 32 rows each, Q in registers                        306.5
#     128 x 128, 4 warps, 32 rows each, Q re-read                 chosen     314.0 (1.12x flash)
#   128 x 128 at 255 registers (80 KiB of shared memory; Q in registers as well would spill).
#   Second run: 128 x 128 316.6 causal (flash 278.0); non-causal 353.6 against 308.8 for
#   128 x 64 (flash 302.1). D = 128 causal: 128 x 64 348.6, 128 x 32 347.1 (flash 344.2).
# Final code, medians of 3 rounds of 30 (float16 / bfloat16): D = 128 non-causal 374.6 / 384.8
# against flash 345.4 / 349.4 (1.08x / 1.10x); D = 64 causal 314.0 / 315.4 against 276.6 /
# 277.5 (1.14x / 1.14x). cuDNN (601.6 / 422.9 in float16) uses Hopper's wgmma, which these
# mma.sync kernels cannot reach (630 TFLOP/s is the mma.sync peak).
#   Four warps at up to 255 registers fit two blocks per SM without __launch_bounds__'
#   min-blocks, which could only cap registers further.
TILES = {
    64: Tiles(rows=128, keys=128, warps=4),
    128: Tiles(rows=128, keys=64, warps=4),
}


def _name(c_type: str, head_dim: int, causal: bool, varlen: bool = False) -> str:
    return (f"flash_attention_kernel<{c_type}, {str(causal).lower()}, {TILES[head_dim].c_type(head_dim)}, "
            f"{str(varlen).lower()}>")


_build.declare(
    _SRC,
    [_name(_build.ctype(d), h, c, vl) for d, h, c, vl in itertools.product(DTYPES, HEAD_DIMS, (False, True),
                                                                           (False, True))
     if d != numpy.float32 and (c or not vl)],  # varlen: causal only (see flash_attention)
)

# float32 (flash_attention_tf32.cu): 64 query rows per block, 4 warps of 16; keys per tile
# by head dim (the kernel's BC: 32 at D = 128 keeps its grouped accumulation free of spills).
_F32_ROWS = 64
_F32_KEYS = {64: 64, 128: 32}


def _f32_name(head_dim: int, causal: bool, varlen: bool = False) -> str:
    return f"flash_attention_tf32_kernel<{head_dim}, {str(causal).lower()}, {str(varlen).lower()}>"


_build.declare(_SRC_F32, [_f32_name(h, c, vl) for h, c, vl in itertools.product(HEAD_DIMS, (False, True),
                                                                              (False, True)) if c or not vl])


_MAX_TIME_STRIDE = 2**30  # elements: the kernel keeps a row stride in bytes as a 32-bit int


def _strides(a, name: str) -> tuple[int, int, int]:
    """Element strides (batch, time, head) of a [B, T, H, D] view whose rows cp.async can
    copy in 16-byte pieces: unit stride along D, pointer and strides multiples of 16 bytes,
    and a time stride under 2^30 elements."""
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
    if strides[1] // item >= _MAX_TIME_STRIDE:
        raise ValueError(f"{name} has a time stride of {strides[1] // item} elements; at most {_MAX_TIME_STRIDE - 1}")
    return tuple(s // item for s in strides)


def _varlen(cu_seqlens, q, k) -> tuple[cupy.ndarray, int, int]:
    """(cu_seqlens on the GPU as int32, sequences, longest) of a ``cu_seqlens=`` argument,
    checked on the host: offsets that rise from 0 to T without falling."""
    host = cupy.asnumpy(cu_seqlens) if isinstance(cu_seqlens, cupy.ndarray) else numpy.asarray(cu_seqlens)
    if host.dtype.kind not in "iu" or host.ndim != 1 or host.size < 2:
        raise ValueError("cu_seqlens must be a 1-D integer array of n + 1 >= 2 offsets")
    T = q.shape[1]
    if q.shape[0] != 1 or k.shape[1] != T:
        raise ValueError(f"with cu_seqlens, q, k and v are [1, T, H, D] of one T (packed sequences), got q "
                         f"{q.shape} and k {k.shape}")
    if host[0] != 0 or host[-1] != T or (numpy.diff(host) < 0).any():
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T} without falling, got {host.tolist()[:8]}")
    if host.size - 1 > 65535:
        raise ValueError(f"at most 65535 sequences per call, got {host.size - 1}")
    return cupy.asarray(host, dtype=numpy.int32), host.size - 1, int(numpy.diff(host).max())


def _varlen_trusted(cu_seqlens, max_seqlen, q, k) -> tuple[cupy.ndarray, int, int]:
    """(cu_seqlens, sequences, longest) of ``cu_seqlens`` on the GPU with ``max_seqlen``:
    types and sizes checked, the offsets not (no copy back to the host)."""
    if not isinstance(cu_seqlens, cupy.ndarray) or cu_seqlens.dtype != numpy.int32 or cu_seqlens.ndim != 1:
        raise TypeError("with max_seqlen, cu_seqlens must be a 1-D int32 array on the GPU")
    if cu_seqlens.size < 2 or not cu_seqlens.flags.c_contiguous:
        raise ValueError("cu_seqlens must be a contiguous array of n + 1 >= 2 offsets")
    if cu_seqlens.size - 1 > 65535:
        raise ValueError(f"at most 65535 sequences per call, got {cu_seqlens.size - 1}")
    T = q.shape[1]
    if q.shape[0] != 1 or k.shape[1] != T:
        raise ValueError(f"with cu_seqlens, q, k and v are [1, T, H, D] of one T (packed sequences), got q "
                         f"{q.shape} and k {k.shape}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, numpy.integer)) or not 0 <= max_seqlen <= T:
        raise ValueError(f"max_seqlen must be an int from 0 to T = {T}, got {max_seqlen!r}")
    return cu_seqlens, cu_seqlens.size - 1, int(max_seqlen)


def flash_attention(q, k, v, *, causal: bool = True, scale: float | None = None, out=None,
                    cu_seqlens=None, max_seqlen=None) -> cupy.ndarray:
    """Attention on tensor cores: ``softmax(q k^T * scale) v`` per batch and head.

    q: [B, Tq, H, D]; k, v: [B, Tk, H, D]; D in {64, 128}. float16 or bfloat16: products on
    16-bit tensor cores, float32 accumulation and softmax. float32: every product as three
    tf32 products (x = hi + lo, a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi), float32 accuracy.
    Any of them may be a strided view (e.g. the thirds of a fused [B, T, 3, H, D] qkv
    buffer, no copy is made) with unit stride along D and a pointer and strides that are
    multiples of 16 bytes, and a time stride under 2^30 elements. ``scale`` (> 0) defaults
    to 1/sqrt(D).

    ``causal``: query i sees keys j <= i + (Tk - Tq), the mask aligned to the bottom right as
    in FlashAttention: with Tq < Tk (a prompt after Tk - Tq cached tokens) the last query sees
    every key; with Tq > Tk the first Tq - Tk queries see no key and get zeros. Without
    ``causal`` every query sees all Tk keys (zeros when Tk = 0).

    ``cu_seqlens`` (varlen, as FlashAttention's; causal only, the prefill of many prompts):
    n + 1 offsets from 0 to T; q, k and v are [1, T, H, D] holding n sequences one after
    another along T, sequence i in rows cu_seqlens[i] .. cu_seqlens[i + 1], and each attends
    only to its own keys (Tq = Tk per sequence). Checked on the host (a GPU array is copied
    back), unless ``max_seqlen`` is given: then ``cu_seqlens`` is an int32 GPU array taken as
    it is (FlashAttention's contract: offsets that rise from 0, the last at most T, no
    sequence longer than ``max_seqlen``; rows past the last offset are not written), with no
    copy to or from the host. (The non-causal varlen kernel at D = 64 spilled registers: not
    built.)

    Returns a contiguous [B, Tq, H, D] array (view it as [B, Tq, H*D]).
    """
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
    grid_t, grid_b, cu = Tq, B, None
    if max_seqlen is not None and cu_seqlens is None:
        raise ValueError("max_seqlen goes with cu_seqlens (packed sequences)")
    if cu_seqlens is not None:
        if not causal:
            raise ValueError("cu_seqlens (packed sequences) is supported with causal=True only")
        if max_seqlen is None:
            cu, grid_b, grid_t = _varlen(cu_seqlens, q, k)
        else:
            cu, grid_b, grid_t = _varlen_trusted(cu_seqlens, max_seqlen, q, k)
    varlen = cu is not None
    out = _checks.output(out, "out", q.shape, q.dtype)
    if out.data.ptr % (2 * q.itemsize):
        raise ValueError(f"out must start on a {2 * q.itemsize}-byte boundary (the kernel stores pairs of elements)")
    if out.size == 0:
        return out
    args = [out, q, k, v, i32(Tq), i32(Tk), i32(H)]
    if q.dtype == numpy.float32:
        kern = _build.kernel(_SRC_F32, _f32_name(D, bool(causal), varlen))
        smem = 4 * (_F32_ROWS + 2 * _F32_KEYS[D]) * D  # Q, one K and one V tile of float32
        rows, threads = _F32_ROWS, 128
        for st in strides:
            args += [i64(s) for s in st]
    else:
        tiles = TILES[D]
        kern = _build.kernel(_SRC, _name(_build.ctype(q.dtype), D, bool(causal), varlen))
        smem = tiles.smem_bytes(D)
        rows, threads = tiles.rows, 32 * tiles.warps
        for sb, st, sh in strides:
            args += [i64(sb), i32(st), i64(sh)]
    args += [f32(scale), cu if varlen else 0]
    _build.set_smem(kern, smem)
    if grid_t > 0:
        kern((_build.cdiv(grid_t, rows), H, grid_b), (threads,), tuple(args), shared_mem=smem)
    return out
