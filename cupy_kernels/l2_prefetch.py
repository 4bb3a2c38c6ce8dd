"""Byte ranges of device memory requested into L2 without reading them: the decode step's
weights, ahead of the products that read them (``gpt2_cupy/engine.py``, Session.capture).

Kernel: ``src_cu/l2_prefetch.cu``. Tests: ``tests/test_kernels_gpu.py``.
Benchmark: ``benchmarks/l2_prefetch.py``.
"""

from __future__ import annotations

import numbers

import cupy
import numpy

from . import _build, _checks
from ._build import i32

_SRC = "l2_prefetch.cu"
_NAME = "l2_prefetch_kernel"
_build.declare(_SRC, [_NAME])
PIECE_BYTES = 64 * 1024  # bytes a warp requests (one bulk prefetch on sm_90)
THREADS = 128  # l2_prefetch.cu's __launch_bounds__: four pieces a block


def l2_prefetch(ranges) -> None:
    """Requests each of ``ranges`` into L2 on the current stream and returns: a hint, nothing
    is read into the SMs or written, nothing waits for the data.

    ranges: ``(array, start, nbytes)`` tuples, the ``nbytes`` bytes of a contiguous array's
    memory from byte ``start`` (inside the array). Each range is trimmed inward to whole
    16-byte words and cut into pieces of at most PIECE_BYTES. The table of pieces is built
    when this is called (or recorded into a launch plan) and kept by the launch.
    """
    pieces = _pieces(ranges)
    if not pieces:
        return
    table = cupy.asarray(numpy.asarray(pieces, dtype=numpy.int64))
    warps = THREADS // 32
    _build.kernel(_SRC, _NAME)((_build.cdiv(len(pieces), warps),), (THREADS,), (table, i32(len(pieces))))


def _pieces(ranges) -> list[tuple[int, int]]:
    """(address, bytes) of each piece of ``ranges`` (l2_prefetch), checked."""
    pieces = []
    for i, r in enumerate(ranges):
        if not (isinstance(r, (tuple, list)) and len(r) == 3):
            raise TypeError(f"ranges[{i}] must be a tuple (array, start, nbytes), got {r!r}")
        a, start, nbytes = r
        a = _checks.as_array(a, f"ranges[{i}] array")
        if not a.flags.c_contiguous:
            raise ValueError(f"ranges[{i}] array must be contiguous (its bytes one range)")
        if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in (start, nbytes)):
            raise TypeError(f"ranges[{i}] start and nbytes must be integers, got {start!r}, {nbytes!r}")
        if start < 0 or nbytes < 0 or start + nbytes > a.nbytes:
            raise ValueError(f"ranges[{i}]: bytes [{start}, {start + nbytes}) are not inside the array's "
                             f"{a.nbytes} bytes")
        lo = -(-(a.data.ptr + start) // 16) * 16
        hi = (a.data.ptr + start + nbytes) // 16 * 16
        pieces += [(p, min(PIECE_BYTES, hi - p)) for p in range(lo, hi, PIECE_BYTES)]
    return pieces
