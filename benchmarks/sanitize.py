"""Runs every kernel once, on small awkward shapes in each dtype, for compute-sanitizer:

    compute-sanitizer --tool memcheck  python -m benchmarks.sanitize
    compute-sanitizer --tool racecheck python -m benchmarks.sanitize

Sizes are chosen to hit ragged tiles and the scalar paths, and to stay quick under the tools.
"""

from __future__ import annotations

import cupy as cp
import cupyx
import numpy as np

import cupy_kernels as K
from cupy_kernels import _build
from cupy_kernels.decode_attention import AHEAD_DEEP
from cupy_kernels.fixed_attention import HEAD_DIM as FIXED_HEAD_DIM
from cupy_kernels.fixed_attention import THREADS as FIXED_THREADS


def screened_head(r, dtype):
    """The screened LM head (linear_argmax's screen=): its 8-bit pass, exact tiles and argmax,
    on ragged tiles, 1 to 8 rows, and a weight with a row that is not finite (every tile)."""
    def small(*shape):  # (scaled in float32)
        return (r(*shape, dtype=np.float32) * 0.05).astype(dtype)

    for B, C, N in ((1, 768, 5000), (3, 72, 129), (8, 776, 1000), (2, 1600, 300)):
        x, wt = r(B, C, dtype=dtype), small(N, C)
        stats = cp.empty((B, -(-C // 16), 2), dtype=np.float32)
        K.linear(r(B, C, dtype=dtype), small(C, C), residual=x, out=x, stats_out=stats)
        u, c = r(N, dtype=np.float32), r(N, dtype=np.float32)
        fold = (stats, u, c, 1e-5)
        K.linear_argmax(x, wt, ln_fold=fold, screen=K.quantize_rows(wt), advance=cp.zeros(B, np.int32))
        wt[N // 2, 3] = np.nan
        K.linear_argmax(x, wt, ln_fold=fold, screen=K.quantize_rows(wt))


def main():
    rng = np.random.default_rng(0)

    def r(*shape, dtype):
        return cp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    for dtype in _build.CTYPES:
        for rows, cols in ((3, 781), (2, 768), (1, 50257)):
            x, y = r(rows, cols, dtype=dtype), r(rows, cols, dtype=dtype)
            w, b = r(cols, dtype=dtype), r(cols, dtype=dtype)
            K.layernorm(x, w, b)
            K.layernorm_residual(x, y, w, b, proj_bias=b)
            K.bias_gelu(x, b)
            K.bias_add(x, b)
            K.softmax(x, scale=0.5)
        K.softmax(r(2, 9, 13, dtype=dtype), causal=True)
        wte, wpe = r(100, 781, dtype=dtype), r(16, 781, dtype=dtype)
        K.embedding(cp.asarray([1, 99, 5], dtype=np.int32), wte, wpe, cp.asarray([0, 15, 3], dtype=np.int32))
        if dtype != np.float32:  # with its rows' statistics: 16-byte vectors, a last set of 8 columns
            wte, wpe = r(100, 776, dtype=dtype), r(16, 776, dtype=dtype)
            K.embedding(cp.asarray([1, 99, 5], dtype=np.int32), wte, wpe, cp.asarray([0, 15, 3], dtype=np.int32),
                        stats_out=cp.empty((3, 49, 2), np.float32))
        for T, D in ((1, 64), (67, 64), (130, 128)):
            qkv = r(2, T, 3, 2, D, dtype=dtype)
            K.causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
            # tensor cores (float32: 3xTF32): ragged tiles, causal and not, Tq != Tk both ways
            cut = min(3, T)  # packed sequences of 3, 0 and T - 3 rows
            K.flash_attention(qkv[:1, :, 0], qkv[:1, :, 1], qkv[:1, :, 2], cu_seqlens=[0, cut, cut, T])
            for causal in (False, True):
                K.flash_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal)
                K.flash_attention(qkv[:, :3, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal)
                K.flash_attention(qkv[:, :, 0], qkv[:, :3, 1], qkv[:, :3, 2], causal=causal)
            kc, vc = r(2, 2, T + 5, D, dtype=dtype), r(2, 2, T + 5, D, dtype=dtype)
            K.kv_append(kc, vc, qkv[:, :, 1], qkv[:, :, 2], cp.asarray([0, 5], dtype=np.int32),
                        seq_lens=cp.zeros(2, dtype=np.int32))
            K.decode_attention(qkv[:, 0, 0], kc, vc, cp.asarray([1, T + 5], dtype=np.int32))
            for S in (1000, 8200):  # narrow blocks, split; 4 query heads per wide block (B x S >= 8192)
                kl, vl = r(1, 2, S, D, dtype=dtype), r(1, 2, S, D, dtype=dtype)
                for splits, threads in ((None, None), (3, None), (3, 512)):  # and wide blocks over many trips
                    K.decode_attention(r(1, 8, D, dtype=dtype), kl, vl, cp.asarray([S - 3], dtype=np.int32),
                                       num_splits=splits, threads=threads)
            # chunks of a fixed length: one (written by its block), several (the last merges)
            K.decode_attention(qkv[:, 0, 0], kc, vc, cp.asarray([1, T + 5], dtype=np.int32), split_keys=40)
            # the appended row read from beside q (the decode step's q|k|v row), narrow and wide blocks
            for threads in (128, 512):
                K.decode_attention(qkv[:, 0, 0], kc, vc, cp.asarray([1, T + 5], dtype=np.int32), split_keys=40,
                                   threads=threads, appended=(qkv[:, 0, 1], qkv[:, 0, 2]))
            if np.dtype(dtype).itemsize == 2:  # several loop trips requested ahead, one chunk and chunks of 40
                for keys in (None, 40):
                    K.decode_attention(qkv[:, 0, 0], kc, vc, cp.asarray([1, T + 5], dtype=np.int32), split_keys=keys,
                                       threads=128, appended=(qkv[:, 0, 1], qkv[:, 0, 2]), ahead=AHEAD_DEEP)
            if np.dtype(dtype).itemsize == 2 and D == FIXED_HEAD_DIM:  # fixed_attention at every width,
                lens = cp.asarray([1, T + 5], dtype=np.int32)  # and with the rows below positions before the wait
                for threads in FIXED_THREADS:
                    K.fixed_attention(qkv[:, 0, 0], kc, vc, lens, threads=threads)
                    K.fixed_attention(qkv[:, 0, 0], kc, vc, lens, threads=threads, positions=lens - 1)
                    K.fixed_attention(qkv[:, 0, 0], kc, vc, lens, threads=threads, positions=lens - 1,
                                      trigger_early=True)
            # L2 warm-up blocks beside the attention: one chunk and chunks of 40 (the last merges)
            for keys in (None, 40):
                K.decode_attention(qkv[:, 0, 0], kc, vc, cp.asarray([1, T + 5], dtype=np.int32), split_keys=keys,
                                   warm=r(333, 8, dtype=np.float16), warm_blocks=7)
                # the cache's rows requested into L2 before the wait (positions: past the cache too)
                K.decode_attention(qkv[:, 0, 0], kc, vc, cp.asarray([1, T + 5], dtype=np.int32), split_keys=keys,
                                   prefetch=cp.asarray([0, T + 50], dtype=np.int32))
            for kv in ("int8", "fp8"):  # quantized caches, GQA (4 query heads per KV head), ALiBi, splits
                storage = K.kv_storage_dtype(kv, dtype)
                kq, vq = cp.empty((2, 2, T + 5, D), storage), cp.empty((2, 2, T + 5, D), storage)
                sc = {"k_scale": cp.empty((2, 2, T + 5), np.float32), "v_scale": cp.empty((2, 2, T + 5), np.float32)}
                K.kv_append(kq, vq, qkv[:, :, 1], qkv[:, :, 2], cp.asarray([5, 0], dtype=np.int32), **sc)
                q8 = r(2, 8, D, dtype=dtype)
                for splits in (1, 3):
                    K.decode_attention(q8, kq, vq, cp.asarray([T + 5, T], dtype=np.int32), num_splits=splits,
                                       alibi_slopes=cp.full(8, 0.25, np.float32), **sc)
        for B, N, Kd in ((1, 100, 64), (5, 33, 781), (3, 300, 1600), (11, 70, 768), (20, 40, 776), (70, 33, 72)):
            x, wt, bias = r(B, Kd, dtype=dtype), r(N, Kd, dtype=dtype), r(N, dtype=dtype)
            ln = (r(Kd, dtype=dtype), r(Kd, dtype=dtype), 1e-5)  # ragged rows, passes, LayerNorm ahead (B > 16)
            mma = np.dtype(dtype).itemsize == 2 and Kd % 8 == 0
            for tile in K.linear_tiles(dtype if mma else np.float32):
                wide = {"warps": 3} if mma else {"warps": 8}
                K.linear(x, wt, bias, gelu=True, tile=tile)
                K.linear(x, wt, bias, ln=ln, tile=tile, **wide)
                res = r(B, N, dtype=dtype)
                K.linear(x, wt, bias, residual=res, out=res, tile=tile)
                K.linear(x, wt, ln=ln, out_dtype=np.float32, tile=tile)
                K.linear_argmax(x, wt, bias, ln=ln, logits=cp.empty((B, N), np.float32), tile=tile)
                K.linear_argmax(x, wt, tile=tile, **wide)
            if mma:  # the LayerNorm folded: statistics out of a residual product, into the next product
                stats = cp.empty((B, -(-Kd // 16), 2), np.float32)
                K.linear(r(B, 40, dtype=dtype), r(Kd, 40, dtype=dtype), residual=x, out=x, stats_out=stats)
                u, c = r(N, dtype=np.float32), r(N, dtype=np.float32)
                for tile in K.linear_tiles(dtype):
                    K.linear(x, wt, ln_fold=(stats, u, c, 1e-5), gelu=True, tile=tile)
                    K.linear_argmax(x, wt, ln_fold=(stats, u, c, 1e-5), tile=tile)
                K.linear(x, wt, bias, gelu=True, pace=500)  # blocks requesting their weights paced
                for trigger in ("requested", "waited"):  # the next kernel let start later
                    K.linear(x, wt, bias, residual=res, out=res, trigger=trigger)
                if B <= 8:  # one n-tile with W a batch ahead (a block an SM)
                    K.linear(x, wt, bias, residual=res, out=res, stats_out=cp.empty((B, -(-N // 16), 2), np.float32),
                             ahead=True)
                    K.linear(x, wt, bias, gelu=True, ahead=True)
            H, D = 2, Kd // 6 if Kd % 6 == 0 else 0
            if D:  # the q|k|v product into a cache
                kc, vc = r(B, H, 9, D, dtype=dtype), r(B, H, 9, D, dtype=dtype)
                K.linear(x, r(3 * H * D, Kd, dtype=dtype), ln=ln, kv_cache={
                    "k_cache": kc, "v_cache": vc, "positions": cp.arange(B, dtype=np.int32) % 9,
                    "seq_lens": cp.zeros(B, dtype=np.int32)})
        if dtype != np.float32:  # rows split over 16 warps (K > 3840), one n-tile and several
            xw, ww, bw = r(9, 4104, dtype=dtype), r(40, 4104, dtype=dtype), r(40, dtype=dtype)
            for tile in K.linear_tiles(dtype):
                res = r(9, 40, dtype=dtype)
                K.linear(xw, ww, bw, residual=res, out=res, stats_out=cp.empty((9, 3, 2), np.float32), tile=tile)
            K.linear(xw[:1], ww, bw, gelu=True)
            for Kd in (3072, 1024):  # 12 warps a row (GPT-2 small's MLP down), 4 of 8 chunks (medium's rows)
                xm, wm = r(3, Kd, dtype=dtype), r(40, Kd, dtype=dtype)
                for tile in K.linear_tiles(dtype):
                    res = r(3, 40, dtype=dtype)
                    K.linear(xm, wm, bw, residual=res, out=res, stats_out=cp.empty((3, 3, 2), np.float32), tile=tile)
            K.linear(xm[:1], wm, bw, gelu=True, ahead=True)  # (W ahead: blocks of at most 8 warps)
        if dtype != np.float32:  # float logits of a tall weight for 40 rows: W streamed through shared memory
            import importlib     # (by default), and two m-tiles a block (tile=8), the last one partly past N

            lin = importlib.import_module("cupy_kernels.linear")
            N = 16 * lin.MMA_WIDE_BLOCKS * _build.sm_count(cp.cuda.Device().id) + 5
            x, wt = r(40, 72, dtype=dtype), r(N, 72, dtype=dtype)
            K.linear(x, wt, r(N, dtype=dtype), out_dtype=np.float32)
            K.linear_argmax(x, wt, logits=cp.empty((40, N), np.float32))
            stats = cp.empty((40, 5, 2), np.float32)
            K.linear(r(40, 40, dtype=dtype), r(72, 40, dtype=dtype), residual=x, out=x, stats_out=stats)
            u, c = r(N, dtype=np.float32), r(N, dtype=np.float32)
            for tile in (None, 8):
                K.linear(x, wt, ln_fold=(stats, u, c, 1e-5), out_dtype=np.float32, tile=tile)
                K.linear_argmax(x, wt, ln_fold=(stats, u, c, 1e-5), tile=tile, advance=cp.zeros(40, np.int32))
            K.linear(x, wt, out_dtype=np.float32, tile=8)
        if dtype != np.float32:  # the prefill's products: ragged M, N and K, odd N, every tile shape
            from cupy_kernels.gemm import TILES

            for M, N, Kd in ((1, 64, 64), (130, 257, 200), (67, 130, 72)):
                x, wt, bias = r(M, Kd, dtype=dtype), r(N, Kd, dtype=dtype), r(N, dtype=dtype)
                for name, t in TILES.items():
                    if t.smem_bytes <= _build.smem_optin():
                        K.gemm(x, wt, tiles=name)
                        K.gemm(x, wt, bias, gelu=True, tiles=name)
        if dtype != np.float32:
            screened_head(r, dtype)
        logits = r(3, 50257, dtype=dtype)
        K.argmax(logits)
        K.sample(logits, seed=1, offset=0, temperature=0.9, top_k=40, top_p=0.9)
        K.sample(logits, seed=1, offset=0)
        K.kv_advance(cp.zeros(3, dtype=np.int32))
        ring = cupyx.empty_pinned((3, 5), dtype=np.int32)  # (kept until the synchronize: the GPU writes it)
        K.publish_tokens(cp.arange(5, dtype=np.int32), ring, cp.asarray([2], dtype=np.int32))
        K.read_floor(r(1001, 8, dtype=dtype), r(3, 8, dtype=dtype), blocks=7, threads=96)
        K.read_under_load(r(1001, 8, dtype=dtype), cp.asarray(np.arange(1, 65, dtype=np.uint32) % 64), blocks=7,
                          threads=96, loads=8, hops=9)
        cp.cuda.runtime.deviceSynchronize()
    print("all kernels ran")


if __name__ == "__main__":
    main()
