"""Products for a few to a few hundred rows of x (decode step, LM head), no cuBLAS, with
the element-wise work around them fused in: LayerNorm before, bias / GELU / residual add /
KV-cache append / argmax after. float16 and bfloat16 run on tensor cores (mma.sync),
float32 on CUDA cores.

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

# --- CUDA cores (linear_kernel): float32, and 16-bit rows that are not 16-byte vectors ---
# rows of x per pass over W (BR); B = 2, 3 run with zero rows, B > 4 in passes of 4 (W is
# re-read, mostly from L2). 8 rows a pass held up to 250 registers (one block an SM) and
# took 40 us for GPT-2's qkv at B = 8 on the H100, against 3.4 MB of weights.
BATCH_ROWS = (1, 4)
# (RW rows of W a warp works on at once, U 16-byte loads per row and lane in flight; the next
# U are requested once these are used). Which one a shape gets: _tile.
TILES = ((2, 4), (4, 2), (1, 8), (1, 24), (2, 6))
WARPS = (4, 8)
# float32 rows longer than one batch of (1, 8) (K > 1024 at 16-byte vectors: the MLP down of
# every GPT-2 size, large's and XL's attention projection) take FLOAT_LONG_TILE in blocks of
# FLOAT_LONG_WARPS warps, so that a warp requests up to 3,072 columns of its row at once (the
# first batch before the wait, under programmatic launch) instead of one batch of 1,024 after
# another; each lane adds its columns in the same order either way (linear.cu), so the numbers
# do not change. None: (1, 8) in 8 warps. (132-148 registers on sm_80-90, no spill.) H200,
# float32, us a sweep of 512 replays from 8 cached keys on one session's buffers, (1, 24) in 8
# / 4 warps against (1, 8) in 8 (benchmarks/results/float_long_tile-h200.json): GPT-2 small at
# batch 1 280.13 / 290.88 against 293.87 (calls 288.6 / 301.1 against 302.9 us a token), at
# batch 8 1110.87 / 1161.91 against 1151.75; medium at batch 1 708.30 / 724.77 against 739.45.
# (GPT-2 small's float32 MLP down had added 6.3 us a layer to the step, its MLP up, of the same
# bytes, 4.1: decode_step-h200.json.)
FLOAT_LONG_TILE = (1, 24)
FLOAT_LONG_WARPS = 8
# float32 rows with the LayerNorm prologue longer than one batch of (2, 4) (K > 512) and at most
# one of FLOAT_LN_TILE (GPT-2 small's q|k|v and MLP up, K = 768, which took two batches at
# (2, 4)) take it in blocks of 4 warps: a warp requests its two rows whole before it waits; the
# same bits. None: (2, 4). H200, float32, us a sweep as above, (2, 6) against (2, 4)
# (benchmarks/results/float_ln_tile-h200.json): GPT-2 small at batch 1 269.12 against 279.85
# (calls 282.2 against 293.0 us a token), at batch 8 1082.69 against 1108.41.
FLOAT_LN_TILE = (2, 6)
_SCALAR_TILE = (1, 8)  # the unaligned (element-wise) path
LN_CHUNKS = 2  # linear.cu: a LayerNorm row is at most LN_CHUNKS vectors per thread

# --- tensor cores (linear_mma_kernel): float16 / bfloat16, K % 8 == 0, 16-byte aligned rows ---
# n-tiles of 8 rows of x per block (NT; blocks over the batch past that, each reading the
# weight tile again, from L2 after the first). Never changes the numbers. _mma_tile chooses.
MMA_TILES = (1, 2, 4, 8)
MMA_MIN_WARPS_PER_SM = 8  # warps the grid keeps per SM when _mma_tile picks the n-tiles
MMA_WIDE_BLOCKS = 8  # two m-tiles a block (_mma_m_tiles) from this many blocks of one an SM
# chunks of W a warp requests at once (U) for each NT: 2 U 16-byte loads of W and U NT of x
# per lane. One n-tile also has U = 8, for warps with more than 4 chunks of a row (_mma_batch).
_MMA_BATCH = {1: (4, 8), 2: (4,), 4: (2,), 8: (1,)}
# (NT, U) of the LayerNorm-prologue variants: one n-tile at U = 8 (128 registers), two at
# U = 4 (80 registers; ptxas spilled one n-tile at U = 4 in 80, and two in 64).
_LN_PROLOGUE_TILES = ((1, 8), (2, 4))
MMA_MAX_WARPS = 16  # linear.cu
MMA_NARROW_WARPS = 8  # linear.cu: blocks of two m-tiles, or W ahead (linear_mma_ahead_kernel)
MMA_RED_STRIDE = 20  # linear.cu's RED_STRIDE
MMA_CHUNKS_PER_WARP = 6  # chunks of 32 columns a warp takes of each row (see _mma_warps)
# Warps of a row of K values where a measurement chose other than _mma_warps' rule: {K: warps}.
# Rows of 1,024 (GPT-2 medium's q|k|v, projection, MLP up and LM head) in 4 warps of one batch
# of 8 chunks each, against the rule's 6 of 5-6 (H100, us a sweep of 512 replays from 8 cached
# keys on one session's buffers, benchmarks/results/row_warps-h100.json): GPT-2 medium float16
# B = 1 503.9 against 514.5, B = 8 587.0 against 599.6, B = 64 1528.0 against 1593.0, bfloat16
# B = 1 508.3 against 520.4. Fewest warps of one batch each for other widths (large_w12-h100.json,
# set through MMA_CHUNKS_PER_WARP = 12): large's rows of 1,280 (5 warps against 7) won at B = 1
# (953.7 against 961.0 us) and B = 64 (3190.8 against 3273.3) but lost at B = 8 (1138.5 against
# 1103.7); small's 768 (3 against 4) and XL's 1,600 (7 against 8) lost at B = 1 (_mma_warps).
MMA_ROW_WARPS = {1024: 4}
# LayerNorm in the product's prologue for up to this many rows of x (each block normalizes
# them itself); more rows are normalized once by ln_rows_kernel (the same bits).
LN_PROLOGUE_ROWS = 16
# ... and only when the product's blocks run in at most two waves (2 blocks an SM): a block
# that waits for its own LayerNorm holds its SM slot the while, so a many-wave grid (the LM
# head, 12 waves) pays it once per wave. GPT-2 small's LM head at B = 1 took 49.5 us in the
# step with the prologue, against 28.2 us for the plain product (H100, decode_step.py); GPT-2
# XL's step (q|k|v and MLP up in 300 and 400 blocks) 2215 us with the prologue, 2320 us with
# ln_rows_kernel ahead; GPT-2 small's (144, 192 blocks) 286 / 284 us, 347 / 375 us without
# programmatic launch. (The model's 16-bit decode step folds its LayerNorms instead, ln_fold:
# alone, in a graph with PDL on the H100, GPT-2 small's q|k|v at B = 1 took 2.48 us folded,
# 3.04 with the prologue, 1.99 without any LayerNorm; at B = 64 8.53 / 9.62 with ln_rows /
# 7.32; the LM head at B = 64 61.7 / 66.9 / 63.1; GPT-2 XL's MLP up at B = 1 10.75 / 14.81 /
# 8.08, folded at 80 registers, its 400 blocks then in two waves: one n-tile now keeps 64.)
LN_PROLOGUE_WAVE = 4
_LN_ROWS_WARPS = 4
# linear_mma_stream_kernel: tiles of W in its shared-memory ring (STREAM_STAGES - 2 in flight
# while one is multiplied and one finished), rows of x a block
STREAM_STAGES = 4  # (3, 4, 5 slots: 58.9, 59.7, 60.5 us for the LM head at 64 rows on the H100 before x became
#                    the A operand, see _mma_stream: one or two tiles in flight kept it busy)
STREAM_ROWS = 64
STREAM_MIN_ROWS = 17  # (the kernel computes all 64 rows: at 16, linear_mma_kernel's 2 n-tiles measured as fast)
STREAM_GROUPS = 4  # warp groups of a block (each KW warps on 16 of the 64 rows of x): blocks of at most 16 warps
STREAM_CHUNKS = 6  # linear.cu: chunks of 32 columns a warp of linear_mma_stream_kernel takes at most
STREAM_RED_STRIDE = 24  # linear.cu's: floats a row of x takes in a partial tile
_STREAM_STATIC_SMEM = 1024  # its static shared memory: the rows' mean, rstd and best (value, index)
# Chunks of 32 values a warp of the exact tiles' kernel (linear_mma_list_kernel) requests at
# once: all of its chunks of a row (at most 8: _check_screen), so that a listed tile's weights
# come in one round trip; the LM head's own plan takes 4 (its 3,142 blocks are not one wave),
# which split GPT-2 small's 6 chunks a warp and XL's 7 into two. H100, us a sweep of 512 replays
# from 8 cached keys on one session's buffers, float16 B = 1, two rounds each against the plan's
# (benchmarks/results/screen_exact_batch-h100.json): GPT-2 small 173.29 / 173.45 against 174.10 /
# 173.84, XL 1500.10 / 1499.34 against 1500.33 / 1500.44.
SCREEN_EXACT_BATCH = 8


def _name(c_type: str, out_type: str, vec: int, tile: tuple[int, int], br: int, ln: bool, epi: str) -> str:
    rw, u = tile
    return (f"linear_kernel<{c_type}, {out_type}, {vec}, {rw}, {u}, {br}, {'true' if ln else 'false'}, "
            f"{_EPI[epi]}>")


# what linear_mma_kernel does with x (linear.cu's XInput): uses the rows, normalizes them first
# (each block by itself), or uses them with their LayerNorm folded into W and the epilogue
X_PLAIN, X_LN, X_LN_FOLD = 0, 1, 2
TRIGGERS = ("start", "requested", "waited")  # linear's trigger=, the kernel's Trigger in order
STATS_COLS = 16  # outputs of a row per set of row statistics (a block's tile of W)


def _mma_name(c_type: str, out_type: str, nt: int, u: int, xin: int, epi: str, mt: int = 1) -> str:
    return f"linear_mma_kernel<{c_type}, {out_type}, {nt}, {u}, {xin}, {_EPI[epi]}, {mt}>"


def _mma_ahead_name(c_type: str, u: int, epi: str) -> str:
    return f"linear_mma_ahead_kernel<{c_type}, {c_type}, {u}, {_EPI[epi]}>"


def _mma_stats_warp_name(c_type: str, u: int, epi: str) -> str:
    return f"linear_mma_stats_warp_kernel<{c_type}, {c_type}, {u}, {_EPI[epi]}>"


STATS_WARP_EPILOGUES = ("store", "gelu", "qkv_cache")  # of linear_mma_stats_warp_kernel (outputs in x's dtype)


def _mma_list_name(c_type: str, u: int) -> str:
    return f"linear_mma_list_kernel<{c_type}, float, {u}>"


def _mma_stream_name(c_type: str, xin: int, epi: str) -> str:
    return f"linear_mma_stream_kernel<{c_type}, float, {xin}, {_EPI[epi]}, {STREAM_STAGES}>"


def _ln_rows_name(c_type: str) -> str:
    return f"ln_rows_kernel<{c_type}>"


def _variants(c_type: str):
    """(out type, LayerNorm prologue, epilogue) of every declared specialization."""
    own = [(c_type, ln, epi) for ln, epi in ((False, "store"), (False, "gelu"), (False, "residual"),
                                             (True, "store"), (True, "gelu"), (True, "qkv_cache"))]
    logits = [("float", ln, epi) for ln in (False, True) for epi in ("store", "argmax")]
    return list(dict.fromkeys(own + logits))


_HALVES = [c for c in _build.CTYPES.values() if c != "float"]
# The screened LM head of float32 rows (linear_argmax's screen=, linear.cu's linear_q8f_max_kernel):
# the product's tile and block (the LM head's, _tile), 8-byte pieces a lane takes of a row at
# most (K <= 256 x _Q8F_PIECES), and the exact blocks' kernel.
_Q8F_TILE, _Q8F_WARPS, _Q8F_PIECES = (4, 2), 8, 8
_Q8F_LIST_NAME = ("float", "linear_list_kernel")
_build.declare(
    _SRC,
    [
        _name(c, o, vec, tile, br, ln, epi)
        for c in _build.CTYPES.values()
        for o, ln, epi in _variants(c)
        for vec in (_build.vec_widths(c) if c == "float" else (1,))  # 16-bit vectors: tensor cores
        for tile in (TILES if vec > 1 else (_SCALAR_TILE,))
        for br in BATCH_ROWS
    ]
    + [
        _mma_name(c, o, nt, u, xin, epi)
        for c in _HALVES
        for o, ln, epi in _variants(c) + [(c, False, "qkv_cache")]  # (the LayerNorm ran before: ln_rows)
        for nt in MMA_TILES
        for u in _MMA_BATCH[nt]
        for xin in ((X_LN, X_LN_FOLD) if ln else (X_PLAIN,))
        if xin != X_LN or (nt, u) in _LN_PROLOGUE_TILES
    ]
    + [  # two m-tiles a block: float logits of tall weights at 8 n-tiles (_mma_m_tiles)
        _mma_name(c, "float", MMA_TILES[-1], _MMA_BATCH[MMA_TILES[-1]][0], xin, epi, 2)
        for c in _HALVES
        for xin in (X_PLAIN, X_LN_FOLD)
        for epi in ("store", "argmax")
    ]
    + [  # one n-tile with W a batch ahead, a block an SM (_mma_ahead)
        _mma_ahead_name(c, u, epi) for c in _HALVES for u in _MMA_BATCH[1] for epi in ("store", "gelu", "residual")
    ]
    + [  # W streamed through shared memory: float logits of tall weights for 17 to 64 rows (_mma_stream)
        _mma_stream_name(c, xin, epi) for c in _HALVES for xin in (X_PLAIN, X_LN_FOLD) for epi in ("store", "argmax")
    ]
    + [_ln_rows_name(c) for c in _HALVES]
    + [_mma_list_name(c, SCREEN_EXACT_BATCH) for c in _HALVES]  # (linear_argmax's screen)
    + [_mma_stats_warp_name(c, u, epi) for c in _HALVES for u in _MMA_BATCH[1] for epi in STATS_WARP_EPILOGUES]
    + [f"linear_q8_max_kernel<{c}>" for c in _HALVES]
    + [f"linear_q8f_max_kernel<{p}>" for p in range(1, _Q8F_PIECES + 1)]  # (float32 rows' screen)
    + [_name(_Q8F_LIST_NAME[0], "float", 4, _Q8F_TILE, 1, True, "argmax").replace("linear_kernel", _Q8F_LIST_NAME[1])],
    pdl=True,
)
_ARGMAX_SRC = "sampling.cu"
_ARGMAX_NAME = "argmax_partials_kernel"
_build.declare(_ARGMAX_SRC, [_ARGMAX_NAME] + [f"argmax_embed_kernel<{c}>" for c in _HALVES], pdl=True)
_ARGMAX_THREADS = 256  # sampling.cu's ARGMAX_PARTIALS_THREADS


def linear_tiles(dtype=numpy.float32) -> tuple:
    """The launch shapes ``tile=`` takes for x of ``dtype``: (rows of W per warp, loads in
    flight per row and lane) on CUDA cores (float32), n-tiles of 8 rows of x per pass on
    tensor cores (float16, bfloat16)."""
    return MMA_TILES if numpy.dtype(dtype).itemsize == 2 else TILES


def _tile(N: int, K: int, itemsize: int, ln: bool = False) -> tuple[tuple[int, int], int]:
    """((RW, U), warps per block) for a weight [N, K] on CUDA cores; never depends on the batch.

    Measured on an H100 when 16-bit rows also ran here (benchmarks/decode_step.py, float16,
    B = 1, launches back to back
    in a CUDA graph with programmatic dependent launch): 2 rows x 4 loads in blocks of 4
    warps was the fastest tile or within 8% of it on every weight of GPT-2 small and XL
    (small: qkv 2.18 us, attn_proj 1.45, fc 2.47, mlp_proj 4.27, LM head 27.8); 4 rows x 2
    loads lost up to 40%, 1 row x 8 loads up to 85% (attn_proj). 4-warp blocks rather
    than 8 keep the LayerNorm-prologue kernels, which hold more registers, in one wave.
    The LM head (N >= 16384) runs in many waves, and each block pays the LayerNorm
    prologue once: 4 rows x 2 loads in 8-warp blocks (a quarter of the blocks) measured
    the same without the prologue (28.0 against 27.8 us). In float32, at one row of x a pass,
    that tile is compiled to fit two blocks an SM (linear.cu's linear_min_blocks: the LM head
    with its LayerNorm prologue 55.4 against 77.4 us in GPT-2 small's step).
    float32 rows are twice the bytes: without the LayerNorm prologue, 1 row x 8 loads in
    blocks of 8 warps (twice the warps of 2 x 4, the same loads in flight each) was the
    fastest of the six tiles on every weight of GPT-2 small and XL but GPT-2 small's MLP up
    (4.19 against 4.13 us with 4 warps), H100, alone in a graph with PDL, us against 2 x 4
    in 4 warps: small qkv 3.25 / 3.90, attn_proj 1.96 / 2.71, fc 4.19 / 4.50, mlp_proj
    5.97 / 7.78; XL qkv 12.64 / 13.82, attn_proj 5.28 / 6.45, fc 17.00 / 17.11, mlp_proj
    18.43 / 20.57. In the step, where q|k|v and MLP up run the prologue, 1 x 8 in 4 warps for
    all four lost (float32, B = 1, graph with PDL, one run: GPT-2 small 441.5 against 425.2
    us, XL 4006.9 against 3878.8: twice the blocks each normalize the row), for the MLP down
    alone it won (401.0 and 3792.7); this rule (1 x 8 in 8 warps for the products without
    the prologue) measured 380.5 and 3647.5 in a later run. Rows of more than one batch of
    (1, 8) take FLOAT_LONG_TILE (above: one batch of up to 3,072 columns a warp); rows with the
    prologue of 513-768 values take FLOAT_LN_TILE (above: one batch of two rows a warp)."""
    if N >= 16384:
        return (4, 2), 8
    if itemsize == 4 and not ln:
        if FLOAT_LONG_TILE is not None and K > 32 * 4 * 8:
            return FLOAT_LONG_TILE, FLOAT_LONG_WARPS
        return (1, 8), 8
    if itemsize == 4 and FLOAT_LN_TILE is not None and 32 * 4 * 4 < K <= 32 * 4 * FLOAT_LN_TILE[1]:
        return FLOAT_LN_TILE, 4
    return (2, 4), 4


def _mma_warps(K: int) -> int:
    """Warps per block on tensor cores, each taking every KW-th chunk of 32 columns: about
    MMA_CHUNKS_PER_WARP chunks a warp, at most MMA_NARROW_WARPS warps; where 8 warps would
    each take more than one batch of loads at U = 8 (K > 2048), the fewest warps that take one
    batch each, at most MMA_MAX_WARPS (GPT-2 small's MLP down, K = 3072: 12 warps of 8 chunks;
    medium's 16 of 8; large's and XL's 16 of 10 and 12-13). A function of K alone: it fixes
    the summation order.
    Measured on the H100 at B = 1 (decode_step.py, graph + PDL, us with 4 / 8 warps): GPT-2
    small qkv 2.26 / 2.49, attn_proj 1.62 / 1.82, fc 2.49 / 2.86 (K = 768); GPT-2 XL (K =
    1600, 8 warps) qkv 9.16 / 7.48, attn_proj 4.28 / 2.76. The MLP down alone (us with 8 / 16
    warps, one batch of 6 or 7 chunks at 16): GPT-2 small (K = 3072) 4.79 / 3.25, XL 11.86 /
    10.04. In the decode step (float16, us a step at B = 1 / 8, 8 / 16 warps for it): medium
    620.7 / 588.9 and 690.2 / 654.6, large 1133.2 / 1097.0 and 1266.0 / 1217.9, XL 1891.5 /
    1769.5 and 2144.0 / 2097.7, but small 244.2 / 256.1 and 285.3 / 285.3 (at U = 4: 251.6,
    289.5): a block of 16 warps at 128 registers takes a whole SM's registers, so it waits for
    the SM to empty instead of starting beside the kernel before it. Small keeps 8.
    The MLP down's 16-warp blocks of GPT-2 medium to XL measured again against blocks that leave
    room beside them (the step with PDL at 264 cached keys, us, two rounds of one run): at U = 4
    (64 registers, two blocks an SM; benchmarks/results/mlp_down_batch-h100.log) medium
    577.0 / 577.9, large 1076.0 / 1023.4, XL 1610.5 / 1849.8; K in 2 / 4 / 8 slices over blocks
    of 8 / 8 / 4 warps, the last block of a tile adding them up (branch k-slices;
    benchmarks/results/mlp_down_k_slices-h100.log) medium 585.4 / 589.9, 578.1, 560.6, large
    1086.7 / 1048.8, 1093.3, 1085.8, XL 1631.4 / 1747.4, 1832.5, 1818.5. XL loses 7-15% with
    every one; medium and large gain 3-5% with one each, a different one, which one run does
    not make a rule of: 16 warps stay. XL's in 12 warps (three batches of 8 chunks a warp, 48K
    registers: room for a block of the q|k|v product beside it, as GPT-2 small's) lost 8%: 1637.34
    against 1515.71 us a sweep of 512 replays from 8 cached keys (one session's buffers,
    benchmarks/results/publish_join-h100.json, "down12"). GPT-2 small's MLP down (two batches of W a warp at 8
    warps, the second after the wait) in K slices of 2 x 8, 4 x 4, 4 x 8 and 8 x 4 warps (H200,
    benchmarks/results/w_prefetch_k_slices_epilogue-h200.log, "ks"): at 264 cached keys B = 1
    222.6, 222.6, 230.1, 233.0 against 220.4 us with 8 warps, B = 8 263.0, 260.7, 278.5, 277.0
    against 262.9; 4 x 4 gained 2% at B = 8 past 520 keys only: 8 warps stay. In 16 warps again,
    now that the epilogue requests the warps' partial sums at once (H100, two rounds of one run,
    benchmarks/results/mlp_down_16_warps_small-h100.log, us at 64 / 264 / 520 / 900 cached
    keys): at U = 6 (one batch, 100 registers) B = 1 224.8 / 243.3 / 266.0 / 292.6 against
    221.5 / 232.5 / 258.3 / 292.6, but B = 8 235.3 / 259.0 / 304.0 / 352.1 against 243.6 /
    266.4 / 319.1 / 366.6; U = 8 and U = 4 lost at B = 1 as well. In 12 warps of one batch of 8
    chunks each (48K registers a block: room for a 16K-register block of the kernel before it;
    H100, two rounds of one run, benchmarks/results/mlp_down_12_warps_small-h100.log, us at 64 /
    264 / 520 / 900 cached keys, against 8 warps): B = 1 205.6 / 223.5 / 242.2 / 268.9 against
    221.4 / 232.9 / 258.0 / 286.6 (bfloat16 204.3 / 221.8 / 237.9 / 264.7 against 222.6 /
    234.3 / 259.1 / 293.6), B = 2 202.8 / 221.2 against 221.7 / 234.8 at 64 / 264, B = 8 225.0 /
    250.8 / 293.0 / 340.7 against 241.7 / 265.4 / 315.1 / 360.8, B = 16 and 32 2-5% faster, B =
    64 within 0.5% (487.7-493.6 against 485.0-491.4 at 64 keys); 6 warps (two batches of 8)
    lost: 239.9 / 251.7 at B = 1. Small takes 12. GPT-2 XL's rows of 1,600 values (q|k|v, attention
    projection, MLP up, LM head) in 10 / 13 / 16 warps instead of 8 lost 7-10% (same run of each,
    benchmarks/results/kw_1600_xl-h100.log): B = 1 1693.8-1737.6 against 1581.4-1584.4 us at 64
    cached keys, B = 8 2087.9-2112.6 against 1947.5-1958.3 at 264. MMA_CHUNKS_PER_WARP measured
    again on one session's buffers (benchmarks/step_variants.py; us a sweep of 512 replays from 8
    cached keys, float16, B = 1, two runs, 6 against 3 / 4 and against 8 / 12; benchmarks/results/
    chunks_per_warp-h100.json, chunks_per_warp_fewer-h100.json): GPT-2 small 213.6 against 227.7 /
    231.5 and 213.7 against 215.5 / 215.3, medium 517.7 against 540.0 / 539.6 and 517.2 against
    511.2 / 508.7, XL 1582.9 against 1604.7 / 1604.7 (8 / 12): fewer warps gain medium alone (its
    rows of 1,024 values), at batch 1, by 1.6%: MMA_ROW_WARPS."""
    if K in MMA_ROW_WARPS:
        return MMA_ROW_WARPS[K]
    chunks = _build.cdiv(K, 32)
    kw = min(MMA_NARROW_WARPS, _build.cdiv(chunks, MMA_CHUNKS_PER_WARP))
    if _build.cdiv(chunks, kw) > _MMA_BATCH[1][-1]:  # more than a batch a warp
        kw = min(MMA_MAX_WARPS, _build.cdiv(chunks, _MMA_BATCH[1][-1]))
    return max(1, kw)


def _mma_tile(B: int, N: int, K: int, sms: int) -> int:
    """n-tiles per block for B rows of x and a weight [N, K] on a GPU of ``sms`` SMs: the
    most (each weight tile is read once per block row: fewer re-reads), up to what covers B,
    that still leave the grid MMA_MIN_WARPS_PER_SM warps an SM; one n-tile up to 8 rows.
    Measured on the H100 (the decode step with one product's n-tiles forced, graph + PDL, us
    a step, the rule's choice first): GPT-2 small at B = 64 q|k|v 716 (4) / 780 (1) / 750
    (2) / 753 (8), attention out 717 (1) / 715 (2) / 734 (4), MLP up 717 (4) / 768 (2) / 747
    (8), MLP down 717 (2) / 769 (1) / 738 (4), LM head 717 (8) / 737 (4); at B = 128 MLP up
    1273 (8) / 1298 (4), MLP down 1273 (4) / 1298 (2); at B = 256 MLP down 2280 (8) / 2342
    (4) / 2373 (2); at B = 32 q|k|v 492 (2) / 501 (4); GPT-2 XL at B = 64 MLP down 6411 (4)
    / 6733 (2), attention out 6600 (4) / 6733 (2). It misses two cases by 3%: GPT-2 small's
    MLP down at B = 16 (1 n-tile 401, 2 391) and q|k|v at B = 128 (8 n-tiles 1339, 4 1298).
    (A kernel that staged W and x in shared memory, one weight read per 64 rows of x, with
    these k-groups and bits, measured 6.8-7.2 us for GPT-2 small's q|k|v and 7.0 for its MLP
    up at 64 rows against 7.6 and 8.1, before the weights were requested a batch ahead; with
    the LayerNorm taken in, 15 us against 10 for ln_rows and this kernel; short weights and
    GPT-2 XL lost: it was not kept.)"""
    if B <= 8:
        return 1
    nt = min(MMA_TILES[-1], 1 << (_build.cdiv(B, 8) - 1).bit_length())  # covering B, a power of two
    blocks = _build.cdiv(N, 16)
    while nt > 1 and blocks * _build.cdiv(B, 8 * nt) * _mma_warps(K) < MMA_MIN_WARPS_PER_SM * sms:
        nt //= 2
    return nt


def _mma_batch(nt: int, long_rows: bool, one_wave: bool) -> int:
    """Chunks per batch of loads (U). One n-tile: 8 when a warp has more than 4 chunks of a
    row and the blocks fit in one wave at 16 warps an SM (U = 8 holds 128 registers; blocks of
    fewer than 8 warps are counted as 8), else 4.
    Measured on the H100 at B = 1 (decode_step.py, graph + PDL): GPT-2 small's mlp_proj
    (12 chunks a warp at 8 warps, as it then ran) 4.1 us with 8, 5.2 with 4; the LM head
    (3142 blocks) 31.4 with 8, 29.0 with 4."""
    return 8 if nt == 1 and long_rows and one_wave else _MMA_BATCH[nt][0]


def _batch_rows(B: int, K: int) -> int:
    """Rows of x per pass: the smallest of BATCH_ROWS covering B (at most 4), as many as
    the device's shared memory holds at K float32 values a row."""
    limit = _build.smem_optin()
    fits = [br for br in BATCH_ROWS if br * K * 4 <= limit]
    if not fits:
        raise ValueError(f"x rows of {K} features exceed this GPU's shared memory ({limit // 4} float32 values)")
    want = [br for br in fits if br >= min(B, BATCH_ROWS[-1])]
    return want[0] if want else fits[-1]


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


def _tensor_cores(x, weight, K: int, ln) -> bool:
    """float16 / bfloat16 rows of 16-byte vectors (x, W and the LayerNorm parameters): the
    tensor-core kernel."""
    return x.dtype.itemsize == 2 and _checks.vec_width(x.dtype, K, x, weight, *(ln or ())[:2]) == 8


def _check_tile(tile, warps, mma: bool):
    tiles = MMA_TILES if mma else TILES
    key = tuple(tile) if not mma and isinstance(tile, (tuple, list)) else tile
    if tile is not None and key not in tiles:
        raise ValueError(f"tile must be one of {tiles} for this launch, got {tile!r}")
    if warps is not None:
        if mma and not (isinstance(warps, int) and 1 <= warps <= MMA_MAX_WARPS):
            raise ValueError(f"warps must be an integer in [1, {MMA_MAX_WARPS}] on tensor cores, got {warps!r}")
        if not mma and warps not in WARPS:
            raise ValueError(f"warps must be one of {WARPS}, got {warps!r}")


def _geometry(x, weight, N: int, K: int, tile, warps, ln):
    """(vector width, tile, warps per block) of a CUDA-core launch: 16-byte vectors where x,
    W and the LayerNorm parameters allow. The tile never changes the numbers; the block
    width (warps) follows the shape alone, so neither does that."""
    dflt_tile, dflt_warps = _tile(N, K, x.dtype.itemsize, ln is not None)
    tile, warps = tuple(tile or dflt_tile), warps or dflt_warps
    vec = _checks.vec_width(x.dtype, K, x, weight, *(ln or ())[:2])
    if vec == 1:
        tile = _SCALAR_TILE
    if ln is not None and _build.cdiv(K // vec, 32 * warps) > LN_CHUNKS:  # the LayerNorm row in one round of loads
        warps = WARPS[-1]
    return vec, tile, warps


def _grid(N: int, tile, warps: int) -> int:
    """Blocks: one per ``warps`` row groups of ``tile[0]`` rows. (Capping the LM head at the
    blocks the GPU holds at once, each warp then walking many row groups, measured 97 us
    against 68 for GPT-2 small in the step on the H100: one row group's loads at a time
    per warp do not cover the latency.)"""
    return max(1, _build.cdiv(_build.cdiv(N, tile[0]), warps))


# Every product kernel's arguments begin with _args's, which end with B, N, K: where a launch's N
# and K stand (benchmarks/decode_step.py reads a recorded step's shapes there).
ARG_N, ARG_K = 17, 18


def _args(out, x, weight, bias, ln, res, part, kv, B, N, K):
    null = 0
    ln_w, ln_b, eps = ln if ln is not None else (null, null, 0.0)
    k_cache, v_cache, positions, seq_lens, H, S_max = kv if kv is not None else (null, null, null, null, 0, 0)
    return (null if out is None else out, x, weight, null if bias is None else bias, ln_w, ln_b, f32(eps),
            null if res is None else res, null if part is None else part[0], null if part is None else part[1],
            k_cache, v_cache, positions, seq_lens, i32(H), i32(S_max), i32(B), i32(N), i32(K))


def ln_rows(x, ln) -> cupy.ndarray:
    """LayerNorm of the rows of x [B, K] (16-bit, K % 8 == 0) into a new array, with the
    bits of the tensor-core product's prologue (ln_rows_kernel)."""
    ln_w, ln_b, eps = ln
    B, K = x.shape
    out = cupy.empty_like(x)
    kern = _build.kernel(_SRC, _ln_rows_name(_build.ctype(x.dtype)))
    smem = _LN_ROWS_WARPS * K * x.dtype.itemsize
    _build.set_smem(kern, smem)
    kern((_build.cdiv(B, _LN_ROWS_WARPS),), (32 * _LN_ROWS_WARPS,), (out, x, ln_w, ln_b, f32(eps), i32(B), i32(K)),
         shared_mem=smem)
    return out


def _mma_m_tiles(N: int, nt: int, logits: bool, sms: int, kw: int) -> int:
    """m-tiles of 16 rows of W per block: two for float logits (store or argmax) of a tall
    weight (grids of many waves) at 8 n-tiles, where every block reads its 64 rows of x from
    L2 for one tile of W: two tiles halve those reads. GPT-2 small's LM head at B = 64 in the
    decode step on the H100 (CUPTI trace, graph + PDL): 71 against 77 us. (The step's other
    products, in one or two waves, would lose half their blocks. A persistent LM head, one
    block an SM staging its rows of x once and walking the tiles in two warp groups, took 75.8
    against 71.8 us at B = 64 in the step's plain graph.) Blocks of at most MMA_NARROW_WARPS
    warps (linear.cu: 156-188 registers a thread)."""
    return 2 if (logits and nt == MMA_TILES[-1] and _build.cdiv(N, 16) >= MMA_WIDE_BLOCKS * sms
                 and kw <= MMA_NARROW_WARPS) else 1


def _xs_stride(K: int) -> int:
    """Elements of a row of x (or W) staged in shared memory: 64 bytes past a multiple of 128,
    so that a quarter warp's 16-byte reads of two rows fall in distinct banks."""
    return _build.cdiv(K, 64) * 64 + 32


def _mma_plan(B: int, N: int, K: int, ln: bool, tile, warps, sms: int, smem_limit: int, fold: bool = False,
              logits: bool = False):
    """(n-tiles NT, chunks per batch U, warps KW, what the kernel does with x (X_PLAIN; X_LN:
    the LayerNorm in the prologue; X_LN_FOLD: folded into W and the epilogue), dynamic shared
    memory, xs row stride, m-tiles MT) of a tensor-core launch; a function of sizes alone
    (``logits``: float32 outputs, stored or reduced to the argmax)."""
    kw = warps or _mma_warps(K)
    blocks = _build.cdiv(N, 16)
    long_rows = _build.cdiv(_build.cdiv(K, 32), kw) > 4  # more than 4 chunks a warp
    red = lambda nt, mt=1: kw * mt * 8 * nt * MMA_RED_STRIDE * 4  # noqa: E731
    one_wave = blocks * max(kw, MMA_NARROW_WARPS) <= 2 * MMA_NARROW_WARPS * sms  # at 128 registers
    batch = lambda nt: _mma_batch(nt, long_rows, one_wave)  # noqa: E731
    if fold:  # the rows' statistics, 8-byte sets of STATS_COLS values, share the partial tiles' shared memory
        smem = lambda nt, mt=1: max(red(nt, mt), 8 * nt * _build.cdiv(K, STATS_COLS) * 8)  # noqa: E731
        nt = tile or _mma_tile(B, N, K, sms)
        while nt > 1 and smem(nt) > smem_limit:  # (fewer n-tiles: the same numbers)
            nt //= 2
        if smem(nt) > smem_limit:
            raise ValueError(f"rows of {K} features are too wide for ln_fold: their statistics need "
                             f"{smem(nt)} bytes of shared memory, this GPU has {smem_limit}")
        mt = _mma_m_tiles(N, nt, logits, sms, kw)
        if smem(nt, mt) > smem_limit:
            mt = 1
        return nt, batch(nt), kw, X_LN_FOLD, smem(nt, mt), 0, mt
    prologue_nt = 1 if B <= 8 and long_rows and one_wave else 2  # see _LN_PROLOGUE_TILES
    prologue = ln and B <= LN_PROLOGUE_ROWS and tile in (None, prologue_nt) and blocks <= LN_PROLOGUE_WAVE * sms
    nt = prologue_nt if prologue else tile or _mma_tile(B, N, K, sms)
    xs_stride = _xs_stride(K)
    smem = red(nt) + ((B * xs_stride + 2 * K) * 2 if prologue else 0)  # + xs and the LayerNorm parameters
    if prologue and smem > smem_limit:
        prologue, smem = False, red(nt)
    if ln and not prologue and tile is None:
        nt = _mma_tile(B, N, K, sms)
        smem = red(nt)
    if prologue:
        return nt, batch(nt), kw, X_LN, smem, xs_stride, 1
    mt = _mma_m_tiles(N, nt, logits, sms, kw)
    if mt > 1 and red(nt, mt) > smem_limit:
        mt = 1
    return nt, batch(nt), kw, X_PLAIN, red(nt, mt), xs_stride, mt


def _mma_ahead(B: int, N: int, K: int, nt: int, u: int, kw: int, xin: int, mt: int, epi: str, own_out: bool,
               sms: int, ahead) -> bool:
    """Whether one n-tile runs with W a batch ahead (linear_mma_ahead_kernel): plain x, outputs in
    x's dtype, store / GELU / residual, no more tiles than SMs (a block an SM anyway, so the
    second set of W registers, 186 in all at U = 8, costs no blocks) and at least two whole
    batches of chunks a warp. Never changes the numbers. ``ahead``: the caller's choice (a
    benchmark's knob), or None.
    Measured on the H100 (float16, CUDA graph with PDL, us without / with): alone at B = 1,
    GPT-2 XL's MLP down (25 chunks a warp at U = 8) 12.00 / 11.76, GPT-2 small's (12 chunks)
    4.23 / 3.98; in the decode step, XL at B = 1 1934 / 1917 and 1909 / 1897, at B = 8 2348 /
    2190 and 2341 / 2246, but GPT-2 small at B = 1 249 / 258 and 247 / 256 (small's MLP down
    had one and a half batches a warp at 8 warps: not taken). Blocks of at most
    MMA_NARROW_WARPS warps: the MLP down of GPT-2 small (12 warps) and of medium to XL (16) now
    take more warps a row (_mma_warps) and run without.
    (Spreading a tile's warps over the blocks of a thread block cluster instead, meeting in
    distributed shared memory with the same bits, lost: GPT-2 small's attention projection 2.27 / 2.31 us with 2 / 4 blocks against 1.61, XL's
    MLP down 12.56 / 11.97 against 11.97; the step at B = 1 252-255 against 247-249 us. Every
    chunk of W a block multiplies requested into shared memory before the wait, by cp.async,
    where a warp has more chunks than a batch of registers (commit 990294d), lost too: the step
    at B = 1 343.1 against 240.1 us for GPT-2 small (its 12 MLP downs staged), 2240.0 against
    1868.2 for XL; with the same split of L1 and shared memory asked for every kernel of the
    step (the most shared memory) 270.5 against 266.4 and 2273.1 against 2266.7: a kernel that
    needs a larger shared-memory split than the kernels around it makes the SMs drain between
    them. benchmarks/results/decode_step_staged-h100.json, decode_step_carveout-h100.json. The
    MLP down of 16 warps streamed through a ring of shared-memory stages by a producer warp
    (cp.async.bulk, 52 registers a thread, the same bits; branch mlp-down-ring) lost the same way:
    XL at B = 1 2197.1 against 1576.7 us a step at 264 cached keys with 3 stages, 1667.8 against
    1621.4 with every kernel asking for half of the most shared memory;
    benchmarks/results/mlp_down_ring-h100.log. Only the chunks past each warp's first batch
    requested into shared memory before the wait (cp.async, 80 KB a block), in the 16-warp
    blocks that take whole SMs anyway (branch mlp-down-staged, the same bits), lost as well: XL
    at B = 1 1610.0 / 1622.0 against 1581.1 / 1580.1 us a step at 64 / 264 cached keys, and
    1600.3 / 1613.1 against 1576.5 / 1595.5 with every kernel asking for 40% of the most shared
    memory; benchmarks/results/mlp_down_staged-h100.log.)"""
    able = (xin == X_PLAIN and nt == 1 and mt == 1 and own_out and epi in ("store", "gelu", "residual")
            and kw <= MMA_NARROW_WARPS)
    if ahead is not None:
        if ahead and not able:
            raise ValueError(f"ahead=True takes plain x (no ln / ln_fold), at most 8 rows of x a block, outputs "
                             f"in x's dtype, no argmax or kv_cache and at most {MMA_NARROW_WARPS} warps")
        return bool(ahead)
    return able and _build.cdiv(N, 16) * _build.cdiv(B, 8) <= sms and _build.cdiv(K, 32) >= 2 * u * kw


def _stream_smem(K: int, kw: int, fold: bool) -> int:
    """Dynamic shared memory of linear_mma_stream_kernel: two buffers of partial tiles (or first
    the rows' statistics) and the ring of tiles of W, at linear.cu's row stride."""
    stride = _xs_stride(K)
    red = max(2 * kw * STREAM_ROWS * STREAM_RED_STRIDE, STREAM_ROWS * _build.cdiv(K, STATS_COLS) * 2 if fold else 0) * 4
    return red + STREAM_STAGES * (16 * stride * 2 + 2 * 16 * 4)  # (each tile with its c and u)


def _mma_stream(B: int, N: int, K: int, tile, xin: int, logits: bool, kw: int, sms: int, smem_limit: int,
                consts=()) -> bool:
    """Whether the product runs as linear_mma_stream_kernel: float logits (stored or reduced to
    the argmax) of a tall weight (as _mma_m_tiles) for STREAM_MIN_ROWS to STREAM_ROWS rows of x,
    plain or folded, with no n-tiles asked for, where a block's warps (at most 4 a group, each
    with at most STREAM_CHUNKS chunks of a row: GPT-2 small's K = 768; wider rows take
    linear_mma_kernel) and its shared memory fit (152 KB at K = 768) and its bias or folded
    constants are 16-byte aligned. Never changes the numbers.
    linear_mma_kernel runs such a product in blocks of 32 rows of W that each read the 64 rows
    of x (and their statistics) from L2 and wait for memory between their phases (H100, GPT-2
    small's LM head at B = 64 in the step: 31.6% of the DRAM bandwidth, 160 registers, 3 blocks
    an SM; ncu on the step's launches). Here one block an SM loads them once and keeps two
    tiles of W in flight throughout. Measured on the H100 (float16, the decode step in a graph with PDL at 264
    cached keys, us, linear_mma_kernel / this): B = 64 656 / 633 (gen B = 64: 93.9k / 97.2k
    tok/s), B = 32 481 / 469, B = 16 374 / 376 (64 rows computed for 16: not taken). Two warp
    groups of 4 n-tiles and a thread an output in the epilogue first took 679 us at B = 64: the
    block was issue-bound (8 warps an SM, 0.38 instructions a cycle a scheduler); four groups,
    one cp.async a chunk a thread with no index division, and four outputs a thread from
    16-byte reads of the partial tiles brought it to 633.
    Then (the LM head alone at 64 rows, plain x with the argmax, 10 launches in a graph, us a
    launch, the copy floor 26.1): 68.3 with x staged in shared memory; 61.8 with each warp's
    fragments of x in registers (only W read from shared memory; groups of 4 n-tiles, 8
    warps, 60.0 in the step against 59.7); 59.7 with one barrier a tile (two buffers of
    partial tiles, tile i multiplied while tile i - 1 is finished); 59.5 with two outputs a
    thread (every warp a share of the epilogue) and the copies' offsets computed once; 53.6
    with x as the mma's A operand (ncu before it: 470 instructions a warp a tile, 16 register
    moves for every 4 mma, 0.47 instructions a cycle a scheduler, the top barrier 18% of the
    stall samples). The step at B = 64: 621.8 / 610.1 us, 512 tokens at B = 64 98.7k / 100.7k
    tok/s (same run)."""
    return (logits and tile is None and xin in (X_PLAIN, X_LN_FOLD) and STREAM_MIN_ROWS <= B <= STREAM_ROWS
            and _build.cdiv(N, 16) >= MMA_WIDE_BLOCKS * sms and STREAM_GROUPS * kw <= 2 * MMA_NARROW_WARPS
            and _build.cdiv(_build.cdiv(K, 32), kw) <= STREAM_CHUNKS
            and _stream_smem(K, kw, xin == X_LN_FOLD) + _STREAM_STATIC_SMEM <= smem_limit
            and all(a.data.ptr % 16 == 0 for a in consts if a is not None))  # (bias, u, c: 16-byte copies)


def _launch_mma(x, weight, bias, ln, res, out, part, kv, out_type, epi, B, N, K, tile, warps, stats, ahead=None,
                pace=None, trigger="start", listed=None, stats_warp=False):
    fold, stats_out = stats
    sms = _build.sm_count(cupy.cuda.Device().id)
    logits = out_type == "float" and epi in ("store", "argmax")
    nt, u, kw, xin, smem, xs_stride, mt = _mma_plan(B, N, K, ln is not None, tile, warps, sms, _build.smem_optin(),
                                                    fold=fold is not None, logits=logits)
    pace_ps = 0 if pace is None else round(16 * mt * K * x.dtype.itemsize * 1000 / pace)  # a block's W, ps
    if pace_ps >= 2**31:
        raise ValueError(f"pace={pace} GB/s is too slow for rows of {K} values: a block's delay must fit 2**31 ps")
    if ln is not None and xin == X_PLAIN:  # normalize once, then the plain product (the same bits)
        x, ln = ln_rows(x, ln), None
    if listed is not None:  # (linear_argmax's screen: one n-tile and m-tile, the folded LayerNorm)
        kern = _build.kernel(_SRC, _mma_list_name(_build.ctype(x.dtype), SCREEN_EXACT_BATCH))
        blocks, grid_y, threads = _build.cdiv(N, 16), 1, 32 * kw
        grid_x = min(blocks, sms)
    elif _mma_stream(B, N, K, tile, xin, logits, kw, sms, _build.smem_optin(),
                     (bias,) if fold is None else (fold[1], fold[2])):
        kern = _build.kernel(_SRC, _mma_stream_name(_build.ctype(x.dtype), xin, epi))
        smem, xs_stride = _stream_smem(K, kw, xin == X_LN_FOLD), _xs_stride(K)
        blocks, grid_y, threads = min(_build.cdiv(N, 16), sms), _build.cdiv(B, STREAM_ROWS), 32 * STREAM_GROUPS * kw
    else:
        own_out = out_type == _build.ctype(x.dtype)
        blocks, grid_y, threads = _build.cdiv(N, 16 * mt), _build.cdiv(B, 8 * nt), 32 * kw
        if _mma_ahead(B, N, K, nt, u, kw, xin, mt, epi, own_out, sms, ahead):
            kern = _build.kernel(_SRC, _mma_ahead_name(_build.ctype(x.dtype), u, epi))
        elif (stats_warp and xin == X_LN_FOLD and nt == 1 and mt == 1 and own_out and epi in STATS_WARP_EPILOGUES
              and kw < MMA_MAX_WARPS):  # one warp more; the statistics beside the partial tiles, not under them
            kern = _build.kernel(_SRC, _mma_stats_warp_name(_build.ctype(x.dtype), u, epi))
            threads += 32
            smem = kw * 8 * MMA_RED_STRIDE * 4 + 8 * _build.cdiv(K, STATS_COLS) * 8
        else:
            kern = _build.kernel(_SRC, _mma_name(_build.ctype(x.dtype), out_type, nt, u, xin, epi, mt))
    _build.set_smem(kern, smem)
    if callable(part):
        part = part(blocks)
    null = 0
    ln_args = ln if fold is None else (null, null, fold[3])  # (ln_fold's eps where ln's goes)
    kern((blocks if listed is None else grid_x, grid_y), (threads,),
         _args(out, x, weight, bias, ln_args, res, part, kv, B, N, K)
         + (i32(xs_stride), null if fold is None else fold[0], null if stats_out is None else stats_out,
            null if fold is None else fold[1], null if fold is None else fold[2], i32(pace_ps),
            i32(TRIGGERS.index(trigger)))
         + (() if listed is None else listed),
         shared_mem=smem)
    return blocks, part


def _launch(x, weight, bias, ln, res, out, part, kv, out_type, epi, B, N, K, tile, warps, stats=(None, None),
            ahead=None, pace=None, trigger="start", listed=None, stats_warp=False):
    """Launches the product (tensor cores for 16-bit vector rows, else CUDA cores); returns
    its number of blocks and the argmax partials, made by ``part(blocks)`` when given (or
    given made: a screened LM head's, whose ``listed``, the 8-bit pass's (hi, bounds), says
    which tiles to compute).
    ``stats``: (ln_fold as (stats, u, c, eps), row statistics to write), tensor cores only."""
    mma = _tensor_cores(x, weight, K, ln)
    _check_tile(tile, warps, mma)
    if mma:
        return _launch_mma(x, weight, bias, ln, res, out, part, kv, out_type, epi, B, N, K, tile, warps, stats,
                           ahead, pace, trigger, listed, stats_warp)
    if ahead:
        raise ValueError("ahead=True runs on tensor cores: float16 / bfloat16 rows of 16-byte vectors")
    if pace is not None:
        raise TypeError("pace= paces the tensor-core product: float16 / bfloat16 rows of 16-byte vectors")
    if any(a is not None for a in stats):
        raise TypeError("ln_fold and stats_out need float16 / bfloat16 rows of 16-byte vectors (K % 8 == 0, "
                        "16-byte aligned): the tensor-core product")
    vec, tile, warps = _geometry(x, weight, N, K, tile, warps, ln)
    br = _batch_rows(B, K)
    name = _name(_build.ctype(x.dtype), out_type, vec, tile, br, ln is not None, epi)
    if listed is not None:  # (linear_argmax's screen of float32 rows: the blocks it lists, with their bits)
        name = name.replace("linear_kernel", _Q8F_LIST_NAME[1])
    kern = _build.kernel(_SRC, name)
    smem = br * K * 4
    _build.set_smem(kern, smem)
    blocks = _grid(N, tile, warps)
    if callable(part):
        part = part(blocks)
    args = _args(out, x, weight, bias, ln, res, part, kv, B, N, K) + (i32(TRIGGERS.index(trigger)),)
    grid = blocks
    if listed is not None:
        grid = min(blocks, 2 * _build.sm_count(cupy.cuda.Device().id))
        args += (i32(blocks),) + tuple(listed)
    kern((grid,), (32 * warps,), args, shared_mem=smem)
    return blocks, part


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


def fold_layernorm(weight, bias, ln_w, ln_b):
    """A LayerNorm (ln_w, ln_b) ahead of a product (weight [N, K], bias [N] or None) folded
    into it: ``(weight * ln_w, bias + weight @ ln_b, u, c)``, the first two in weight's dtype
    (the same product after a LayerNorm without parameters), u = the row sums of the folded
    weight and c = the folded bias, float32 [N], for ``linear(..., ln_fold=(stats, u, c, eps))``.
    Sums in float64."""
    w64 = weight.astype(numpy.float64)
    folded = (w64 * ln_w.astype(numpy.float64)).astype(weight.dtype)
    c = w64 @ ln_b.astype(numpy.float64) + (0.0 if bias is None else bias.astype(numpy.float64))
    u = folded.astype(numpy.float64).sum(axis=1)
    return folded, c.astype(weight.dtype), u.astype(numpy.float32), c.astype(numpy.float32)


def _check_stats(a, name: str, B: int, cols: int) -> cupy.ndarray:
    """Row statistics: float32 [B, ceil(cols / 16), 2], C-contiguous, 16-byte aligned."""
    a = _checks.as_array(a, name)
    if a.dtype != numpy.float32:
        raise TypeError(f"{name} must be float32, got {a.dtype}")
    _checks.check_shape(a, name, (B, _build.cdiv(cols, STATS_COLS), 2))
    if not a.flags.c_contiguous or a.data.ptr % 16:
        raise ValueError(f"{name} must be C-contiguous and 16-byte aligned")
    return a


def _stats_args(ln_fold, B: int, N: int, K: int, bias=None, ln=None, residual=None, stats_out=None) -> tuple:
    """(ln_fold as (stats, u, c, eps), stats_out), checked."""
    if ln_fold is not None:
        if not (isinstance(ln_fold, (tuple, list)) and len(ln_fold) == 4):
            raise TypeError("ln_fold must be a tuple (stats, u, c, eps): see fold_layernorm")
        if ln is not None or bias is not None:
            raise ValueError("with ln_fold, the LayerNorm and the bias are folded in: pass neither ln nor bias")
        stats, u, c, eps = ln_fold
        stats = _check_stats(stats, "ln_fold stats", B, K)
        u, c = (_checks.as_array(a, name) for a, name in ((u, "ln_fold u"), (c, "ln_fold c")))
        for a, name in ((u, "ln_fold u"), (c, "ln_fold c")):
            if a.dtype != numpy.float32:
                raise TypeError(f"{name} must be float32, got {a.dtype}")
            _checks.check_shape(a, name, (N,))
            if not a.flags.c_contiguous:
                raise ValueError(f"{name} must be contiguous")
        if not (isinstance(eps, (int, float, numpy.floating)) and math.isfinite(eps) and eps >= 0):
            raise ValueError(f"ln_fold eps must be a finite number >= 0, got {eps!r}")
        ln_fold = (stats, u, c, float(eps))
    if stats_out is not None:
        if residual is None:
            raise ValueError("stats_out are the statistics of the residual stream: pass residual too")
        stats_out = _check_stats(stats_out, "stats_out", B, N)
    return ln_fold, stats_out


def linear(x, weight, bias=None, *, gelu: bool = False, ln=None, ln_fold=None, residual=None, stats_out=None,
           kv_cache=None, out_dtype=None, out=None, tile=None, warps=None, ahead=None, pace=None,
           trigger: str = "start", stats_warp: bool = False) -> cupy.ndarray:
    """``y = act(norm(x) @ weight.T + bias)``, for a few rows of x.

    x: [B, K] contiguous; weight: [N, K] (out, in) contiguous; bias: [N] or None.
    ``ln=(w, b, eps)``: x is LayerNorm-ed first (w, b: [K]; the normalized rows are rounded
    to x's dtype, as a separate LayerNorm would store them). ``gelu``: GELU (tanh form).
    ``residual`` [B, N]: ``y = residual + round(x @ weight.T) + bias`` in float32, rounded
    once (the residual add of a GPT-2 block); ``out`` may be ``residual`` itself.
    ``stats_out`` (with ``residual``; float32 [B, ceil(N / 16), 2]): also the statistics of
    each 16 outputs of a row as stored (mean, sum of squared deviations), from which a later
    product normalizes y without a pass over it: ``ln_fold=(stats, u, c, eps)`` with the
    weight, u and c of :func:`fold_layernorm` (no ``ln``, no ``bias``) computes
    ``LN(x) @ W.T + b = rstd (x @ weight.T - mean u) + c``, the row's mean and rstd combined
    from its statistics in a fixed order (its numbers depend on the row alone; x is never
    rounded after normalizing, so not the bits of ``ln``). Both on tensor cores only.
    ``kv_cache=dict(k_cache, v_cache, positions, seq_lens)``: y is a fused q|k|v row
    (N = 3 H D); its k and v parts are also written into the caches [>= B, H, S_max, D] (x's
    dtype) at row ``positions[b]`` (int32 [B], not checked on the GPU), and ``seq_lens[b]``
    becomes ``positions[b] + 1``: what :func:`kv_append` does, without its launch.
    float32 accumulation. float16 / bfloat16 with K a multiple of 8 and 16-byte aligned
    rows run on tensor cores, the rest on CUDA cores. Either way an output's summation order
    depends only on K, so a row gives the same bits alone or in a batch, whatever the launch
    shape. ``out_dtype`` may be float32 when x is half precision (logits).
    ``tile`` / ``warps`` override the launch shape: on CUDA cores a tile of TILES and warps
    of WARPS (the tile never changes the numbers, nor do warps without ln); on tensor cores ``tile`` is the n-tiles of 8 rows
    of x per pass (MMA_TILES, never changes the numbers) and ``warps`` the warps that split
    K (1 to MMA_MAX_WARPS), which sets the summation order: a benchmark's knob. ``ahead``
    (tensor cores, one n-tile): whether each warp requests its next batch of W before it
    multiplies this one (never changes the numbers; chosen by shape when None). ``pace``
    (GB/s, tensor cores): a block of W's i-th tile of rows requests its weights i x (a block's
    bytes of W / pace) after it starts, instead of at once, so that a product launched early
    (programmatic dependent launch) does not fill the memory's queues ahead of the loads the
    kernels before it wait for (never changes the numbers; the LM head's streamed kernel, 17
    to 64 rows of float logits, requests its tiles through a ring and takes no pacing).
    ``trigger``: under programmatic dependent launch, when the next kernel may start: "start"
    (as every block starts), "requested" (once every block has requested its first batch of W)
    or "waited" (once every block has passed its wait for the kernel ahead); never changes the
    numbers; the streamed kernel ignores it. ``stats_warp`` (with ``ln_fold`` on tensor cores,
    outputs in x's dtype, where each block takes 8 rows of x: always up to 8 rows, past them
    when the grid's size keeps one n-tile a block; ignored elsewhere): each block takes one warp
    more, which combines its rows' statistics while the others multiply (never changes the
    numbers; a block of one warp more may leave no room beside it for the next kernel's
    blocks, so the caller chooses).
    """
    x, weight, bias, ln, B, N, K = _prepare(x, weight, bias, ln)
    pace = _check_pace(pace)
    if not isinstance(stats_warp, (bool, numpy.bool_)):
        raise TypeError(f"stats_warp must be a bool, got {stats_warp!r}")
    if not isinstance(trigger, str) or trigger not in TRIGGERS:
        raise ValueError(f"trigger must be one of {TRIGGERS}, got {trigger!r}")
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
    stats = _stats_args(ln_fold, B, N, K, bias, ln, residual, stats_out)
    kv = None
    if kv_cache is not None:
        if ln is None and ln_fold is None:
            raise ValueError("kv_cache is fused with the LayerNorm prologue: pass ln (or ln_fold) too")
        kv = _check_kv(kv_cache, x, B, N)
    out = _checks.output(out, "out", (B, N), out_dtype)
    if _checks.overlaps(out, x) and B and N and K:
        raise ValueError("out must not overlap x (x is read by every block while outputs are written)")
    if residual is not None and _checks.overlaps(out, residual) and out.data.ptr != residual.data.ptr:
        raise ValueError("out must be residual itself or not overlap it")
    if B == 0 or N == 0:
        return out
    if K == 0:
        raise ValueError("x has no features (K = 0)")
    epi = "residual" if residual is not None else "qkv_cache" if kv is not None else "gelu" if gelu else "store"
    _launch(x, weight, bias, ln, residual, out, None, kv, _build.ctype(out_dtype), epi, B, N, K, tile, warps, stats,
            ahead, pace, trigger, stats_warp=bool(stats_warp))
    return out


def _check_pace(pace):
    """pace= of linear: None, or GB/s from 1 to 1e6, as a float."""
    if pace is None:
        return None
    if isinstance(pace, bool) or not isinstance(pace, (int, float, numpy.integer, numpy.floating)):
        raise TypeError(f"pace must be a number of GB/s or None, got {type(pace).__name__}")
    if not (math.isfinite(pace) and 1 <= pace <= 1e6):
        raise ValueError(f"pace must be from 1 to 1e6 GB/s, got {pace!r}")
    return float(pace)


def linear_argmax(x, weight, bias=None, *, ln=None, ln_fold=None, logits=None, out=None, tile=None,
                  warps=None, advance=None, embed=None, screen=None) -> cupy.ndarray:
    """Greedy next tokens: int32 [B], the first index of each row's largest value of
    ``norm(x) @ weight.T + bias`` (arguments as :func:`linear`), without a second pass
    over the logits: each block of the product reduces its own outputs, then one small
    kernel reduces the blocks' results. ``logits`` (float32 [B, N]) receives the logits
    when given; otherwise they are never written. ``advance`` (int32 [B], optional): also
    ``advance += 1`` once the tokens are written (:func:`kv_advance` of a decode step's
    positions, in the same launch). ``embed=(wte, wpe, x_out, stats_out)`` (with ``advance``;
    float16 / bfloat16 rows of 16-byte vectors): the same launch then also writes the next
    decode step's embedding of each row's token at its moved position, as
    :func:`~cupy_kernels.embedding.embedding` with ``stats_out`` does (x_out [B, C], stats_out
    float32 [B, ceil(C / 16), 2]; the same bits); an index past wte's or wpe's rows reads
    their last row. x_out may be x (the kernel writes it after the product has read it).
    ``screen`` (:func:`quantize_rows` of weight; no ``logits``, ``tile`` or ``warps``): the
    same tokens, with W read at 8 bits a value first and at its own width only on the tiles of
    rows that may hold a row's largest value (bounds, not estimates). float16 / bfloat16: with
    ``ln_fold``, tensor cores, 1 to 8 rows, tiles of 16 rows (linear.cu, "The screened LM
    head"); float32: with ``ln``, one row, K a multiple of 8 up to 2,048, the LM head's tile
    (N >= 16384), blocks of 32 rows (linear.cu, "The screened LM head of float32 models").
    """
    x, weight, bias, ln, B, N, K = _prepare(x, weight, bias, ln)
    if screen is not None:
        screen = _check_screen(screen, x, weight, N, K, B, ln, ln_fold, logits, tile, warps)
    if logits is not None:
        logits = _checks.output(logits, "logits", (B, N), numpy.float32)
    out = _checks.output(out, "out", (B,), numpy.int32)
    if advance is not None:
        advance = _checks.output(advance, "advance", (B,), numpy.int32)
    if embed is not None:
        embed = _check_embed(embed, x, B, advance)
    stats = _stats_args(ln_fold, B, N, K, bias, ln)
    if B == 0:
        return out
    if N == 0 or K == 0:
        raise ValueError(f"argmax over an empty product (N = {N}, K = {K})")
    part = lambda blocks: (cupy.empty((B, blocks), dtype=numpy.float32),  # noqa: E731
                           cupy.empty((B, blocks), dtype=numpy.int32))
    listed = None
    if screen is not None and x.dtype == numpy.float32:  # the 8-bit pass, then the exact blocks listed
        part = part(_grid(N, _Q8F_TILE, _Q8F_WARPS))
        listed = _screen_pass_float(x, screen, bias, ln, N, K)
    elif screen is not None:  # the 8-bit pass's bounds, then the exact tiles where they may hold the largest
        part = part(_build.cdiv(N, _Q8_TILE))
        listed = _screen_pass(x, screen, ln_fold, B, N, K)
    blocks, part = _launch(x, weight, bias, ln, None, logits, part, None, "float", "argmax", B, N, K, tile, warps,
                           stats, listed=listed)
    args = (out, part[0], part[1], i32(blocks), 0 if advance is None else advance, 0 if listed is None else listed[1])
    if embed is None:
        _build.kernel(_ARGMAX_SRC, _ARGMAX_NAME)((B,), (_ARGMAX_THREADS,), args)
    else:
        wte, wpe, x_out, stats_out = embed
        kern = _build.kernel(_ARGMAX_SRC, f"argmax_embed_kernel<{_build.ctype(wte.dtype)}>")
        kern((B,), (_ARGMAX_THREADS,), args + (x_out, stats_out, wte, wpe, i32(wte.shape[1]), i32(wte.shape[0]),
                                                i32(wpe.shape[0])))
    return out


SCREEN_MAX_ROWS = 8  # linear.cu's: rows of x a screened LM head takes
_Q8_TILE = 16  # rows of W a tile of linear_q8_max_kernel (and of linear_mma_kernel at one m-tile)
_Q8W_WARPS = 4  # linear.cu's Q8W_WARPS: warps a block of linear_q8_max_kernel, a tile a warp
# Its blocks an SM (at most 4: its launch bounds). H200, us a sweep of 512 replays from 8 cached
# keys, 4 / 2 / 3 blocks (benchmarks/results/q8_warp_blocks-h200.json): GPT-2 small float16 at
# batch 1 164.69 / 168.93 / 163.71, at batch 2 171.77 / 175.72 / 171.19, XL 1296.26 / 1302.55 /
# 1297.08. At 3, GPT-2's 3,142 tiles are about two a warp (1,584 warps); at 4 (2,112 warps) half
# the warps take two and half one.
_Q8W_BLOCKS_PER_SM = 3


def quantize_rows(weight) -> tuple:
    """``(q, scale)`` of a weight [N, K] for :func:`linear_argmax`'s ``screen``:
    q[n, k] = round(w[n, k] / scale[n]) + 128 as bytes, scale = max |w| / 127 of each row
    (float32 [N]; 1 for a row of zeros, NaN for a row with a value that is not finite or whose
    largest is below 2^-100, where the quantization's bound fails; a NaN scale has every tile
    computed exactly). float32 weights: q is uint8 [N, K], row by row. float16 /
    bfloat16: q is laid out as the tensor-core 8-bit pass reads it (linear.cu, "The screened
    LM head"): uint8 [ceil(N / 16), ceil(K / 32) x 512], a row for each tile of 16 rows, in
    pieces of 512 bytes for each chunk of 32 columns, where bytes 16 (4 g + t) to 16 (4 g +
    t) + 15 hold row g's columns 8 t .. 8 t + 7, then row g + 8's (g < 8, t < 4); 128 (zero)
    past N and K; :func:`unpack_rows` gives it back as [N, K]."""
    weight = _checks.float_array(weight, "weight", ndim=2)
    if weight.dtype != numpy.float32 and weight.dtype.itemsize != 2:
        raise TypeError(f"weight must be float32, float16 or bfloat16, got {weight.dtype}")
    N, K = weight.shape
    w = weight.astype(numpy.float32)
    amax = cupy.abs(w).max(axis=1)
    finite = cupy.isfinite(w).all(axis=1) & ~((amax > 0) & (amax < numpy.float32(2.0 ** -100)))  # (tiny: exact too)
    scale = cupy.where(amax > 0, amax / numpy.float32(127), numpy.float32(1)).astype(numpy.float32)
    q = cupy.rint(w / cupy.where(finite, scale, numpy.float32(1))[:, None]).clip(-127, 127)
    q = (cupy.where(finite[:, None], q, 0) + 128).astype(numpy.uint8)
    scale = cupy.where(finite, scale, numpy.float32(numpy.nan)).astype(numpy.float32)
    if weight.dtype == numpy.float32:
        return cupy.ascontiguousarray(q), scale
    tiles, chunks = _build.cdiv(N, _Q8_TILE), _build.cdiv(K, 32)
    full = cupy.full((tiles * _Q8_TILE, chunks * 32), 128, dtype=numpy.uint8)
    full[:N, :K] = q
    # [tile, half (rows g / g + 8), g, chunk, t, byte] -> [tile, chunk, g, t, half, byte]
    packed = full.reshape(tiles, 2, 8, chunks, 4, 8).transpose(0, 3, 2, 4, 1, 5)
    return cupy.ascontiguousarray(packed).reshape(tiles, chunks * 512), scale


def unpack_rows(q, N: int, K: int):
    """:func:`quantize_rows`' q of a 16-bit weight as uint8 [N, K] (q + 128 of each row), from
    its tile layout."""
    tiles, chunks = _build.cdiv(N, _Q8_TILE), _build.cdiv(K, 32)
    if q.shape != (tiles, chunks * 512):
        raise ValueError(f"q of [{N}, {K}] must be [{tiles}, {chunks * 512}], got {list(q.shape)}")
    full = q.reshape(tiles, chunks, 8, 4, 2, 8).transpose(0, 4, 2, 1, 3, 5).reshape(tiles * _Q8_TILE, chunks * 32)
    return full[:N, :K]


def _check_screen(screen, x, weight, N: int, K: int, B: int, ln, ln_fold, logits, tile, warps) -> tuple:
    if not (isinstance(screen, (tuple, list)) and len(screen) == 2):
        raise TypeError("screen must be quantize_rows' (q, scale)")
    q, scale = _checks.as_array(screen[0], "screen's q"), _checks.as_array(screen[1], "screen's scale")
    if x.dtype == numpy.float32:
        return _check_screen_float(q, scale, x, weight, N, K, B, ln, ln_fold, logits, tile, warps)
    shape = (_build.cdiv(N, _Q8_TILE), _build.cdiv(K, 32) * 512)
    if q.dtype != numpy.uint8 or q.shape != shape or not q.flags.c_contiguous or q.data.ptr % 16:
        raise ValueError(f"screen's q must be C-contiguous, 16-byte aligned uint8 {list(shape)} "
                         "(quantize_rows of weight)")
    if scale.dtype != numpy.float32 or scale.shape != (N,) or not scale.flags.c_contiguous:
        raise ValueError(f"screen's scale must be C-contiguous float32 [{N}]")
    if ln_fold is None:
        raise ValueError("screen takes the LayerNorm folded in: pass ln_fold")
    if logits is not None or tile is not None or warps is not None:
        raise ValueError("screen computes only the tiles that may hold the largest value: no logits, tile or warps")
    if not 1 <= B <= SCREEN_MAX_ROWS:
        raise ValueError(f"screen takes 1 to {SCREEN_MAX_ROWS} rows of x, got {B}")
    if not _tensor_cores(x, weight, K, None):
        raise TypeError("screen needs float16 / bfloat16 rows of 16-byte vectors (the tensor-core product)")
    return q, scale


def screens_float(N: int, K: int) -> bool:
    """Whether linear_argmax takes ``screen=`` for float32 rows with a weight [N, K] (one row of
    x, the LayerNorm in the prologue, 16-byte aligned rows)."""
    return K % 8 == 0 and 0 < K <= 256 * _Q8F_PIECES and _tile(N, K, 4, True) == (_Q8F_TILE, _Q8F_WARPS)


def _check_screen_float(q, scale, x, weight, N: int, K: int, B: int, ln, ln_fold, logits, tile, warps) -> tuple:
    """screen= of float32 rows, checked: (q, scale)."""
    if q.dtype != numpy.uint8 or q.shape != (N, K) or not q.flags.c_contiguous or q.data.ptr % 8:
        raise ValueError(f"screen's q of float32 rows must be C-contiguous, 8-byte aligned uint8 [{N}, {K}] "
                         "(quantize_rows of weight)")
    if scale.dtype != numpy.float32 or scale.shape != (N,) or not scale.flags.c_contiguous:
        raise ValueError(f"screen's scale must be C-contiguous float32 [{N}]")
    if ln is None or ln_fold is not None:
        raise ValueError("screen of float32 rows takes the LayerNorm in the product's prologue: pass ln")
    if logits is not None or tile is not None or warps is not None:
        raise ValueError("screen computes only the blocks that may hold the largest value: no logits, tile or warps")
    if B != 1:
        raise ValueError(f"screen of float32 rows takes one row of x, got {B}")
    if K % 8 or not 0 < K <= 256 * _Q8F_PIECES:
        raise ValueError(f"screen of float32 rows takes K a multiple of 8 up to {256 * _Q8F_PIECES}, got {K}")
    if _geometry(x, weight, N, K, None, None, ln) != (4, _Q8F_TILE, _Q8F_WARPS):
        raise ValueError(f"screen of float32 rows takes the LM head's tile {_Q8F_TILE} in {_Q8F_WARPS} warps "
                         f"(N >= 16384, 16-byte aligned rows of x, weight and ln), got N = {N}")
    return q, scale


def _screen_pass_float(x, screen, bias, ln, N: int, K: int) -> tuple:
    """linear_q8f_max_kernel: (hi, bounds), each block of 32 rows' upper bound (float32
    [blocks]) and the row's best lower bound (uint32 [1], linear.cu's order keys; zero
    before, as the argmax kernel leaves it)."""
    q, scale = screen
    ln_w, ln_b, eps = ln
    blocks = _grid(N, _Q8F_TILE, _Q8F_WARPS)
    hi = cupy.empty(blocks, dtype=numpy.float32)
    bounds = cupy.zeros(1, dtype=numpy.uint32)
    pieces = _build.cdiv(K, 256)
    grid = min(blocks, _build.sm_count(cupy.cuda.Device().id) * (2 if pieces <= 3 else 1))  # (its launch bounds)
    kern = _build.kernel(_SRC, f"linear_q8f_max_kernel<{pieces}>")
    kern((grid,), (32 * _Q8F_WARPS,), (hi, x, q, scale, 0 if bias is None else bias, ln_w, ln_b, f32(eps), i32(N),
                                       i32(K), bounds))
    return hi, bounds


def _screen_pass(x, screen, ln_fold, B: int, N: int, K: int) -> tuple:
    """linear_q8_max_kernel: (hi, bounds), each tile of 16 rows' upper bound of each row
    (float32 [B, tiles]) and each row's best lower bound (uint32 [B], linear.cu's order keys;
    zero before, as the argmax kernel leaves them)."""
    q, scale = screen
    stats, u, c, eps = ln_fold
    tiles = _build.cdiv(N, _Q8_TILE)
    hi = cupy.empty((B, tiles), dtype=numpy.float32)
    bounds = cupy.zeros(B, dtype=numpy.uint32)
    kern = _build.kernel(_SRC, f"linear_q8_max_kernel<{_build.ctype(x.dtype)}>")
    # x as float16, then its sets (room for an even number: linear.cu's copy_row_sets)
    smem = B * (_build.cdiv(K, 32) * 32 + 8) * 2 + _build.cdiv(B * _build.cdiv(K, STATS_COLS), 2) * 16
    _build.set_smem(kern, smem)
    blocks = min(_build.cdiv(tiles, _Q8W_WARPS), _Q8W_BLOCKS_PER_SM * _build.sm_count(cupy.cuda.Device().id))
    kern((blocks,), (32 * _Q8W_WARPS,), (hi, x, q, scale, u, c, stats, f32(eps), i32(B), i32(N), i32(K), bounds),
         shared_mem=smem)
    return hi, bounds


def _check_embed(embed, x, B: int, advance):
    """embed= of linear_argmax for rows x, checked: (wte, wpe, x_out, stats_out)."""
    if advance is None:
        raise ValueError("embed= embeds at the moved positions: pass advance= (the positions) too")
    if not isinstance(embed, (tuple, list)) or len(embed) != 4:
        raise TypeError("embed must be (wte, wpe, x_out, stats_out)")
    wte = _checks.float_array(embed[0], "wte", ndim=2)
    wpe = _checks.float_array(embed[1], "wpe", ndim=2)
    _checks.same_dtype(x, "x", wte=wte, wpe=wpe)
    C = wte.shape[1]
    if wpe.shape[1] != C:
        raise ValueError(f"wpe has {wpe.shape[1]} columns but wte has {C}")
    if wte.shape[0] == 0 or wpe.shape[0] == 0:
        raise ValueError("wte and wpe need at least one row each")
    x_out = _checks.output(embed[2], "x_out", (B, C), wte.dtype)
    if wte.dtype.itemsize != 2 or _checks.vec_width(wte.dtype, C, wte, wpe, x_out) != 8:
        raise TypeError(f"embed needs float16 / bfloat16 rows of 16-byte vectors (C % 8 == 0, 16-byte aligned), "
                        f"got {wte.dtype} rows of {C}")
    stats_out = _check_stats(embed[3], "stats_out", B, C)
    return wte, wpe, x_out, stats_out
