// linear.cuh - pieces of the decode-step products that several kernels share, so that each
// computes the same bits: the q|k|v epilogue's cache write, the argmax order, the row
// statistics of the folded LayerNorm and the LayerNorm of one row by one warp.
// Used by linear.cu (linear_kernel, linear_mma_kernel, ln_rows_kernel) and decode_step.cu.
#pragma once

#include "common.cuh"

namespace g2c {

// Output n of a fused q|k|v row [3 C] of sequence b: a key or value column goes into the
// cache [B, H, S_max, D] at row pos (a query column: nothing).
template <typename T>
__device__ __forceinline__ void store_kv_column(T* __restrict__ k_cache, T* __restrict__ v_cache, T v, int n, int N,
                                                int H, int S_max, int b, int pos) {
    const int C = N / 3;
    if (n < C) return;
    const int c = n < 2 * C ? n - C : n - 2 * C;
    const int D = C / H, h = c / D, d = c - h * D;
    (n < 2 * C ? k_cache : v_cache)[((static_cast<long long>(b) * H + h) * S_max + pos) * D + d] = v;
}

// (value, index) a strictly larger value, or an equal one at a smaller index, replaces.
__device__ __forceinline__ void keep_max(float& best, int& best_n, float v, int n) {
    if (n >= 0 && (best_n < 0 || v > best || (v == best && n < best_n))) best = v, best_n = n;
}

// A folded LayerNorm's output from the product s = x W^T of W = W0 diag(gamma), for a row of
// mean m and reciprocal deviation r and u = W 1:  r (s - m u)  (the constant c is added with the
// bias). Pinned arithmetic: every kernel that folds gets the same bits.
__device__ __forceinline__ float unfold_ln(float s, float mean, float u, float rstd) {
    return __fmul_rn(__fmaf_rn(-mean, u, s), rstd);
}

// The statistics set of n <= 16 values as stored (v[i] = 0 for i >= n): their mean and the sum
// of their squared deviations from it, with the arithmetic of the RESIDUAL epilogue, whose 16
// lanes add lane i + off into lane i for off = 8, 4, 2, 1 (here in registers): the embedding
// leaves its rows' sets (embedding.cu) with the bits a residual product would.
__device__ __forceinline__ float2 set_stats(const float (&v)[16], int n) {
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = v[i];
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) {
#pragma unroll
        for (int i = 0; i < off; ++i) s[i] = __fadd_rn(s[i], s[i + off]);
    }
    const float mu = __fdividef(s[0], static_cast<float>(n));
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const float d = i < n ? __fsub_rn(v[i], mu) : 0.0f;
        s[i] = __fmul_rn(d, d);
    }
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) {
#pragma unroll
        for (int i = 0; i < off; ++i) s[i] = __fadd_rn(s[i], s[i + off]);
    }
    return make_float2(mu, s[0]);
}

// Set j of an embedding row (columns 16 j .. 16 j + 15, those below C; C % 8 == 0): token plus
// position rows added and stored as T into dst (and dst2 when not null), and the set's
// statistics as stored (set_stats). embedding.cu's STATS and decode_step.cu's layer 0 both run
// it, so the fused step's layer 0 folds from the bits the embedding kernel leaves.
template <typename T>
__device__ __forceinline__ float2 embed_set(const T* tok, const T* pos, int j, int C, T* dst, T* dst2) {
    float v[16];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int i = 16 * j + 8 * h;
        float a[8], b[8];
        if (i < C) {  // (a set holds 16 values or 8)
            load_vec<T, 8>(tok + i, a);
            load_vec<T, 8>(pos + i, b);
#pragma unroll
            for (int k = 0; k < 8; ++k) a[k] += b[k];
            store_vec<T, 8>(dst + i, a);
            if (dst2 != nullptr) store_vec<T, 8>(dst2 + i, a);
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) v[8 * h + k] = i < C ? to_float(from_float<T>(a[k])) : 0.0f;
    }
    return set_stats(v, min(16, C - 16 * j));
}

constexpr int LN_VECS = 4;  // 16-byte vectors of a LayerNorm row a lane loads at once

