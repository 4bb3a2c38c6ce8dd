"""KV-cache append, in the model's dtype or quantized to int8 / fp8 e4m3.

Kernel: ``src_cu/kv_cache.cu`` (formats: ``src_cu/kv.cuh``). Tests: ``tests/test_kernels_gpu.py``,
``tests/test_decode_attention_gpu.py`` (quantized).
"""

from __future__ import annotations

import itertools

import numpy

from . import _build, _checks
from ._build import i32, i64

_SRC = "kv_cache.cu"
QUANT_HEAD_DIMS = (64, 128)

# Quantized cache formats: name -> storage dtype; storage dtype -> C++ element type.
# fp8 e4m3 has no CuPy dtype: its bytes are stored as uint8.
KV_DTYPES = {"int8": numpy.dtype(numpy.int8), "float8_e4m3": numpy.dtype(numpy.uint8)}
KV_CTYPES = {numpy.dtype(numpy.int8): "signed char", numpy.dtype(numpy.uint8): "__nv_fp8_e4m3"}
_KV_ALIASES = {"fp8": "float8_e4m3", "e4m3": "float8_e4m3", "float8_e4m3fn": "float8_e4m3"}


def _name(c_type: str, vec: int) -> str:
    return f"kv_append_kernel<{c_type}, {vec}>"


def _quant_name(c_type: str, kv_type: str, head_dim: int) -> str:
    return f"kv_append_quant_kernel<{c_type}, {kv_type}, {head_dim}>"


_build.declare(
    _SRC,
    [_name(c, v) for c in _build.CTYPES.values() for v in _build.vec_widths(c)]
    + [_quant_name(c, kv, d) for c, kv, d in itertools.product(_build.CTYPES.values(), KV_CTYPES.values(), QUANT_HEAD_DIMS)]
    + ["kv_advance_kernel"],
    pdl=True,
)


def kv_storage_dtype(kv_dtype, dtype) -> numpy.dtype:
    """The array dtype of a cache: ``dtype`` (the model's) for None, else int8 for 'int8'
    and uint8 for 'float8_e4m3' (alias 'fp8'), or ValueError."""
    if kv_dtype is None:
        return numpy.dtype(dtype)
    name = _KV_ALIASES.get(str(kv_dtype), str(kv_dtype))
    if name not in KV_DTYPES:
        raise ValueError(f"unsupported kv_cache_dtype {kv_dtype!r}; choose None (the model's dtype), 'int8' or 'fp8'")
    return KV_DTYPES[name]


def cache_array(cache, name: str, dtype, ndim: int):
    """(the contiguous cache array, its C++ element type): ``dtype``'s own, or a quantized format."""
    cache = _checks.as_array(cache, name)
    _checks.check_ndim(cache, name, ndim)
    if not cache.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (got strides {cache.strides})")
    if cache.dtype == numpy.dtype(dtype):
        return cache, _build.ctype(dtype)
    if cache.dtype in KV_CTYPES:
        return cache, KV_CTYPES[cache.dtype]
    raise TypeError(f"{name} has dtype {cache.dtype}: expected {numpy.dtype(dtype)} (the inputs' dtype), "
                    "int8 or uint8 (fp8 e4m3)")


def check_scales(quantized: bool, cache, k_scale, v_scale):
    """k_scale, v_scale: float32 [B_cache, H, S_max] for a quantized cache, absent otherwise."""
    if not quantized:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale / v_scale belong to quantized caches; this cache holds {cache.dtype}")
        return None, None
    out = []
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None:
            raise ValueError(f"a {cache.dtype} cache needs {name} (float32 {cache.shape[:3]})")
        s = _checks.as_array(s, name)
        if s.dtype != numpy.float32 or not s.flags.c_contiguous:
            raise TypeError(f"{name} must be a contiguous float32 array, got {s.dtype}")
        _checks.check_shape(s, name, cache.shape[:3])
        out.append(s)
    return tuple(out)


def _row_strides(a, name: str) -> tuple[int, int]:
    """(batch, time) element strides of a [B, T, H, D] view whose H*D elements are contiguous."""
    B, T, H, D = a.shape
    item = a.itemsize
    if a.strides[3] != item or a.strides[2] != D * item:
        raise ValueError(f"{name} must be contiguous over (heads, head_dim), got strides {a.strides}")
    if a.strides[0] % item or a.strides[1] % item or a.strides[0] < 0 or a.strides[1] < 0:
        raise ValueError(f"{name} has unsupported strides {a.strides}")
    return a.strides[0] // item, a.strides[1] // item


