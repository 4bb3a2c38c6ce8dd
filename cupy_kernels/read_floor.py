"""The time floor of a memory-bound operation: read its input bytes once and compute
nothing. Benchmarks time it on the bytes an operation must read, beside the operation; and
what one dependent load waits while such a read streams (``read_under_load``).

Kernel: ``src_cu/read_floor.cu``. Tests: ``tests/test_kernels_gpu.py``.
Benchmarks: ``benchmarks/decode_attention.py``, ``benchmarks/memory_queue.py``.
"""

from __future__ import annotations

import cupy
import numpy

from . import _build, _checks
from ._build import i32, i64

_SRC = "read_floor.cu"
_NAME = "read_floor_kernel"
UNDER_LOAD_IN_FLIGHT = (4, 8)  # read_under_load's 16-byte loads in flight a thread
_build.declare(_SRC, [_NAME] + [f"read_under_load_kernel<{n}>" for n in UNDER_LOAD_IN_FLIGHT])


def _words(a, name: str) -> cupy.ndarray:
    """``a`` as a flat view, checked for whole 16-byte words from a 16-byte boundary."""
    a = _checks.as_array(a, name)
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous")
    if a.nbytes % 16 or a.data.ptr % 16:
        raise ValueError(f"{name} must be whole 16-byte words from a 16-byte boundary, got {a.nbytes} bytes")
    return a.reshape(-1)


def _check_grid(blocks, threads) -> None:
    if not isinstance(blocks, (int, numpy.integer)) or blocks < 1:
        raise ValueError(f"blocks must be an integer of at least 1, got {blocks!r}")
    if not isinstance(threads, (int, numpy.integer)) or threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads!r}")


def read_floor(a, b=None, *, blocks: int, threads: int = 256, out=None) -> cupy.ndarray:
    """Reads every byte of ``a`` and of ``b`` (optional) once with ``blocks`` x ``threads``
    threads. Returns uint32 [blocks]: each block's XOR of the 32-bit words it read, so the
    XOR of the result is the XOR of all the words of a and b.

    a, b: contiguous arrays of any dtype, whole 16-byte words from a 16-byte boundary.
    threads: a multiple of 32, at most 1024.
    """
    a = _words(a, "a")
    b = a[:0] if b is None else _words(b, "b")
    _check_grid(blocks, threads)
    out = _checks.output(out, "out", (blocks,), numpy.uint32)
    _build.kernel(_SRC, _NAME)((blocks,), (threads,), (out, a, i64(a.nbytes // 16), b, i64(b.nbytes // 16)))
    return out


def read_under_load(a, chase, *, blocks: int, threads: int = 256, loads: int = 4, hops: int = 0,
                    delay_ns: int = 0, out=None, lat=None) -> tuple[cupy.ndarray, cupy.ndarray]:
    """Reads every byte of ``a`` once with ``blocks`` x ``threads`` threads, each with ``loads``
    16-byte loads in flight (blocks x threads x loads x 16 bytes requested at once), while one
    more block times a dependent load: after ``delay_ns`` its thread follows ``chase`` from 0
    (``i = chase[i]``, through L2) ``hops`` times.

    a: contiguous, whole 16-byte words from a 16-byte boundary. chase: contiguous uint32 [n]
    whose every value is an index below n (not checked on the GPU). Returns (out uint32
    [blocks]: each streaming block's XOR of its words, as read_floor; lat uint64 [2]: the mean
    ns a hop, and the index the chase ended on).
    """
    a = _words(a, "a")
    chase = _checks.as_array(chase, "chase")
    if chase.dtype != numpy.uint32 or chase.ndim != 1 or not chase.flags.c_contiguous or chase.size == 0:
        raise ValueError(f"chase must be a non-empty contiguous 1-D uint32 array, got {chase.dtype} {chase.shape}")
    _check_grid(blocks, threads)
    if loads not in UNDER_LOAD_IN_FLIGHT:
        raise ValueError(f"loads must be one of {UNDER_LOAD_IN_FLIGHT}, got {loads!r}")
    if not isinstance(hops, (int, numpy.integer)) or not 0 <= hops < 2**31:
        raise ValueError(f"hops must be an integer in [0, 2**31), got {hops!r}")
    if not isinstance(delay_ns, (int, numpy.integer)) or delay_ns < 0:
        raise ValueError(f"delay_ns must be a non-negative integer, got {delay_ns!r}")
    out = _checks.output(out, "out", (blocks,), numpy.uint32)
    lat = _checks.output(lat, "lat", (2,), numpy.uint64)
    kern = _build.kernel(_SRC, f"read_under_load_kernel<{loads}>")
    kern((blocks + 1,), (threads,), (out, a, i64(a.nbytes // 16), chase, i32(hops), i64(delay_ns), lat))
    return out, lat
