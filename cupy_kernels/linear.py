"""Matrix-vector products for a few rows (decode step, LM head), no cuBLAS, with the
element-wise work around them fused in: LayerNorm before, bias / GELU / residual add /
argmax after.

Kernel: ``src_cu/linear.cu`` (and ``argmax_partials_kernel`` in ``src_cu/sampling.cu``).
Tests: ``tests/test_kernels_gpu.py``. Benchmark: ``benchmarks/decode_step.py``.
"""

from __future__ import annotations

import math

import cupy
import numpy

from . import _build, _checks
from ._build import f32, i32

_SRC = "linear.cu"
_EPI = {"store": 0, "gelu": 1, "residual": 2, "argmax": 3, "qkv_cache": 4}
# rows of x per pass over W (BR); B = 2, 3 run with zero rows, B > 4 in passes of 4 (W is
# re-read, mostly from L2). 8 rows a pass held up to 250 registers (one block an SM) and
# took 40 us for GPT-2's qkv at B = 8 on the H100, against 3.4 MB of weights.
BATCH_ROWS = (1, 4)
# (RW rows of W a warp works on at once, U 16-byte loads per row and lane in flight; the next
# U are requested once these are used). Which one a shape gets: _tile.
TILES = ((2, 4), (4, 2), (1, 8))
WARPS = (4, 8)
_SCALAR_TILE = (1, 8)  # the unaligned (element-wise) path
LN_CHUNKS = 2  # linear.cu: a LayerNorm row is at most LN_CHUNKS vectors per thread


def _name(c_type: str, out_type: str, vec: int, tile: tuple[int, int], br: int, ln: bool, epi: str) -> str:
    rw, u = tile
    return (f"linear_kernel<{c_type}, {out_type}, {vec}, {rw}, {u}, {br}, {'true' if ln else 'false'}, "
            f"{_EPI[epi]}>")


def _variants(c_type: str):
    """(out type, LayerNorm prologue, epilogue) of every declared specialization."""
    own = [(c_type, ln, epi) for ln, epi in ((False, "store"), (False, "gelu"), (False, "residual"),
                                             (True, "store"), (True, "gelu"), (True, "qkv_cache"))]
    logits = [("float", ln, epi) for ln in (False, True) for epi in ("store", "argmax")]
    return list(dict.fromkeys(own + logits))


_build.declare(
    _SRC,
    [
        _name(c, o, vec, tile, br, ln, epi)
        for c in _build.CTYPES.values()
        for o, ln, epi in _variants(c)
        for vec in _build.vec_widths(c)
        for tile in (TILES if vec > 1 else (_SCALAR_TILE,))
        for br in BATCH_ROWS
    ],
    pdl=True,
)
_ARGMAX_SRC = "sampling.cu"
_ARGMAX_NAME = "argmax_partials_kernel"
_build.declare(_ARGMAX_SRC, [_ARGMAX_NAME], pdl=True)
_ARGMAX_THREADS = 256  # sampling.cu's ARGMAX_PARTIALS_THREADS


def linear_tiles() -> tuple[tuple[int, int], ...]:
    """The (rows of W per warp, loads in flight per row and lane) shapes ``tile=`` takes."""
    return TILES


def _tile(N: int, K: int, itemsize: int) -> tuple[tuple[int, int], int]:
    """((RW, U), warps per block) for a weight [N, K]; never depends on the batch.

    Measured on an H100 (benchmarks/decode_step.py, float16, B = 1, launches back to back
    in a CUDA graph with programmatic dependent launch): 2 rows x 4 loads in blocks of 4
    warps was the fastest tile or within 8% of it on every weight of GPT-2 small and XL
    (small: qkv 2.18 us, attn_proj 1.45, fc 2.47, mlp_proj 4.27, LM head 27.8); 4 rows x 2
    loads lost up to 40%, 1 row x 8 loads up to 85% (attn_proj). 4-warp blocks rather
    than 8 keep the LayerNorm-prologue kernels, which hold more registers, in one wave.
    The LM head (N >= 16384) runs in many waves, and each block pays the LayerNorm
    prologue once: 4 rows x 2 loads in 8-warp blocks (a quarter of the blocks) measured
    the same without the prologue (28.0 against 27.8 us); with it, the LM head takes
    60.5 us in the step (benchmarks/results/decode_step-h100.json)."""
    if N >= 16384:
        return (4, 2), 8
    return (2, 4), 4


