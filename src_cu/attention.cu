// attention.cu - causal attention over a prompt (prefill), Flash Attention V1 style, float32
// arithmetic on CUDA cores for every storage type.
//
//   out[b, t, h, :] = sum_{s <= t} softmax_s(q[b,t,h,:] . k[b,s,h,:] * scale) v[b,s,h,:]
//
// Mapping: one block of 256 threads = 16 x 16 (tx, ty) per (64-query tile, batch x head).
// Thread (tx, ty) owns query rows 4*ty .. 4*ty+3 and key columns tx + 16 j (j < 4) of each
// 64 x 64 score tile S, and output columns tx + 16 k (k < D / 16) of its four rows: 16
// score and 4 * D / 16 output accumulators in registers. A row's 64 scores live in 16
// lanes of one warp, so its max and sum are 4 xor-shuffles.
// Loop: Q tile in shared memory (pre-scaled by scale * log2 e, so exp2 is the softmax's
// exponential); for each key tile up to the diagonal (tiles the causal mask hides are
// never loaded): K tile -> S -> online max/sum -> P to shared memory -> V tile into the
// buffer K used -> O += P V. The division by the row sum happens once at the end.
// Shared memory rows are padded to D + 1 floats so column-wise reads hit distinct banks.
// q, k, v are read through their strides (the fused qkv buffer's views need no copy).
// Any length T: rows and keys past T are zero-filled and masked.
// FLOPs: 4 B H T^2 D / 2 (causal); bytes: q, k, v, out once each per query tile row.
//
// Specializations: T in {float, __half, __nv_bfloat16} x D in {64, 128} x VEC in {1, 16/sizeof(T)}.
// Wrapper: cupy_kernels/attention.py   Tests: tests/test_kernels_gpu.py
#include "common.cuh"

using namespace g2c;

namespace {
// 64 x 64 tiles and 16 x 16 threads: the fp32 Flash Attention V1 series' final shape (4 x 4
// register tiles per thread); not re-tuned on Hopper yet.
constexpr int BR = 64;  // query rows per block
constexpr int BC = 64;  // keys per tile
constexpr int THREADS = 256;
}  // namespace

// Copy a [64, D] tile of rows row0.. of a strided [T, D] matrix into shared memory
// (row stride D + 1 floats), zero-filling rows >= T, multiplying by `mul`.
template <typename T, int D, int VEC>
__device__ __forceinline__ void load_tile(float* dst, const T* src, long long row_stride, int row0,
                                          int T_len, float mul) {
    for (int e = threadIdx.x * VEC; e < BR * D; e += THREADS * VEC) {
        const int r = e / D, d = e % D;
        float v[VEC];
        if (row0 + r < T_len) {
            load_vec<T, VEC>(src + (row0 + r) * row_stride + d, v);
        } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) v[k] = 0.0f;
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) dst[r * (D + 1) + d + k] = v[k] * mul;
    }
}

template <typename T, int D, int VEC>
__global__ void __launch_bounds__(THREADS)
    causal_attention_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k,
                            const T* __restrict__ v, int T_len, int H, long long q_sb, long long q_st,
                            long long q_sh, long long k_sb, long long k_st, long long k_sh,
                            long long v_sb, long long v_st, long long v_sh, float scale) {
    constexpr int DC = D / 16;  // output columns per thread
    extern __shared__ float smem[];
    float* Qs = smem;                  // [BR][D + 1]
    float* KVs = Qs + BR * (D + 1);    // [BC][D + 1]   K tile, then V tile
    float* Ps = KVs + BC * (D + 1);    // [BR][BC + 1]

    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int q0 = blockIdx.x * BR;
    const int b = blockIdx.y / H, h = blockIdx.y % H;
    q += b * q_sb + h * q_sh;
    k += b * k_sb + h * k_sh;
    v += b * v_sb + h * v_sh;

    load_tile<T, D, VEC>(Qs, q, q_st, q0, T_len, scale * LOG2E);

    float m[4], l[4], o[4][DC];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < DC; ++c) o[i][c] = 0.0f;
    }

    // causal early exit: the last key any row of this tile sees is min(q0 + BR, T) - 1
    const int n_tiles = (min(q0 + BR, T_len) + BC - 1) / BC;
    for (int tile = 0; tile < n_tiles; ++tile) {
        const int k0 = tile * BC;
        __syncthreads();  // previous V tile fully used
        load_tile<T, D, VEC>(KVs, k, k_st, k0, T_len, 1.0f);
        __syncthreads();

        float s[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int j = 0; j < 4; ++j) s[i][j] = 0.0f;
#pragma unroll 8
        for (int d = 0; d < D; ++d) {
            float qv[4], kv[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) qv[i] = Qs[(4 * ty + i) * (D + 1) + d];
#pragma unroll
            for (int j = 0; j < 4; ++j) kv[j] = KVs[(tx + 16 * j) * (D + 1) + d];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) s[i][j] = fmaf(qv[i], kv[j], s[i][j]);
        }

#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = q0 + 4 * ty + i;
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int key = k0 + tx + 16 * j;
                if (key > row || key >= T_len) s[i][j] = -INFINITY;
                mx = fmaxf(mx, s[i][j]);
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, off));
            const float m_new = fmaxf(m[i], mx);
            // key 0 is visible to every row, so m_new is finite from the first tile on
            const float alpha = exp2f(m[i] - m_new);
            float rs = 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float p = exp2f(s[i][j] - m_new);
                Ps[(4 * ty + i) * (BC + 1) + tx + 16 * j] = p;
                rs += p;
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1) rs += __shfl_xor_sync(FULL_MASK, rs, off);
            l[i] = l[i] * alpha + rs;
            m[i] = m_new;
#pragma unroll
            for (int c = 0; c < DC; ++c) o[i][c] *= alpha;
        }

        __syncthreads();  // every thread done with K and has written its P
        load_tile<T, D, VEC>(KVs, v, v_st, k0, T_len, 1.0f);
        __syncthreads();

#pragma unroll 4
        for (int c = 0; c < BC; ++c) {
            float pv[4], vv[DC];
#pragma unroll
            for (int i = 0; i < 4; ++i) pv[i] = Ps[(4 * ty + i) * (BC + 1) + c];
#pragma unroll
            for (int cc = 0; cc < DC; ++cc) vv[cc] = KVs[c * (D + 1) + tx + 16 * cc];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int cc = 0; cc < DC; ++cc) o[i][cc] = fmaf(pv[i], vv[cc], o[i][cc]);
        }
    }

    // out is a contiguous [B, T, H, D] array
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = q0 + 4 * ty + i;
        if (row >= T_len) continue;
        const float inv = 1.0f / l[i];
        T* dst = out + ((static_cast<long long>(b) * T_len + row) * H + h) * D;
#pragma unroll
        for (int c = 0; c < DC; ++c) dst[tx + 16 * c] = from_float<T>(o[i][c] * inv);
    }
}
