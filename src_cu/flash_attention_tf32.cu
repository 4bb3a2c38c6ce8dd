// flash_attention_tf32.cu - attention over a prompt (prefill) for float32 on tensor cores,
// FlashAttention-2 style, every product in 3xTF32 so that the result keeps float32 accuracy.
//
//   out[b, i, h, :] = sum_j softmax_j(q[b,i,h,:] . k[b,j,h,:] * scale) v[b,j,h,:],   j < Tk
//
// causal: query i sees key j only if j <= i + (Tk - Tq) (bottom-right aligned, as in
// flash_attention.cu); a query that sees no key gets zeros. VARLEN: packed sequences, each
// attending to its own rows, as in flash_attention.cu.
//
// Products: x = hi + lo, hi = x rounded to tf32, lo = x - hi rounded to tf32 (mma.cuh: the
// 3xTF32 section), and a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi: three mma.sync.m16n8k8 tf32
// per product, for S = Q K^T and for O += P V (P split the same way). Error per product
// <= ~2^-22 relative: float32 level, where one tf32 mma alone would be ~2^-11.
//
// Mapping: one block of 4 warps per (64-query tile, head, batch); warp w owns query rows
// 16w .. 16w+15 (the M of its mma), lane (g, t) = (lane / 4, lane % 4) rows g and g + 8.
// The k index of every product is permuted (k = t -> column 2t, k = t + 4 -> 2t + 1, mma.cuh),
// so that per key tile (BC keys):
//   S = Q K^T     Q's A fragments and K's B fragments are 64-bit shared loads of column pairs
//                 (2t, 2t+1), split at every tile (Q's split fragments held in registers cost
//                 64 registers at D = 64 and measured no faster: 56.4 vs 55.6 TFLOP/s).
//   softmax       online, on S's C fragments, as in flash_attention.cu: exp2 with scale * log2 e
//                 folded into one FMA (ex2.approx, ~2 ulp), row sums per lane until the end.
//   O += P V      P's C fragments are its A fragments unchanged (c0, c2, c1, c3); V's B
//                 fragment is keys (2t, 2t+1) of column g: two 32-bit shared loads.
// Accumulation: groups of GROUP k-steps go into a fresh accumulator, then into S or O with a
// float32 add (mma.cuh: mma_m16n8k8_3xtf32). Chaining all products into S and O, as the
// 16-bit kernel does, measured 5x to 12x the naive float32 error (H100, D = 64 and 128,
// T = 1025), since mma.sync does not round its additions to nearest.
// Shared tiles are row-major float32, 16-byte chunk c of row r stored at chunk c ^ 2 h(r),
// h(r) = (r & 3) ^ ((r >> 2) & 1): the 64-bit Q and K loads (rows g = 0..3 per half warp,
// chunks 2kk + t / 2) and the 32-bit V loads (rows 2t or 2t + 1, chunks 2n + g / 4) each hit
// 32 distinct banks, and 16-byte cp.async stores of one row stay distinct.
// Pipelining: one K and one V buffer; V tile j is copied (cp.async) while S = Q K_j and the
// softmax run, K tile j + 1 while O += P V_j runs: two barriers per tile, 48 KiB (D = 64) or
// 64 KiB (D = 128) of shared memory, two blocks per SM next to their ~250 registers a thread.
// Ragged tiles: rows past Tq or Tk are zero-filled by cp.async (V's zeros keep 0 * garbage
// out of O) and keys >= Tk score -inf. Causal: key tiles above the diagonal are never loaded.
//
// FLOPs: 4 B H Tq Tk D useful (half when causal and Tq = Tk); the tensor cores execute three
// times that. Bytes: q and out once, k and v once per 64-query tile from L2.
//
// Floor (H100 SXM, 132 SMs, ~1.75 GHz under load): dense tf32 peaks at 495 TFLOP/s through
// wgmma, mma.sync reaches a fraction of it, and 3 mma per product leave <= 165 TFLOP/s useful.
// The instructions bound it first: per warp and 64-key tile (D = 64) there are 384 mma and
// 288 split elements (K 128 + V 128 + P 32 per lane) at 4 instructions each (mma.cuh: ptxas
// drops the mask of a value that only feeds an mma), + ~200 softmax + ~200 shared loads and
// the group adds: ~2900 instructions in the chained version (nvdisasm), 7.5 per mma. One SM sub-partition issues one
// per clock: 4 x 2048 / 3 / 7.5 = 364 useful FLOP/clock/SM -> ~84 TFLOP/s, ~75 less the causal
// diagonal. Measured on the H100 (B 8, H 12, S 4096, causal): 51.8 TFLOP/s (torch SDPA
// memory-efficient 33.2, causal_attention on CUDA cores 27.9); hd128 non-causal (B 16, H 16):
// 55.1 (efficient 47.4). The miss against ~75: two blocks of 4 warps per SM leave 2 warps per
// sub-partition to hide mma and shared-load latency; an mma-chained version without the group
// adds, with 165 registers and 3 blocks per SM, ran at 55.6 but failed the accuracy bound.
// Variants measured (H100, D = 64 causal / non-causal, TFLOP/s), chained: lo left unrounded
// 60.3 / 64.9 (not cvt.rna, dropped), Veltkamp's float split 51.3 / 53.9; grouped: GROUP 2 49.9 / 54.3,
// GROUP 8 48.5 / 50.6, GROUP 4 51.3 / 54.8 (kept, errors alike: 4.7e-7 to 7.1e-7 vs naive 7.4e-7).
//
// Specializations: D in {64, 128} x CAUSAL in {false, true} x VARLEN. Registers (compile_for_arch, NVRTC 12.9):
// sm_90 227 / 218 / 248 / 244 for <64, false> / <64, true> / <128, false> / <128, true>, no spills.
// Wrapper: cupy_kernels/flash_attention.py (float32 inputs)   Tests: tests/test_flash_attention_gpu.py
// Benchmark: benchmarks/attention.py (float32 "ours")
#include "common.cuh"
#include "mma.cuh"