def kv_append(k_cache, v_cache, k, v, start, *, slots=None, seq_lens=None, k_scale=None, v_scale=None) -> None:
    """Write k, v [B, T, H, D] into the caches [B_cache, H, S_max, D] at rows start[b]..start[b]+T-1.

    start: int32 [B]; slots: optional int32 [B] cache rows (default: b), where a negative
    slot writes nothing (a padding row); seq_lens: optional int32 [B], set to start + T.
    Positions are not checked on the GPU: callers keep start[b] + T <= S_max (the model checks
    lengths on the host).
    Caches in k's dtype take the rows as they are. int8 caches, and fp8 e4m3 caches stored
    as uint8, take each row of D elements quantized with its own scale max|x| / 127 (int8)
    or max|x| / 448 (fp8), written to k_scale / v_scale (float32 [B_cache, H, S_max]);
    D in {64, 128} then.
    """
    k = _checks.float_array(k, "k", ndim=4, contiguous=False)
    v = _checks.float_array(v, "v", ndim=4, contiguous=False)
    _checks.same_dtype(k, "k", v=v)
    (k_cache, kv_type), (v_cache, v_type) = (cache_array(c, n, k.dtype, ndim=4)
                                             for c, n in ((k_cache, "k_cache"), (v_cache, "v_cache")))
    if v_type != kv_type:
        raise TypeError(f"v_cache has dtype {v_cache.dtype} but k_cache has {k_cache.dtype}")
    _checks.check_shape(v_cache, "v_cache", k_cache.shape)
    quantized = kv_type in KV_CTYPES.values()
    k_scale, v_scale = check_scales(quantized, k_cache, k_scale, v_scale)
    _checks.check_shape(v, "v", k.shape)
    B, T, H, D = k.shape
    if (k_cache.shape[1], k_cache.shape[3]) != (H, D):
        raise ValueError(f"k_cache {k_cache.shape} does not hold {H} heads of dim {D}")
    if T > k_cache.shape[2]:
        raise ValueError(f"{T} new rows do not fit a cache of {k_cache.shape[2]} positions")
    start = _checks.int_array(start, "start", ndim=1)
    _checks.check_shape(start, "start", (B,))
    if slots is not None:
        slots = _checks.int_array(slots, "slots", ndim=1)
        _checks.check_shape(slots, "slots", (B,))
    elif B > k_cache.shape[0]:
        raise ValueError(f"{B} sequences but the cache holds {k_cache.shape[0]}")
    if seq_lens is not None:
        seq_lens = _checks.int_array(seq_lens, "seq_lens", ndim=1)
        _checks.check_shape(seq_lens, "seq_lens", (B,))
    if quantized and D not in QUANT_HEAD_DIMS:
        raise ValueError(f"a quantized cache needs head_dim in {QUANT_HEAD_DIMS}, got {D}")
    ks, vs = _row_strides(k, "k"), _row_strides(v, "v")
    if B * T == 0:
        return
    if quantized:
        kern = _build.kernel(_SRC, _quant_name(_build.ctype(k.dtype), kv_type, D))
        kern(
            (B * T,), (32 * min(H, 8),),
            (k_cache, v_cache, k_scale, v_scale, k, v, 0 if slots is None else slots, start,
             0 if seq_lens is None else seq_lens, i32(T), i32(H), i32(k_cache.shape[2]),
             i64(ks[0]), i64(ks[1]), i64(vs[0]), i64(vs[1])),
        )
        return
    item = k.itemsize
    aligned = all(a.data.ptr % 16 == 0 for a in (k, v)) and all((s * item) % 16 == 0 for s in (*ks, *vs, D))
    vec = _build.vec_widths(_build.ctype(k.dtype))[1] if aligned else 1
    kern = _build.kernel(_SRC, _name(_build.ctype(k.dtype), vec))
    kern(
        (B * T,), (_build.row_threads(H * D, vec),),
        (k_cache, v_cache, k, v, 0 if slots is None else slots, start, 0 if seq_lens is None else seq_lens,
         i32(T), i32(H), i32(D), i32(k_cache.shape[2]), i64(ks[0]), i64(ks[1]), i64(vs[0]), i64(vs[1])),
    )


def kv_advance(positions, n: int = 1) -> None:
    """``positions += n`` on the GPU (int32 [B]): moves a decode step to the next token."""
    positions = _checks.int_array(positions, "positions", ndim=1)
    if positions.shape[0]:
        kern = _build.kernel(_SRC, "kv_advance_kernel")
        kern((_build.cdiv(positions.shape[0], 128),), (128,), (positions, i32(n), i32(positions.shape[0])))
