"""The time floor of a memory-bound operation: read its input bytes once and compute
nothing. Benchmarks time it on the bytes an operation must read, beside the operation.

Kernel: ``src_cu/read_floor.cu``. Tests: ``tests/test_kernels_gpu.py``.
Benchmark: ``benchmarks/decode_attention.py``.
"""

from __future__ import annotations

import cupy
import numpy

from . import _build, _checks
from ._build import i64

_SRC = "read_floor.cu"
_NAME = "read_floor_kernel"
_build.declare(_SRC, [_NAME])


def _words(a, name: str) -> cupy.ndarray:
    """``a`` as a flat view, checked for whole 16-byte words from a 16-byte boundary."""
    a = _checks.as_array(a, name)
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous")
    if a.nbytes % 16 or a.data.ptr % 16:
        raise ValueError(f"{name} must be whole 16-byte words from a 16-byte boundary, got {a.nbytes} bytes")
    return a.reshape(-1)


def read_floor(a, b=None, *, blocks: int, threads: int = 256, out=None) -> cupy.ndarray:
    """Reads every byte of ``a`` and of ``b`` (optional) once with ``blocks`` x ``threads``
    threads. Returns uint32 [blocks]: each block's XOR of the 32-bit words it read, so the
    XOR of the result is the XOR of all the words of a and b.

    a, b: contiguous arrays of any dtype, whole 16-byte words from a 16-byte boundary.
    threads: a multiple of 32, at most 1024.
    """
    a = _words(a, "a")
    b = a[:0] if b is None else _words(b, "b")
    if blocks < 1:
        raise ValueError(f"blocks must be at least 1, got {blocks}")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
    out = _checks.output(out, "out", (blocks,), numpy.uint32)
    _build.kernel(_SRC, _NAME)((blocks,), (threads,), (out, a, i64(a.nbytes // 16), b, i64(b.nbytes // 16)))
    return out