def _batch_rows(B: int, K: int) -> int:
    """Rows of x per pass: the smallest of BATCH_ROWS covering B (at most 4), as many as
    the device's shared memory holds at K float32 values a row."""
    limit = _build.smem_optin()
    fits = [br for br in BATCH_ROWS if br * K * 4 <= limit]
    if not fits:
        raise ValueError(f"x rows of {K} features exceed this GPU's shared memory ({limit // 4} float32 values)")
    want = [br for br in fits if br >= min(B, BATCH_ROWS[-1])]
    return want[0] if want else fits[-1]


def _overlaps(a: cupy.ndarray, b: cupy.ndarray) -> bool:
    a0, b0 = a.data.ptr, b.data.ptr
    return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes


def _prepare(x, weight, bias, ln):
    """Checked (x, weight, bias, ln as (w, b, eps) or None) and the sizes B, N, K."""
    x = _checks.float_array(x, "x", ndim=2)
    weight = _checks.float_array(weight, "weight", ndim=2)
    _checks.same_dtype(x, "x", weight=weight)
    B, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"weight has {weight.shape[1]} input features but x has {K}")
    if bias is not None:
        bias = _checks.float_array(bias, "bias", ndim=1)
        _checks.same_dtype(x, "x", bias=bias)
        _checks.check_shape(bias, "bias", (N,))
    if ln is not None:
        if not (isinstance(ln, (tuple, list)) and len(ln) == 3):
            raise TypeError("ln must be a tuple (weight, bias, eps) of the LayerNorm applied to x")
        ln_w, ln_b, eps = ln
        ln_w = _checks.float_array(ln_w, "ln weight", ndim=1)
        ln_b = _checks.float_array(ln_b, "ln bias", ndim=1)
        _checks.same_dtype(x, "x", **{"ln weight": ln_w, "ln bias": ln_b})
        _checks.check_shape(ln_w, "ln weight", (K,))
        _checks.check_shape(ln_b, "ln bias", (K,))
        if not (isinstance(eps, (int, float, numpy.floating)) and math.isfinite(eps) and eps >= 0):
            raise ValueError(f"ln eps must be a finite number >= 0, got {eps!r}")
        ln = (ln_w, ln_b, float(eps))
    return x, weight, bias, ln, B, N, K