using namespace g2c;

namespace {
// 64 query rows, 4 warps of 16: as flash_attention.cu. 64-key tiles at D = 64; at D = 128,
// 32-key tiles: S's 16 fewer registers are what keeps the grouped accumulation free of spills
// (248 registers on sm_90; at 64 keys every grouping tried spilled 8 to 140 bytes).
constexpr int BR = 64;  // query rows per block
template <int D> constexpr int BC = D == 64 ? 64 : 32;  // keys per tile
// k-steps per fresh accumulator (mma.cuh: mma_m16n8k8_3xtf32) in S = Q K^T and O += P V: 4 was
// the fastest of 2, 4 and 8 on the H100 (numbers above) at the same accuracy.
constexpr int GROUP = 4;
constexpr int WARPS = BR / 16;
constexpr int THREADS = 32 * WARPS;

// The swizzle key of row r (see the header): a bijection on rows {0..3}, {4..7}, {0, 2, 4, 6}
// and {1, 3, 5, 7}, the row sets that one phase of the Q/K and of the V loads touches.
__device__ __forceinline__ int row_key(int r) { return (r & 3) ^ ((r >> 2) & 1); }

// The float offset of chunk `chunk` (4 floats) of row `row` in a swizzled tile of D floats per row.
template <int D> __device__ __forceinline__ int tile_offset(int row, int chunk) {
    static_assert(D % 32 == 0, "rows of whole 128-byte lines");
    return row * D + 4 * (chunk ^ (2 * row_key(row)));
}
}  // namespace

