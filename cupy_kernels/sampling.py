"""Next-token choice on the GPU: greedy argmax, and seeded temperature / top-k / top-p sampling.

Kernel: ``src_cu/sampling.cu``. Tests: ``tests/test_kernels_gpu.py``.
"""

from __future__ import annotations

import math

import cupy
import numpy

from . import _build, _checks
from ._build import f32, i32

_SRC = "sampling.cu"
_THREADS = 1024

_build.declare(_SRC, [f"{k}<{c}>" for k in ("argmax_kernel", "sample_kernel") for c in _build.CTYPES.values()])
_PUBLISH = "publish_tokens_kernel"
_PUBLISH_THREADS = 256  # sampling.cu's PUBLISH_THREADS
_build.declare(_SRC, [_PUBLISH], pdl=True)


def _logits(logits) -> cupy.ndarray:
    logits = _checks.float_array(logits, "logits", ndim=2)
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one column")
    return logits


def argmax(logits, *, out=None) -> cupy.ndarray:
    """int32 [B]: the first index of each row's largest value; logits [B, V]."""
    logits = _logits(logits)
    out = _checks.output(out, "out", (logits.shape[0],), numpy.int32)
    if logits.shape[0]:
        kern = _build.kernel(_SRC, f"argmax_kernel<{_build.ctype(logits.dtype)}>")
        kern((logits.shape[0],), (_THREADS,), (out, logits, i32(logits.shape[1])))
    return out


def sample(logits, *, seed: int, offset=0, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, out=None) -> cupy.ndarray:
    """int32 [B]: one token per row of logits [B, V], drawn from softmax(logits / temperature)
    restricted to the top_k largest (ties kept) and then to the smallest top-probability set
    of mass >= top_p (ties kept). The uniform number of row b comes from Philox4x32-10 with
    key ``seed`` (64-bit) and counter ``(offset[b], b)``: same seed and offset, same token.

    ``offset``: an int (the same for every row), or a uint64 [B] GPU array that the kernel
    increments after drawing, so that repeated launches (a recorded decode step) draw
    fresh numbers.
    """
    logits = _logits(logits)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, (int, numpy.integer)) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if not isinstance(seed, (int, numpy.integer)) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    seed = int(seed)
    B = logits.shape[0]
    if isinstance(offset, (int, numpy.integer)):
        if not 0 <= offset < 2**64:
            raise ValueError(f"offset must be in [0, 2**64), got {offset!r}")
        offset = cupy.full((B,), offset, dtype=numpy.uint64)
    else:
        offset = _checks.as_array(offset, "offset")
        if offset.dtype != numpy.uint64 or offset.shape != (B,) or not offset.flags.c_contiguous:
            raise TypeError(f"offset must be an int or a contiguous uint64 array of shape ({B},)")
    out = _checks.output(out, "out", (B,), numpy.int32)
    if logits.shape[0] == 0:
        return out
    u32 = numpy.uint32
    kern = _build.kernel(_SRC, f"sample_kernel<{_build.ctype(logits.dtype)}>")
    kern(
        (logits.shape[0],), (_THREADS,),
        (out, logits, i32(logits.shape[1]), f32(1.0 / temperature), i32(top_k or 0),
         f32(1.0 if top_p is None else top_p), u32(seed & 0xFFFFFFFF), u32(seed >> 32), offset),
    )
    return out


def publish_tokens(tokens, ring, slot) -> None:
    """Copy int32 ``tokens`` [B] into row ``slot[0]`` of ``ring`` [slots, B] and move
    ``slot[0]`` on to ``(slot[0] + 1) % slots``, both on the GPU: ``ring`` is pinned host
    memory (``cupyx.empty_pinned``, a C-contiguous int32 numpy array) that the kernel
    writes directly, ``slot`` an int32 [1] GPU array holding a row index in [0, slots). A
    recorded decode step ends with it, so the host reads each step's tokens from the ring
    once an event after the step has fired, with no device-to-host copy in the stream."""
    tokens = _checks.as_array(tokens, "tokens")
    if tokens.dtype != numpy.int32 or tokens.ndim != 1 or not tokens.flags.c_contiguous:
        raise TypeError(f"tokens must be a contiguous int32 [B] array, got {tokens.dtype} {tokens.shape}")
    if not isinstance(ring, numpy.ndarray) or ring.dtype != numpy.int32 or ring.ndim != 2 or \
            not ring.flags.c_contiguous or ring.shape[1] != tokens.shape[0] or ring.shape[0] < 1:
        raise TypeError(f"ring must be a C-contiguous pinned int32 numpy array [slots, {tokens.shape[0]}]")
    slot = _checks.as_array(slot, "slot")
    if slot.dtype != numpy.int32 or slot.shape != (1,):
        raise TypeError(f"slot must be an int32 GPU array of shape (1,), got {slot.dtype} {slot.shape}")
    if tokens.shape[0] == 0:
        return
    ptr = cupy.cuda.runtime.pointerGetAttributes(ring.ctypes.data).devicePointer  # (0: not pinned)
    if not ptr:
        raise TypeError("ring must be pinned host memory (cupyx.empty_pinned)")
    kern = _build.kernel(_SRC, _PUBLISH)
    kern((1,), (_PUBLISH_THREADS,), (cupy.uint64(ptr), slot, tokens, i32(tokens.shape[0]), i32(ring.shape[0])))
