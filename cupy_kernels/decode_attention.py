"""Decoding attention: one new query per sequence and head against the KV cache, with
GQA / MQA, optional ALiBi, int8 / fp8 caches and a split over long caches.

Kernel: ``src_cu/decode_attention.cu``. Tests: ``tests/test_decode_attention_gpu.py``.
Benchmark: ``benchmarks/decode_attention.py``.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import cupy
import numpy

from . import _build, _checks
from ._build import f32, i32, i64
from .kv_cache import KV_CTYPES, cache_array, check_scales

_SRC = "decode_attention.cu"
HEAD_DIMS = (64, 128)
_THREADS = 128
# Wide blocks (512 threads: four times the rows in flight, combined in shared memory rather
# than by a merge of splits) for caches in the model's dtype. When the batch has at most one
# block per SM: for grouped heads (4 per block), for caches a wide block covers in
# _WIDE_UNSPLIT_TRIPS trips ... Measured on an H100, fp16, cold L2 (128 / 512 threads, best
# split each): 32 heads x hd128 B=1 S=128 7.95 / 6.90 us, S=256 9.54 / 8.03, S=512 11.42 /
# 10.37 (torch SDPA 7.87, 10.18, 12.06); 32 / 8 heads, 4 per block, S=32768 77.9 / 63.5 and
# B=2 S=4096 31.7 / 24.9. Beyond two trips a split of narrow blocks is as fast cold and
# faster in a replayed graph (GPT-2 B=1 S=1024: 9.31 / 9.57 us cold, 4.55 / 5.52 in a graph).
_WIDE = 512
_WIDE_UNSPLIT_TRIPS = 2
# ... and when narrow blocks would split into at most this many chunks: the merge then
# costs more than the chunks gain (32 x hd128, B=4, S=4096: 4 narrow splits 104.4 us, one
# wide block 101.4; torch SDPA 101.6-102.5).
_WIDE_BELOW_SPLITS = 4
# With more blocks than SMs, wide blocks for caches of at least this many wide trips: the
# SM then streams one head's rows rather than four heads' (both 16 warps per SM). H100,
# fp16, cold L2, 32 x hd128 at S=4096 (32 trips), 128 / 512 threads, torch SDPA: B=8
# 187.4 / 187.3 / 189.9 us, B=16 361.6 / 357.5 / 363.0, B=32 706.9 / 696.5 / 710.1, B=64
# 1401.0 / 1383.2 / 1399.4, B=128 2783.3 / 2737.4 / 2764.0. At 4 trips they tie (GPT-2,
# B=64, S=1024: 80.3 / 80.0) and at 1 narrow blocks win (32 x hd128, B=16, S=128: 20.1 /
# 23.5): the threshold lies between the tie and the measured wins.
_WIDE_BATCH_TRIPS = 8
_UNROLL = 4  # decode_attention.cu
_QPB = (4, 2, 1)  # query heads per block that share one K/V row
# Grouped heads: the query heads of a KV head share a block (each K/V row read once) from
# this many cached rows in the batch (B x S_max) on; below, one query head per block, whose
# neighbours find the rows in L2. H100, fp16, 32 / 8 heads x hd128 (1 / 4 per block, best
# configuration each): B=1 S=4096 16.9 / 17.5 us, S=8192 26.5 / 25.1, S=32768 71.9 / 63.5;
# B=2 S=4096 26.0 / 24.9; B=1 S=1024 10.5 / 12.4.
_SHARED_ROWS = 8192
_MAX_SPLITS = 128
# Blocks of an L2 warm-up (warm=): 128 of 128 threads with 8 16-byte words in flight a thread
# hold 2 MiB in flight in all. H100, the decode step of GPT-2 large and XL float16 at batch 1
# with PDL, the MLP up's weight past its first batch warmed (512 replays from 8 cached keys, us
# a step; an earlier form of the kernel, branch l2-warm): 64 / 128 blocks, large 1057.3 / 959.0
# against 1010.4 unwarmed, XL 1926.1 / 1695.2 against 1597.2 (benchmarks/results/
# l2_warm_blocks-h100.log); in another run 128 / 256, large 959.8 / 1037.5 against 1010.9, XL
# 1695.0 / 1747.1 against 1596.1 (l2_warm_mlp_up-h100.log).
WARM_BLOCKS = 128
_MAX_WARM_BLOCKS = 1024
# Blocks of 128 threads per SM the split aims for. Measured on an H100 (fp16, hd128, 128
# threads, one query head per block, up to 9 resident): at B=1, 32 heads, S=32768, 16
# splits (3.9 blocks / SM) took 193.6 us, 32 splits 192.3 us, 38 splits (one full wave + a
# ragged second: the old "fill every slot" rule) 213 us, 64 splits 196 us; at S=4096 16 and
# 32 splits tied (38 us) and 64 lost (40 us); GPT-2 (12 x hd64) at S=1024 was fastest at 8-16.
_BLOCKS_PER_SM = 4
# A cache of at most this many loop trips is not split: the splits' merge costs more than
# the trips it saves. On an H100, cold L2, fp16 (decode_attention.cu pipelines trips):
# 32 heads x hd128 (32-key trips) at S=128: 1 split 7.79 us, 4 splits 8.38; at B=4 9.57 /
# 11.52; GPT-2 (12 x hd64, 64-key trips) at S=256: 1 split 7.39, 4 splits 7.87; at S=512
# (8 trips) 1 split 9.70, 8 splits 8.35. Nor is a batch with a block for every SM: 32 heads
# x hd128, B=8, S=4096 took 187.4 us unsplit and 190.9 with 2 splits.
_UNSPLIT_TRIPS = 4


# Sets of loop trips a block keeps in flight ahead (attend's AHEAD): 1, or AHEAD_DEEP for one query head
# per block of 128 threads on 16-bit rows in q's dtype (the same bits; decode_attention.cuh,
# attend's AHEAD, has the measurements; the decode step picks it per model and batch).
AHEAD_DEEP = 4


def _name(c_type: str, kv_type: str, head_dim: int, qpb: int, threads: int, ahead: int = 1) -> str:
    return f"decode_attention_kernel<{c_type}, {kv_type}, {head_dim}, {qpb}, {threads}, {ahead}>"


def _merge_name(c_type: str, head_dim: int) -> str:
    return f"decode_attention_merge_kernel<{c_type}, {head_dim}>"


_build.declare(
    _SRC,
    [
        _name(c, kv, d, qpb, _THREADS)
        for c, d, qpb in itertools.product(_build.CTYPES.values(), HEAD_DIMS, _QPB)
        for kv in (c, *KV_CTYPES.values())
    ]
    + [_name(c, c, d, qpb, _WIDE) for c, d, qpb in itertools.product(_build.CTYPES.values(), HEAD_DIMS, _QPB)]
    + [_name(c, c, d, 1, _THREADS, AHEAD_DEEP) for c, d in itertools.product(("__half", "__nv_bfloat16"), HEAD_DIMS)]
    + [_merge_name(c, d) for c, d in itertools.product(_build.CTYPES.values(), HEAD_DIMS)],
    pdl=True,
)


def _tile(kv_itemsize: int, head_dim: int, threads: int = _THREADS) -> int:
    """Keys per loop trip of one block: (threads / lanes per key row) groups x UNROLL."""
    lanes = head_dim // (16 // kv_itemsize)
    return threads // lanes * _UNROLL


@functools.cache
def _resident_blocks(kern_ptr: int, threads: int) -> int:
    from cupy_backends.cuda.api import driver

    return max(1, driver.occupancyMaxActiveBlocksPerMultiprocessor(kern_ptr, threads, 0))


def choose_splits(kern, blocks: int, max_len: int, tile: int, threads: int = _THREADS) -> int:
    """Chunks per sequence: as many as keep ``blocks`` (sequences x head groups) x splits
    within one wave of _BLOCKS_PER_SM blocks of 128 threads per SM (or fewer if fewer
    fit), never a chunk shorter than one loop trip of ``tile`` keys. Batches with a block
    for every SM and short caches (at most _UNSPLIT_TRIPS trips) stay unsplit."""
    trips = _build.cdiv(max_len, tile)
    sms = _build.sm_count(cupy.cuda.Device().id)
    if trips <= _UNSPLIT_TRIPS or blocks >= sms:
        return 1
    raw = getattr(kern, "raw", kern)
    per_sm = min(max(1, _BLOCKS_PER_SM * _THREADS // threads), _resident_blocks(raw.kernel.ptr, threads))
    return max(1, min(sms * per_sm // blocks, trips, _MAX_SPLITS))


class Launch(NamedTuple):
    kernel: object
    blocks: int   # blocks per sequence (query head groups)
    splits: int   # chunks per sequence
    threads: int  # per block


def launch_config(dtype, cache_dtype, B: int, H: int, H_kv: int, D: int, S_max: int) -> Launch:
    """What decode_attention launches for these sizes."""
    c_type = _build.ctype(dtype)
    plain = numpy.dtype(cache_dtype) == numpy.dtype(dtype)
    kv_type = c_type if plain else KV_CTYPES[numpy.dtype(cache_dtype)]
    group = H // H_kv
    qpb = next(n for n in _QPB if group % n == 0) if B * S_max >= _SHARED_ROWS else 1
    blocks, units = H // qpb, B * H // qpb
    itemsize = numpy.dtype(cache_dtype).itemsize

    def config(threads: int) -> Launch:
        kern = _build.kernel(_SRC, _name(c_type, kv_type, D, qpb, threads))
        return Launch(kern, blocks, choose_splits(kern, units, S_max, _tile(itemsize, D, threads), threads), threads)

    narrow = config(_THREADS)
    if not plain:
        return narrow
    wide_trips = _build.cdiv(S_max, _tile(itemsize, D, _WIDE))
    if units > _build.sm_count(cupy.cuda.Device().id):
        return config(_WIDE) if wide_trips >= _WIDE_BATCH_TRIPS else narrow
    if qpb > 1 or wide_trips <= _WIDE_UNSPLIT_TRIPS or narrow.splits <= _WIDE_BELOW_SPLITS:
        return config(_WIDE)
    return narrow


_COUNTERS: dict[tuple[int, int], cupy.ndarray] = {}
_SCRATCH: dict[tuple[int, int], cupy.ndarray] = {}


def _stream_buffer(cache: dict, n: int, dtype, zeroed: bool) -> cupy.ndarray:
    """At least n elements of a buffer kept per (device, current stream): launches on one
    stream run one after another, so they can share it, and no call allocates once it
    has grown (an allocation inside the call could make the host wait for the GPU)."""
    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
    buf = cache.get(key)
    if buf is None or buf.size < n:
        size = max(n, 1024, 0 if buf is None else 2 * buf.size)
        buf = cache[key] = cupy.zeros(size, dtype) if zeroed else cupy.empty(size, dtype)
    return buf


def _counters(n: int) -> cupy.ndarray:
    """n zeroed uint32 counters for the last-block merge; each launch leaves them zero."""
    return _stream_buffer(_COUNTERS, n, numpy.uint32, zeroed=True)[:n]


def _partials(splits: int, B: int, H: int, D: int) -> tuple[cupy.ndarray, cupy.ndarray]:
    """Scratch for the splits' outputs [splits, B, H, D] and log2-sum-exps [splits, B, H]."""
    n = splits * B * H
    buf = _stream_buffer(_SCRATCH, n * (D + 1), numpy.float32, zeroed=False)
    return buf[: n * D].reshape(splits, B, H, D), buf[n * D : n * (D + 1)].reshape(splits, B, H)