def _geometry(x, weight, N: int, K: int, tile, warps, ln: bool):
    """(vector width, tile, warps per block) of a launch. The tile never changes the
    numbers; the block width (warps) follows the shape alone, so neither does that."""
    dflt_tile, dflt_warps = _tile(N, K, x.dtype.itemsize)
    tile, warps = tuple(tile or dflt_tile), warps or dflt_warps
    vec = _checks.vec_width(x.dtype, K, x, weight)
    if vec == 1:
        tile = _SCALAR_TILE
    if ln and _build.cdiv(K // vec, 32 * warps) > LN_CHUNKS:  # the LayerNorm row in one round of loads
        warps = WARPS[-1]
    return vec, tile, warps


def _grid(N: int, tile, warps: int) -> int:
    """Blocks: one per ``warps`` row groups of ``tile[0]`` rows. (Capping the LM head at the
    blocks the GPU holds at once, each warp then walking many row groups, measured 97 us
    against 68 for GPT-2 small in the step on the H100: one row group's loads at a time
    per warp do not cover the latency.)"""
    return max(1, _build.cdiv(_build.cdiv(N, tile[0]), warps))


def _launch(x, weight, bias, ln, res, out, part, kv, out_type, epi, B, N, K, tile, warps):
    """Launches linear_kernel; returns its number of blocks and the argmax partials, made by
    ``part(blocks)`` when given."""
    ln_w, ln_b, eps = ln if ln is not None else (None, None, 0.0)
    vec, tile, warps = _geometry(x, weight, N, K, tile, warps, ln is not None)
    br = _batch_rows(B, K)
    kern = _build.kernel(_SRC, _name(_build.ctype(x.dtype), out_type, vec, tile, br, ln is not None, epi))
    smem = br * K * 4
    _build.set_smem(kern, smem)
    blocks = _grid(N, tile, warps)
    if part is not None:
        part = part(blocks)
    null = 0
    k_cache, v_cache, positions, seq_lens, H, S_max = kv if kv is not None else (null, null, null, null, 0, 0)
    kern((blocks,), (32 * warps,),
         (null if out is None else out, x, weight, null if bias is None else bias,
          null if ln_w is None else ln_w, null if ln_b is None else ln_b, f32(eps),
          null if res is None else res, null if part is None else part[0], null if part is None else part[1],
          k_cache, v_cache, positions, seq_lens, i32(H), i32(S_max), i32(B), i32(N), i32(K)), shared_mem=smem)
    return blocks, part


def _check_tile(tile, warps):
    if tile is not None and tuple(tile) not in TILES:
        raise ValueError(f"tile must be one of {TILES}, got {tile!r}")
    if warps is not None and warps not in WARPS:
        raise ValueError(f"warps must be one of {WARPS}, got {warps!r}")


def _check_kv(kv_cache, x, B: int, N: int):
    """(k_cache, v_cache, positions, seq_lens, H, S_max) of a ``kv_cache=`` argument."""
    if not isinstance(kv_cache, dict) or set(kv_cache) != {"k_cache", "v_cache", "positions", "seq_lens"}:
        raise TypeError("kv_cache must be a dict with k_cache, v_cache, positions and seq_lens")
    if N % 3:
        raise ValueError(f"with kv_cache, weight must have 3 C output features (q, k, v), got {N}")
    caches = []
    for name in ("k_cache", "v_cache"):
        c = _checks.as_array(kv_cache[name], name)
        if c.dtype != x.dtype:
            raise TypeError(f"{name} has dtype {c.dtype}: the fused append writes x's dtype {x.dtype} "
                            "(quantized caches take kv_append)")
        _checks.check_ndim(c, name, 4)
        if not c.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous")
        if c.shape[0] < B or c.shape[1] * c.shape[3] != N // 3:
            raise ValueError(f"{name} has shape {c.shape}: expected [>= {B}, H, S_max, D] with H * D = {N // 3}")
        caches.append(c)
    if caches[0].shape != caches[1].shape:
        raise ValueError(f"k_cache {caches[0].shape} and v_cache {caches[1].shape} differ")
    idx = [_checks.int_array(kv_cache[name], name, ndim=1) for name in ("positions", "seq_lens")]
    for name, a in zip(("positions", "seq_lens"), idx):
        _checks.check_shape(a, name, (B,))
    _, H, S_max, _ = caches[0].shape
    return (*caches, *idx, H, S_max)


def linear(x, weight, bias=None, *, gelu: bool = False, ln=None, residual=None, kv_cache=None, out_dtype=None,
           out=None, tile=None, warps=None) -> cupy.ndarray:
    """``y = act(norm(x) @ weight.T + bias)``, for a few rows of x.

    x: [B, K] contiguous; weight: [N, K] (out, in) contiguous; bias: [N] or None.
    ``ln=(w, b, eps)``: x is LayerNorm-ed first (w, b: [K]; the normalized rows are rounded
    to x's dtype, as a separate LayerNorm would store them). ``gelu``: GELU (tanh form).
    ``residual`` [B, N]: ``y = residual + round(x @ weight.T) + bias`` in float32, rounded
    once (the residual add of a GPT-2 block); ``out`` may be ``residual`` itself.
    ``kv_cache=dict(k_cache, v_cache, positions, seq_lens)``: y is a fused q|k|v row
    (N = 3 H D); its k and v parts are also written into the caches [>= B, H, S_max, D] (x's
    dtype) at row ``positions[b]`` (int32 [B], not checked on the GPU), and ``seq_lens[b]``
    becomes ``positions[b] + 1``: what :func:`kv_append` does, without its launch.
    float32 accumulation; an output's summation order depends only on K, so a row gives
    the same bits alone or in a batch, whatever the launch shape. ``out_dtype`` may be float32 when x is half precision (logits). ``tile`` /
    ``warps`` override the launch shape (TILES, WARPS).
    """
    x, weight, bias, ln, B, N, K = _prepare(x, weight, bias, ln)
    _check_tile(tile, warps)
    out_dtype = numpy.dtype(x.dtype if out_dtype is None else out_dtype)
    if out_dtype not in (x.dtype, numpy.dtype(numpy.float32)):
        raise TypeError(f"out_dtype must be {x.dtype} or float32, got {out_dtype}")
    if sum(a is not None and a is not False for a in (gelu, residual, kv_cache)) > 1:
        raise ValueError("gelu, residual and kv_cache exclude each other")
    if residual is not None:
        residual = _checks.float_array(residual, "residual", ndim=2)
        _checks.same_dtype(x, "x", residual=residual)
        _checks.check_shape(residual, "residual", (B, N))
    if (residual is not None or kv_cache is not None) and out_dtype != x.dtype:
        raise TypeError(f"with a residual or kv_cache, out_dtype must be x's dtype {x.dtype}")
    kv = None
    if kv_cache is not None:
        if ln is None:
            raise ValueError("kv_cache is fused with the LayerNorm prologue: pass ln too")
        kv = _check_kv(kv_cache, x, B, N)
    out = _checks.output(out, "out", (B, N), out_dtype)
    if _overlaps(out, x) and B and N and K:
        raise ValueError("out must not overlap x (x is read by every block while outputs are written)")
    if residual is not None and _overlaps(out, residual) and out.data.ptr != residual.data.ptr:
        raise ValueError("out must be residual itself or not overlap it")
    if B == 0 or N == 0:
        return out
    if K == 0:
        raise ValueError("x has no features (K = 0)")
    epi = "residual" if residual is not None else "qkv_cache" if kv is not None else "gelu" if gelu else "store"
    _launch(x, weight, bias, ln, residual, out, None, kv, _build.ctype(out_dtype), epi, B, N, K, tile, warps)
    return out


def linear_argmax(x, weight, bias=None, *, ln=None, logits=None, out=None, tile=None, warps=None) -> cupy.ndarray:
    """Greedy next tokens: int32 [B], the first index of each row's largest value of
    ``norm(x) @ weight.T + bias`` (arguments as :func:`linear`), without a second pass
    over the logits: each block of the product reduces its own outputs, then one small
    kernel reduces the blocks' results. ``logits`` (float32 [B, N]) receives the logits
    when given; otherwise they are never written.
    """
    x, weight, bias, ln, B, N, K = _prepare(x, weight, bias, ln)
    _check_tile(tile, warps)
    if logits is not None:
        logits = _checks.output(logits, "logits", (B, N), numpy.float32)
    out = _checks.output(out, "out", (B,), numpy.int32)
    if B == 0:
        return out
    if N == 0 or K == 0:
        raise ValueError(f"argmax over an empty product (N = {N}, K = {K})")
    blocks, part = _launch(x, weight, bias, ln, None, logits, lambda blocks: (
        cupy.empty((B, blocks), dtype=numpy.float32), cupy.empty((B, blocks), dtype=numpy.int32)),
        None, "float", "argmax", B, N, K, tile, warps)
    kern = _build.kernel(_ARGMAX_SRC, _ARGMAX_NAME)
    kern((B,), (_ARGMAX_THREADS,), (out, part[0], part[1], i32(blocks)))
    return out