// cp.async copies of ROWS-row tiles of one [n_rows, D] float32 matrix (row stride `stride`
// elements) into swizzled shared tiles. Thread i copies chunk i % CHUNKS of rows
// i / CHUNKS + p PASS_ROWS (p < PASSES); rows >= n_rows are zero-filled (their source is the
// tile's first row, which exists). Offsets are computed once per thread.
template <int D, int ROWS> struct TileLoader {
    static constexpr int CHUNKS = D / 4;               // 16-byte chunks per row
    static constexpr int PASS_ROWS = THREADS / CHUNKS;  // 8 (D = 64) or 4 (D = 128)
    static constexpr int PASSES = ROWS / PASS_ROWS;
    static_assert(THREADS % CHUNKS == 0 && ROWS % PASS_ROWS == 0 && (PASS_ROWS % 8 == 0 || PASS_ROWS == 4),
                  "whole passes; the swizzle repeats every 8 rows");

    const char* src;
    long long row_bytes;   // the matrix's row stride, bytes
    long long pass_bytes;  // PASS_ROWS rows
    int n_rows;
    int row;               // this thread's first row in a tile
    long long offset;      // its source offset from the tile's first row, bytes
    unsigned dst0, dst4;   // its destination offsets (bytes) in rows `row` and `row + 4`

    __device__ __forceinline__ TileLoader(const float* src, long long stride, int n_rows)
        : src(reinterpret_cast<const char*>(src)),
          row_bytes(stride * 4),
          pass_bytes(PASS_ROWS * row_bytes),
          n_rows(n_rows),
          row(threadIdx.x / CHUNKS) {
        const int chunk = threadIdx.x % CHUNKS;
        offset = row * row_bytes + 16 * chunk;
        dst0 = 4 * tile_offset<D>(row, chunk);
        dst4 = 4 * tile_offset<D>(row + 4, chunk);
    }

    // rows row + p PASS_ROWS: the swizzle of row r + 8 is that of row r, 8 rows further
    __device__ __forceinline__ unsigned dst(int p) const {
        if constexpr (PASS_ROWS % 8 == 0) return dst0 + p * PASS_ROWS * D * 4;
        return (p % 2 ? dst4 : dst0) + (p / 2) * 8 * D * 4;
    }

    // Issue the copies of rows row0 .. row0 + ROWS - 1 (row0 < n_rows) into the tile at shared address `tile`.
    __device__ __forceinline__ void load(unsigned tile, int row0) const {
        const char* first = src + row0 * row_bytes;
        const char* from = first + offset;
        if (row0 + ROWS <= n_rows) {
#pragma unroll
            for (int p = 0; p < PASSES; ++p, from += pass_bytes) cp_async_16(tile + dst(p), from, 16);
        } else {
#pragma unroll
            for (int p = 0; p < PASSES; ++p, from += pass_bytes) {
                const bool inside = row + p * PASS_ROWS < n_rows - row0;
                cp_async_16(tile + dst(p), inside ? from : first, inside ? 16 : 0);
            }
        }
    }
};