def _or_null(*arrays):
    return tuple(0 if a is None else a for a in arrays)


def decode_attention(q, k_cache, v_cache, seq_lens, *, k_scale=None, v_scale=None, alibi_slopes=None,
                     scale: float | None = None, num_splits: int | None = None, split_keys: int | None = None,
                     threads: int | None = None, merge: str = "last-block", appended=None, ahead: int = 1,
                     warm=None, warm_blocks: int = WARM_BLOCKS, prefetch=None, out=None) -> cupy.ndarray:
    """``softmax(q . K[:len] * scale + alibi) V[:len]`` for each sequence and query head.

    q: [B, H, D], contiguous over (H, D) (a row of the fused qkv buffer qualifies; the batch
    stride is free). k_cache, v_cache: contiguous [B_cache >= B, H_kv, S_max, D] with H_kv
    dividing H (query head h reads KV head h // (H / H_kv): MHA, GQA, MQA), in q's dtype,
    or quantized: int8, or float8 e4m3 stored as uint8, then with k_scale / v_scale float32
    [B_cache, H_kv, S_max], one scale per row (kv_append writes them). seq_lens: int32 [B],
    the valid cache rows of each sequence (1 <= len <= S_max, not checked on the GPU).
    alibi_slopes: optional float32 [H]; adds slope_h * (s - len + 1) to the score of key s.
    D in {64, 128}. num_splits: chunks per sequence, 1 to 128; threads: per block, 128 or
    512 (512 for caches in q's dtype only); both chosen from B, heads, S_max and the GPU's
    SM count by default (launch_config). Fixing them fixes the order of every sum, so a
    sequence's output does not depend on the batch around it. split_keys (instead of
    num_splits): a sequence of len keys takes ceil(len / split_keys) equal chunks (its
    numbers follow its own length, whatever the batch and S_max), so one of at most
    split_keys keys is one block that writes its output with nothing to merge; the merge is
    then the last block's. merge: how split chunks are
    combined: 'last-block' (the last block of a head to finish merges them, one launch) or
    'kernel' (a second small kernel; inside a replayed CUDA graph, where a launch costs
    less, measured 0.4-0.5 us faster per call on an H100 for B=1, S=1024 with GPT-2's heads
    and with 32 x hd128; slower outside one, where the second launch is not hidden).
    Replayed with programmatic dependent launch (a recorded decode step), the kernel requests
    each sequence's first keys before the kernel ahead of it has finished: that kernel may
    append row len - 1 (read again once it has), not rewrite earlier rows. appended: (k, v),
    each [B, H_kv, D] in q's dtype with q's strides but over H_kv heads (k and v of the fused
    qkv buffer qualify), caches in q's dtype only: the row each sequence's cache holds at len
    - 1, as the kernel ahead wrote it; read then with q and the lengths instead of from the
    cache once the lengths are known (the same numbers, one memory round trip less).
    ahead: sets of loop trips a block keeps in flight ahead, 1 or AHEAD_DEEP (4: the 4 trips
    past the first requested at once, each set refilled once used; float16 or bfloat16
    caches in q's dtype, one query head per block of 128 threads); the same numbers either way.
    warm: None, or a contiguous array of a multiple of 16 bytes from a 16-byte boundary (a
    weight a later kernel reads): ``warm_blocks`` extra blocks read its bytes into L2 once the
    kernel ahead has finished (a bounded number of bytes in flight: 8 16-byte words a thread),
    and the kernel ends once they are done; it changes no number.
    prefetch: None, or int32 [B], the cache row the kernel ahead appends for each sequence (a
    decode step's positions: seq_lens is then that row + 1): before its wait, each block
    requests its chunk's rows below that row into L2, so that its loop finds them there; it
    changes no number (a wrong position only costs bytes).
    Returns [B, H, D] in q's dtype.
    """
    q = _checks.float_array(q, "q", ndim=3, contiguous=False)
    B, H, D = q.shape
    if D not in HEAD_DIMS:
        raise ValueError(f"head_dim {D} is not supported; supported: {HEAD_DIMS}")
    (k_cache, kv_type), (v_cache, v_type) = (cache_array(c, n, q.dtype, ndim=4)
                                             for c, n in ((k_cache, "k_cache"), (v_cache, "v_cache")))
    if v_type != kv_type:
        raise TypeError(f"v_cache has dtype {v_cache.dtype} but k_cache has {k_cache.dtype}")
    _checks.check_shape(v_cache, "v_cache", k_cache.shape)
    B_cache, H_kv, S_max, D_cache = k_cache.shape
    if D_cache != D or B_cache < B:
        raise ValueError(f"k_cache {k_cache.shape} does not match q {q.shape}")
    if H_kv == 0 or H % H_kv:
        raise ValueError(f"the cache's {H_kv} KV heads must divide the {H} query heads")
    quantized = kv_type in KV_CTYPES.values()
    k_scale, v_scale = check_scales(quantized, k_cache, k_scale, v_scale)
    seq_lens = _checks.int_array(seq_lens, "seq_lens", ndim=1)
    _checks.check_shape(seq_lens, "seq_lens", (B,))
    if prefetch is not None:
        prefetch = _checks.int_array(prefetch, "prefetch", ndim=1)
        _checks.check_shape(prefetch, "prefetch", (B,))
    if alibi_slopes is not None:
        alibi_slopes = _checks.as_array(alibi_slopes, "alibi_slopes")
        if alibi_slopes.dtype != numpy.float32 or not alibi_slopes.flags.c_contiguous:
            raise TypeError(f"alibi_slopes must be a contiguous float32 array, got {alibi_slopes.dtype}")
        _checks.check_shape(alibi_slopes, "alibi_slopes", (H,))
    item = q.itemsize
    if q.strides[2] != item or q.strides[1] != D * item:
        raise ValueError(f"q must be contiguous over (heads, head_dim), got strides {q.strides}")
    if q.strides[0] % 16 or q.data.ptr % 16:
        raise ValueError("q rows must start on 16-byte boundaries")
    if num_splits is not None and not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {_MAX_SPLITS}], got {num_splits}")
    if split_keys is not None:
        if num_splits is not None:
            raise ValueError("pass num_splits or split_keys, not both")
        if (not isinstance(split_keys, (int, numpy.integer)) or split_keys < 1
                or _build.cdiv(S_max, split_keys) > _MAX_SPLITS):
            raise ValueError(f"split_keys must be an integer >= {_build.cdiv(S_max, _MAX_SPLITS)} (at most "
                             f"{_MAX_SPLITS} chunks of a cache of {S_max} rows), got {split_keys!r}")
        if merge != "last-block":
            raise ValueError("split_keys merges in the last block of a sequence: merge must be 'last-block'")
    if threads is not None and threads not in (_THREADS, _WIDE):
        raise ValueError(f"threads must be {_THREADS} or {_WIDE}, got {threads}")
    if threads == _WIDE and quantized:
        raise ValueError(f"{_WIDE} threads per block take a cache in q's dtype, not {k_cache.dtype}")
    if ahead not in (1, AHEAD_DEEP):
        raise ValueError(f"ahead must be 1 or {AHEAD_DEEP}, got {ahead!r}")
    if ahead != 1 and (quantized or q.dtype == numpy.float32):
        raise ValueError(f"{ahead} trips ahead take a float16 or bfloat16 cache in q's dtype, not {k_cache.dtype} "
                         f"with q {q.dtype}")
    if merge not in ("last-block", "kernel"):
        raise ValueError(f"merge must be 'last-block' or 'kernel', got {merge!r}")
    k_new = v_new = None
    if appended is not None:
        if quantized:
            raise ValueError(f"appended rows take a cache in q's dtype, not {k_cache.dtype}")
        if not isinstance(appended, (tuple, list)) or len(appended) != 2:
            raise TypeError("appended must be a pair (k, v) of arrays")
        k_new, v_new = (_checks.float_array(a, n, ndim=3, contiguous=False)
                        for a, n in zip(appended, ("appended k", "appended v")))
        _checks.same_dtype(q, "q", **{"appended k": k_new, "appended v": v_new})
        for a, n in ((k_new, "appended k"), (v_new, "appended v")):
            _checks.check_shape(a, n, (B, H_kv, D))
            if a.strides != (q.strides[0], D * item, item) or a.data.ptr % 16:
                raise ValueError(f"{n} must have q's batch stride and be contiguous over (KV heads, head_dim) from a "
                                 f"16-byte boundary, got strides {a.strides}")
    if warm is not None:
        warm = _checks.as_array(warm, "warm")
        if not warm.flags.c_contiguous or warm.data.ptr % 16 or warm.nbytes % 16:
            raise ValueError(f"warm must be a contiguous array of a multiple of 16 bytes from a 16-byte boundary, "
                             f"got {warm.nbytes} bytes at address {warm.data.ptr:#x} (contiguous: "
                             f"{warm.flags.c_contiguous})")
    if (not isinstance(warm_blocks, (int, numpy.integer)) or isinstance(warm_blocks, bool)
            or not 1 <= warm_blocks <= _MAX_WARM_BLOCKS):
        raise ValueError(f"warm_blocks must be an integer in [1, {_MAX_WARM_BLOCKS}], got {warm_blocks!r}")
    out = _checks.output(out, "out", (B, H, D), q.dtype)
    if B == 0 or H == 0:
        return out
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kern, blocks, splits, auto_threads = launch_config(q.dtype, k_cache.dtype, B, H, H_kv, D, S_max)
    splits = _build.cdiv(S_max, split_keys) if split_keys is not None else num_splits or splits
    threads = threads or auto_threads
    if ahead != 1 and (threads != _THREADS or blocks != H):
        raise ValueError(f"{ahead} trips ahead take one query head per block of {_THREADS} threads, not "
                         f"{H // blocks} per block of {threads}")
    if threads != auto_threads or ahead != 1:
        kern = _build.kernel(_SRC, _name(_build.ctype(q.dtype), kv_type, D, H // blocks, threads, ahead))
    part_o = part_lse = counters = None
    if splits > 1:  # scratch; a recorded plan's arguments keep it alive
        part_o, part_lse = _partials(splits, B, H, D)
        if merge == "last-block":
            counters = _counters(B * blocks)
    warm_words = 0 if warm is None else warm.nbytes // 16
    extra = warm_blocks if warm_words else 0
    kern((blocks + extra, B, splits), (threads,),
         (out, *_or_null(part_o, part_lse, counters), q, *_or_null(k_new, v_new), k_cache, v_cache,
          *_or_null(k_scale, v_scale), seq_lens,
          *_or_null(alibi_slopes),
          i32(H), i32(H_kv), i32(S_max), i64(q.strides[0] // item), f32(scale), i32(split_keys or 0),
          warm if warm_words else 0, i64(warm_words), i32(extra), *_or_null(prefetch)))
    if splits > 1 and merge == "kernel":
        merge_kern = _build.kernel(_SRC, _merge_name(_build.ctype(q.dtype), D))
        merge_kern((B * H,), (D,), (out, part_o, part_lse, i32(B * H), i32(splits)))
    return out

