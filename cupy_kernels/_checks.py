"""Input checks shared by the kernel wrappers: every problem is a TypeError or ValueError
naming the argument, raised before anything is launched."""

from __future__ import annotations

import cupy
import numpy

from ._build import CTYPES

_KDLCUDA = 2  # DLPack device types that CuPy can import without a copy
_KDLCUDA_MANAGED = 13


def as_array(x, name: str) -> cupy.ndarray:
    """A CuPy view of ``x`` (a CuPy array or any GPU ``__dlpack__`` tensor), never a copy."""
    if isinstance(x, cupy.ndarray):
        return x
    if not hasattr(x, "__dlpack__"):
        raise TypeError(f"{name} must be a cupy.ndarray or a GPU tensor with __dlpack__, got {type(x).__name__}")
    device_type = x.__dlpack_device__()[0] if hasattr(x, "__dlpack_device__") else None
    if device_type not in (_KDLCUDA, _KDLCUDA_MANAGED):
        raise TypeError(f"{name} must live on the GPU (DLPack device type {device_type}); move it there first")
    return cupy.from_dlpack(x)


def float_array(x, name: str, ndim: int | tuple[int, ...] | None = None, contiguous: bool = True) -> cupy.ndarray:
    """``as_array`` + a float dtype of the table + optional ndim + C-contiguity."""
    a = as_array(x, name)
    if a.dtype not in CTYPES:
        supported = ", ".join(str(d) for d in CTYPES)
        raise TypeError(f"{name} has dtype {a.dtype}; supported: {supported}")
    check_ndim(a, name, ndim)
    if contiguous and not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (got strides {a.strides}); call cupy.ascontiguousarray first")
    return a


def int_array(x, name: str, ndim: int | None = None) -> cupy.ndarray:
    """An int32 C-contiguous index array on the GPU."""
    a = as_array(x, name)
    if a.dtype != numpy.int32:
        raise TypeError(f"{name} must be int32, got {a.dtype}")
    check_ndim(a, name, ndim)
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return a


def int_vector(x, name: str, n: int) -> cupy.ndarray:
    """``int_array`` of shape [n] (one index or length per sequence)."""
    a = int_array(x, name, ndim=1)
    check_shape(a, name, (n,))
    return a


def check_ndim(a, name: str, ndim) -> None:
    if ndim is None:
        return
    allowed = (ndim,) if isinstance(ndim, int) else ndim
    if a.ndim not in allowed:
        raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dimensions, got shape {a.shape}")


def same_dtype(ref: cupy.ndarray, ref_name: str, **others) -> None:
    for name, a in others.items():
        if a is not None and a.dtype != ref.dtype:
            raise TypeError(f"{name} has dtype {a.dtype} but {ref_name} has {ref.dtype}")


def check_shape(a, name: str, shape: tuple[int, ...]) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(a.shape)}")


def vec_width(dtype, cols: int, *arrays) -> int:
    """16-byte vectors when every row start is 16-byte aligned, else 1 element."""
    itemsize = numpy.dtype(dtype).itemsize
    n = 16 // itemsize
    if (cols * itemsize) % 16:
        return 1
    if any(a is not None and a.data.ptr % 16 for a in arrays):
        return 1
    return n


def row_vec_width(dtype, *rows) -> int:
    """For kernels that split each row into an unaligned head, 16-byte vectors and a tail
    (row.cuh): full vectors when every row array has the same alignment, else 1."""
    if len({a.data.ptr % 16 for a in rows if a is not None}) > 1:
        return 1
    return 16 // numpy.dtype(dtype).itemsize


def overlaps(a: cupy.ndarray, b: cupy.ndarray) -> bool:
    """Whether the memory spans of two arrays meet."""
    a0, b0 = a.data.ptr, b.data.ptr
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def output(out, name: str, shape: tuple[int, ...], dtype) -> cupy.ndarray:
    """``out`` checked against shape and dtype, or a new uninitialized array."""
    if out is None:
        return cupy.empty(shape, dtype=dtype)
    out = as_array(out, name)
    if out.dtype != numpy.dtype(dtype):
        raise TypeError(f"{name} must have dtype {numpy.dtype(dtype)}, got {out.dtype}")
    check_shape(out, name, shape)
    if not out.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return out