template <int D, bool CAUSAL, bool VARLEN>
__global__ void __launch_bounds__(THREADS, 2)
    flash_attention_tf32_kernel(float* __restrict__ out, const float* __restrict__ q, const float* __restrict__ k,
                                const float* __restrict__ v, int Tq, int Tk, int H, long long q_sb, long long q_st,
                                long long q_sh, long long k_sb, long long k_st, long long k_sh, long long v_sb,
                                long long v_st, long long v_sh, float scale, const int* __restrict__ cu_seqlens) {
    constexpr int KEYS = BC<D>;      // keys per tile
    constexpr int KSTEPS = D / 8;    // k-steps of S = Q K^T
    constexpr int S_TILES = KEYS / 8;  // n-tiles of S (8 keys each)
    constexpr int O_TILES = D / 8;   // n-tiles of O (8 columns each)
    constexpr int P_STEPS = KEYS / 8;  // k-steps of O += P V
    static_assert(KSTEPS % GROUP == 0 && P_STEPS % GROUP == 0, "whole groups");
    extern __shared__ __align__(128) float smem[];
    float* const q_s = smem;          // [BR][D]
    float* const k_s = q_s + BR * D;  // [KEYS][D]
    float* const v_s = k_s + KEYS * D;  // [KEYS][D]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // causal: the last query tiles see the most keys; run them first for a shorter tail
    const int q0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR;
    const int h = blockIdx.y, b = blockIdx.z;
    if constexpr (VARLEN) {  // sequence b: rows cu_seqlens[b] .. cu_seqlens[b + 1] (mma.cuh)
        if (!enter_packed_sequence(cu_seqlens, b, q0, Tq, Tk, q, q_st, k, k_st, v, v_st)) return;
    }
    q += b * q_sb + h * q_sh;
    k += b * k_sb + h * k_sh;
    v += b * v_sb + h * v_sh;

    // Keys this tile's queries see: row i sees j < min(Tk, i + 1 + shift) when causal.
    // Tiles below n_full are visible to every row and need no mask.
    const int shift = Tk - Tq;
    const int n_keys = CAUSAL ? min(Tk, q0 + BR + shift) : Tk;
    const int n_open = CAUSAL ? min(Tk, q0 + 1 + shift) : Tk;
    const int n_tiles = n_keys > 0 ? (n_keys + KEYS - 1) / KEYS : 0;
    const int n_full = n_open > 0 ? n_open / KEYS : 0;

    const TileLoader<D, KEYS> k_loader(k, k_st, Tk), v_loader(v, v_st, Tk);
    TileLoader<D, BR>(q, q_st, Tq).load(smem_addr(q_s), q0);
    if (n_tiles > 0) k_loader.load(smem_addr(k_s), 0);
    cp_async_commit();

    // Lane offsets (floats) at k-step or n-tile m = 0..3 (then + 32 floats per 4 steps):
    // Q, K: row g, columns 8m + 2t, 2t+1; V: rows 2t and 2t + 1, column 8m + g.
    int qk_off[4], v_off[2][4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        qk_off[m] = tile_offset<D>(g, 2 * m + t / 2) + 2 * (t % 2);
#pragma unroll
        for (int r = 0; r < 2; ++r) v_off[r][m] = tile_offset<D>(2 * t + r, 2 * m + g / 4) + g % 4;
    }
    const float* const q_w = q_s + 16 * warp * D;

    // Q's A fragment of k-step kk, split: rows g and g + 8, columns (2t, 2t+1) = k (t, t + 4)
    auto q_fragment = [&](int kk) {
        const float* p = q_w + qk_off[kk % 4] + 32 * (kk / 4);
        const float2 r0 = *reinterpret_cast<const float2*>(p);
        const float2 r8 = *reinterpret_cast<const float2*>(p + 8 * D);
        FragA3x a;
        a.split(r0.x, r8.x, r0.y, r8.y);
        return a;
    };

    cp_async_wait<0>();
    __syncthreads();

    float o[O_TILES][4];
#pragma unroll
    for (int n = 0; n < O_TILES; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY};  // running max of the raw scores of rows g, g + 8
    float l[2] = {0.0f, 0.0f};            // this lane's share of their running sums
    const float scale_log2 = scale * LOG2E;

    for (int j = 0; j < n_tiles; ++j) {
        if (j > 0) {
            cp_async_wait<0>();  // K tile j has landed (this thread's copies) ...
            __syncthreads();     // ... and everyone's; every warp is done with V tile j - 1
        }
        v_loader.load(smem_addr(v_s), j * KEYS);
        cp_async_commit();
        const int k0 = j * KEYS;

        // S = Q K^T in groups of GROUP k-steps (mma.cuh: mma_m16n8k8_3xtf32); K's B fragment
        // of n-tile n: key 8n + g, columns (2t, 2t+1) = k (t, t + 4)
        float s[S_TILES][4];
#pragma unroll
        for (int n = 0; n < S_TILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
#pragma unroll
        for (int k1 = 0; k1 < KSTEPS; k1 += GROUP) {
            FragA3x a[GROUP];
#pragma unroll
            for (int i = 0; i < GROUP; ++i) a[i] = q_fragment(k1 + i);
#pragma unroll
            for (int n = 0; n < S_TILES; ++n) {
                FragB3x bk[GROUP];
#pragma unroll
                for (int i = 0; i < GROUP; ++i) {
                    const int kk = k1 + i;
                    const float2 b2 = *reinterpret_cast<const float2*>(k_s + qk_off[kk % 4] + 32 * (kk / 4) + 8 * n * D);
                    bk[i].split(b2.x, b2.y);
                }
                mma_m16n8k8_3xtf32(s[n], a, bk);
            }
        }

        if (j >= n_full) {  // the tile crosses the diagonal or Tk
#pragma unroll
            for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + 8 * n + 2 * t + e % 2;
                    const int row = q0 + 16 * warp + g + 8 * (e / 2);
                    if (key >= Tk || (CAUSAL && key > row + shift)) s[n][e] = -INFINITY;
                }
        }

        // online softmax: new row max over the quad, rescale O and l by 2^(scaled old - new max)
        float m_scaled[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = m[r];
#pragma unroll
            for (int n = 0; n < S_TILES; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
            // a row that has seen only masked keys keeps max -inf; subtracting 0 gives p = 0, not NaN
            m_scaled[r] = mx == -INFINITY ? 0.0f : mx * scale_log2;
            const float alpha = exp2_approx(m[r] * scale_log2 - m_scaled[r]);  // 0 while m[r] is -inf
            m[r] = mx;
            l[r] *= alpha;
#pragma unroll
            for (int n = 0; n < O_TILES; ++n) {
                o[n][2 * r] *= alpha;
                o[n][2 * r + 1] *= alpha;
            }
        }
#pragma unroll
        for (int n = 0; n < S_TILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = exp2_approx(fmaf(s[n][e], scale_log2, -m_scaled[e / 2]));
                l[e / 2] += s[n][e];
            }

        cp_async_wait<0>();  // V tile j has landed (this thread's copies) ...
        __syncthreads();     // ... and everyone's; every warp is done with K tile j
        if (j + 1 < n_tiles) {
            k_loader.load(smem_addr(k_s), (j + 1) * KEYS);
            cp_async_commit();
        }

        // O += P V in groups of GROUP k-steps: P's A fragment of k-step i is S's C fragment of
        // n-tile i in the order (c0, c2, c1, c3); V's B fragment of n-tile n: keys 8i + 2t,
        // 8i + 2t + 1 of column 8n + g
#pragma unroll
        for (int i1 = 0; i1 < P_STEPS; i1 += GROUP) {
            FragA3x pa[GROUP];
#pragma unroll
            for (int i = 0; i < GROUP; ++i) pa[i].split(s[i1 + i][0], s[i1 + i][2], s[i1 + i][1], s[i1 + i][3]);
#pragma unroll
            for (int n = 0; n < O_TILES; ++n) {
                FragB3x bv[GROUP];
#pragma unroll
                for (int i = 0; i < GROUP; ++i) {
                    const float* vp = v_s + 8 * (i1 + i) * D + 32 * (n / 4);
                    bv[i].split(vp[v_off[0][n % 4]], vp[v_off[1][n % 4]]);
                }
                mma_m16n8k8_3xtf32(o[n], pa, bv);
            }
        }
    }

    // varlen: the sequence's rows and length read again (kept in registers through the loop
    // they pushed the largest tiles past 255 registers: ptxas spilled)
    long long row_base = static_cast<long long>(b) * Tq;  // out's row of the sequence's query 0
    if constexpr (VARLEN) {
        row_base = reload_int(cu_seqlens + b);
        Tq = reload_int(cu_seqlens + b + 1) - static_cast<int>(row_base);
    }
    // out is a contiguous [B, Tq, H, D] array; each lane stores 2 floats (8 bytes) per n-tile and row
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = l[r];
        sum += __shfl_xor_sync(FULL_MASK, sum, 1);
        sum += __shfl_xor_sync(FULL_MASK, sum, 2);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // no visible key: zeros
        const int row = q0 + 16 * warp + g + 8 * r;
        if (row >= Tq) continue;
        float* dst = out + ((row_base + row) * H + h) * D + 2 * t;
#pragma unroll
        for (int n = 0; n < O_TILES; ++n)
            *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
    }
}
