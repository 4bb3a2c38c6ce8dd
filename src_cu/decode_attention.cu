// decode_attention.cu - one new query per sequence against its KV cache (q_len = 1).
//
//   out[b, h, :] = sum_{s < seq_lens[b]} softmax_s(q[b,h,:] . K[b,h,s,:] * scale) V[b,h,s,:]
//
// Cache layout [B, H, S_max, D] (contiguous); sequence b uses its first seq_lens[b] rows.
// Mapping: one block of 128 threads per (head, sequence). A group of G = D / VEC lanes
// holds one key row as 16-byte vectors (G = 8 for fp16/bf16 hd64), so a warp works on
// 32 / G keys at once; the block's 128 / G groups stride over the cache, each keeping an
// online max / sum and a partial output in registers, UNROLL keys' loads in flight.
// The groups' partial results are merged once through shared memory at the end.
// Bytes: K and V of the sequence once (2 S D sizeof(T) per head); 4 S D FLOPs.
//
// Specializations: T in {float, __half, __nv_bfloat16} x D in {64, 128}.
// Wrapper: cupy_kernels/decode_attention.py   Tests: tests/test_kernels_gpu.py
#include "common.cuh"

using namespace g2c;

namespace {
// Not tuned yet: one block per (head, sequence) with no split over the cache.
constexpr int THREADS = 128;
constexpr int UNROLL = 4;  // key rows' loads in flight per group
}  // namespace

template <typename T, int D>
__global__ void __launch_bounds__(THREADS)
    decode_attention_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k_cache,
                            const T* __restrict__ v_cache, const int* __restrict__ seq_lens, int H,
                            int S_max, long long q_sb, float scale) {
    constexpr int VEC = Vec<T>::N;
    constexpr int G = D / VEC;  // lanes per key row
    static_assert(G <= 32 && 32 % G == 0, "a key row must fit in one warp");
    constexpr int GROUPS = THREADS / G;
    __shared__ float s_m[GROUPS], s_l[GROUPS];
    __shared__ float s_o[GROUPS][D];

    const int h = blockIdx.x, b = blockIdx.y;
    const int group = threadIdx.x / G, sub = threadIdx.x % G;
    const int len = seq_lens[b];
    const long long head = (static_cast<long long>(b) * H + h) * S_max * D;
    const T* kc = k_cache + head + sub * VEC;
    const T* vc = v_cache + head + sub * VEC;

    float qv[VEC];
    load_vec<T, VEC>(q + b * q_sb + h * D + sub * VEC, qv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) qv[i] *= scale * LOG2E;

    float m = -INFINITY, l = 0.0f, acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;

    // the trip count is uniform across the block, so every lane reaches the shuffles
    for (int base = 0; base < len; base += GROUPS * UNROLL) {
        float kv[UNROLL][VEC], vv[UNROLL][VEC], dot[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int s = base + u * GROUPS + group;
            if (s < len) {
                load_vec<T, VEC>(kc + static_cast<long long>(s) * D, kv[u]);
                load_vec<T, VEC>(vc + static_cast<long long>(s) * D, vv[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float d = 0.0f;
            if (base + u * GROUPS + group < len) {
#pragma unroll
                for (int i = 0; i < VEC; ++i) d = fmaf(qv[i], kv[u][i], d);
            }
#pragma unroll
            for (int off = G / 2; off > 0; off >>= 1) d += __shfl_xor_sync(FULL_MASK, d, off);
            dot[u] = d;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (base + u * GROUPS + group >= len) break;
            const float m_new = fmaxf(m, dot[u]);
            const float alpha = exp2f(m - m_new), p = exp2f(dot[u] - m_new);
            l = l * alpha + p;
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] = fmaf(p, vv[u][i], acc[i] * alpha);
            m = m_new;
        }
    }

    if (sub == 0) {
        s_m[group] = m;
        s_l[group] = l;
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) s_o[group][sub * VEC + i] = acc[i];
    __syncthreads();

    for (int d = threadIdx.x; d < D; d += THREADS) {
        float mx = -INFINITY;
        for (int g = 0; g < GROUPS; ++g) mx = fmaxf(mx, s_m[g]);
        float sum = 0.0f, o = 0.0f;
        if (mx != -INFINITY) {
            for (int g = 0; g < GROUPS; ++g) {
                const float w = exp2f(s_m[g] - mx);
                sum += s_l[g] * w;
                o += s_o[g][d] * w;
            }
        }
        out[(static_cast<long long>(b) * H + h) * D + d] = from_float<T>(sum > 0.0f ? o / sum : 0.0f);
    }
}