// Row statistics in sets: the RESIDUAL epilogue leaves, per block and row, the mean and the
// sum of squared deviations from that mean (m2) of its 16 outputs as rounded to T. A row of
// K values is then, with n_j = min(16, K - 16 j) values in set j and any shift c,
//   mean = c + sum_j n_j (mean_j - c) / K,   m2 = sum_j (m2_j + n_j (mean_j - c)^2) - K (mean - c)^2
// with c = mean_0 (the within-set parts come exact from the sets; what remains of the shift is
// small for any LayerNorm input). row_stats combines them from shared memory with ROW_LANES
// lanes a row, each taking sets l, l + ROW_LANES, ... in order, then a shuffle tree: a row's
// statistics depend on its values and width alone. Arithmetic pinned (no contraction left to
// the compiler): the same bits in every specialization.
constexpr int ROW_LANES = 8;  // lanes combining one row's sets (a warp does 4 rows at once)
__device__ __forceinline__ void row_stats(const float2* sets, int n_sets, int K, int sub, float& mean, float& m2) {
    const float c = sets[0].x;
    float s = 0.0f, q = 0.0f;
#pragma unroll 4  // four sets' reads in flight, the same order of sums (linear.cu's epilogue has the figures)
    for (int j = sub; j < n_sets; j += ROW_LANES) {
        const float2 v = sets[j];
        const float n = static_cast<float>(min(16, K - 16 * j)), d = __fsub_rn(v.x, c);
        s = __fmaf_rn(n, d, s);
        q = __fadd_rn(q, __fmaf_rn(__fmul_rn(n, d), d, v.y));
    }
#pragma unroll
    for (int off = ROW_LANES / 2; off > 0; off >>= 1) {  // xor tree: every lane of the row gets the same bits
        s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, off, ROW_LANES));
        q = __fadd_rn(q, __shfl_xor_sync(0xffffffffu, q, off, ROW_LANES));
    }
    const float dm = __fdividef(s, static_cast<float>(K));
    mean = __fadd_rn(c, dm);
    m2 = fmaxf(__fsub_rn(q, __fmul_rn(__fmul_rn(static_cast<float>(K), dm), dm)), 0.0f);
}

// LayerNorm of one row of K values (K % 8 == 0) by one warp, into dst as T (lw, lb: the
// parameters, in global or shared memory). The raw row is
// staged in `stage` (shared memory; dst may be the same place: each lane rewrites only the
// vectors it staged). Two passes, mean then variance, as layernorm.cu; lane l sums vectors
// l, l + 32, ... in order, then a shuffle tree, and the arithmetic is pinned (no contraction
// left to the compiler), so a row gets the same bits in every kernel that calls this.
template <typename T>
__device__ __forceinline__ void ln_row(T* dst, T* stage, const T* xr, const T* lw, const T* lb, float eps, int K,
                                       int lane) {
    const int nv = K / 8;
    float s = 0.0f;
    for (int i0 = 0; i0 < nv; i0 += 32 * LN_VECS) {  // loads first: every vector of the round in flight
        uint4 v[LN_VECS];
#pragma unroll
        for (int j = 0; j < LN_VECS; ++j) {
            const int i = i0 + lane + 32 * j;
            if (i < nv) v[j] = *reinterpret_cast<const uint4*>(xr + i * 8);
        }
#pragma unroll
        for (int j = 0; j < LN_VECS; ++j) {
            const int i = i0 + lane + 32 * j;
            if (i < nv) {
                *reinterpret_cast<uint4*>(stage + i * 8) = v[j];
                const T* e = reinterpret_cast<const T*>(&v[j]);
#pragma unroll
                for (int k = 0; k < 8; ++k) s = __fadd_rn(s, to_float(e[k]));
            }
        }
    }
    const float mean = __fdiv_rn(warp_sum(s), static_cast<float>(K));
    float q = 0.0f;
    for (int i = lane; i < nv; i += 32) {
        const uint4 raw = *reinterpret_cast<const uint4*>(stage + i * 8);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float d = __fsub_rn(to_float(e[k]), mean);
            q = __fmaf_rn(d, d, q);
        }
    }
    const float rstd = rsqrtf(__fadd_rn(__fdiv_rn(warp_sum(q), static_cast<float>(K)), eps));
    for (int i = lane; i < nv; i += 32) {
        const uint4 raw = *reinterpret_cast<const uint4*>(stage + i * 8);
        const uint4 gw = *reinterpret_cast<const uint4*>(lw + i * 8);
        const uint4 gb = *reinterpret_cast<const uint4*>(lb + i * 8);
        const T *e = reinterpret_cast<const T*>(&raw), *w = reinterpret_cast<const T*>(&gw),
                *b = reinterpret_cast<const T*>(&gb);
        uint4 o;
        T* oe = reinterpret_cast<T*>(&o);
#pragma unroll
        for (int k = 0; k < 8; ++k)
            oe[k] = from_float<T>(__fmaf_rn(__fmul_rn(__fsub_rn(to_float(e[k]), mean), rstd), to_float(w[k]),
                                            to_float(b[k])));
        *reinterpret_cast<uint4*>(dst + i * 8) = o;
    }
}

}  // namespace g2c
