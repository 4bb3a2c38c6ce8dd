// decode_attention.cu - one new query per sequence and head against the KV cache (q_len = 1),
// with GQA / MQA, optional ALiBi, quantized caches and a split over the cache (Flash-Decoding).
//
//   out[b, h, :] = sum_{s < len_b} softmax_s(q[b,h,:] . K[b,g,s,:] * scale + alibi[h] (s - len_b + 1)) V[b,g,s,:]
//
// with g = h / (H / H_kv) the key/value head of query head h (MHA: H_kv = H; MQA: H_kv = 1).
// Cache layout [B, H_kv, S_max, D] in the model's dtype, int8 or fp8 e4m3 (kv.cuh; quantized
// rows carry a float scale each, [B, H_kv, S_max]). Sequence b uses its first len_b rows.
//
// Mapping: a block of 128 threads per (QPB query heads of one KV head, sequence, split).
// A group of G = D / N lanes holds one key row as 16-byte vectors (N elements each: G = 8
// for fp16 hd64, 16 for fp16 hd128, 8 for int8 hd128), so the block's 128 / G groups work on
// different keys; each loads UNROLL key and value rows before using any, then computes QPB
// dot products per key (the KV row is read once for the QPB heads that share it: GQA),
// reduces them over the G lanes with xor-shuffles and updates an online softmax (one
// rescale per UNROLL keys). The groups' partial results are merged through shared memory.
// Split: blockIdx.z takes one of gridDim.z equal chunks of the sequence (multiples of the
// block's key tile). With one split the block writes out; otherwise it writes its output,
// normalized, and its log2-sum-exp to float32 scratch, and the chunks are combined either
// by the last block of the heads to finish (given counters) or by decode_attention_merge_kernel.
// Bytes: the K and V rows of each sequence once (2 len D sizeof(KT) per KV head, + scales);
// FLOPs 4 len D per query head.
//
// Specializations: T in {float, __half, __nv_bfloat16} x KT in {T, signed char, __nv_fp8_e4m3}
// x D in {64, 128} x QPB in {1, 2, 4}.
// Wrapper: cupy_kernels/decode_attention.py   Tests: tests/test_decode_attention_gpu.py
// Benchmark: benchmarks/decode_attention.py
#include "kv.cuh"

using namespace g2c;

namespace {
constexpr int THREADS = 128;
constexpr int UNROLL = 4;  // key and value rows in flight per group
}  // namespace

// Load n = VEC elements of the query starting at p (VEC a multiple of T's 16-byte vector).
template <typename T, int VEC>
__device__ __forceinline__ void load_query(const T* p, float mul, float (&out)[VEC]) {
    constexpr int TV = Vec<T>::N;
    static_assert(VEC % TV == 0, "a lane's query slice is whole 16-byte vectors");
#pragma unroll
    for (int c = 0; c < VEC; c += TV) {
        float part[TV];
        load_vec<T, TV>(p + c, part);
#pragma unroll
        for (int i = 0; i < TV; ++i) out[c + i] = part[i] * mul;
    }
}

// out[row, d] = sum_i w_i o_i[row, d] / sum_i w_i over the splits, w_i = 2^(lse_i - max lse).
// Loads bypass L1 (__ldcg): the partial results were written by other blocks.
template <typename T, int D>
__device__ __forceinline__ void merge_splits(T* __restrict__ out, const float* __restrict__ part_o,
                                             const float* __restrict__ part_lse, long long row, int rows,
                                             int splits, int d) {
    float mx = -INFINITY;
    for (int i = 0; i < splits; ++i) mx = fmaxf(mx, __ldcg(part_lse + i * static_cast<long long>(rows) + row));
    float sum = 0.0f, o = 0.0f;
    if (mx != -INFINITY) {
        for (int i = 0; i < splits; ++i) {
            const long long part = i * static_cast<long long>(rows) + row;
            const float w = exp2f(__ldcg(part_lse + part) - mx);
            sum += w;
            o = fmaf(w, __ldcg(part_o + part * D + d), o);
        }
    }
    out[row * D + d] = from_float<T>(sum > 0.0f ? o / sum : 0.0f);
}

template <typename T, typename KT, int D, int QPB>
__global__ void __launch_bounds__(THREADS)
    decode_attention_kernel(T* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_lse,
                            unsigned* __restrict__ counters, const T* __restrict__ q, const KT* __restrict__ k_cache,
                            const KT* __restrict__ v_cache, const float* __restrict__ k_scale,
                            const float* __restrict__ v_scale, const int* __restrict__ seq_lens,
                            const float* __restrict__ alibi, int H, int H_kv, int S_max, long long q_sb,
                            float scale) {
    using Fmt = KvFormat<KT>;
    constexpr int VEC = KvVec<KT>::N;
    constexpr int G = D / VEC;  // lanes per key row
    static_assert(G <= 32 && 32 % G == 0, "a key row must fit in one warp");
    constexpr int GROUPS = THREADS / G;
    constexpr int TILE = GROUPS * UNROLL;  // keys per loop trip; split chunks are multiples
    __shared__ float s_m[QPB][GROUPS], s_l[QPB][GROUPS];
    __shared__ float s_o[QPB][GROUPS][D];

    const int heads_per_kv = H / H_kv, head_groups = heads_per_kv / QPB;
    const int g = blockIdx.x / head_groups;                          // KV head
    const int h0 = g * heads_per_kv + (blockIdx.x % head_groups) * QPB;  // first query head
    const int b = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int group = threadIdx.x / G, sub = threadIdx.x % G;
    const int len = seq_lens[b];
    const int chunk = (len + splits * TILE - 1) / (splits * TILE) * TILE;
    const int s_begin = split * chunk, s_end = min(len, s_begin + chunk);

    const long long row0 = (static_cast<long long>(b) * H_kv + g) * S_max;  // cache row of position 0
    const KT* kc = k_cache + row0 * D + sub * VEC;
    const KT* vc = v_cache + row0 * D + sub * VEC;

    float qv[QPB][VEC], slope[QPB], m[QPB], l[QPB], acc[QPB][VEC];
#pragma unroll
    for (int j = 0; j < QPB; ++j) {
        load_query<T, VEC>(q + b * q_sb + (h0 + j) * D + sub * VEC, scale * LOG2E, qv[j]);
        slope[j] = alibi != nullptr ? alibi[h0 + j] * LOG2E : 0.0f;
        m[j] = -INFINITY;
        l[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[j][i] = 0.0f;
    }

    // the trip count is uniform across the block, so every lane reaches the shuffles
    for (int base = s_begin; base < s_end; base += TILE) {
        KvVec<KT> kr[UNROLL], vr[UNROLL];
        float ksc[UNROLL], vsc[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int s = base + u * GROUPS + group;
            ksc[u] = vsc[u] = 1.0f;
            if (s < s_end) {
                kr[u].load(kc + static_cast<long long>(s) * D);
                vr[u].load(vc + static_cast<long long>(s) * D);
                if constexpr (Fmt::QUANTIZED) {
                    ksc[u] = k_scale[row0 + s];
                    vsc[u] = v_scale[row0 + s];
                }
            } else {  // a masked key must not bring NaN into 0 * v
                kr[u].zero();
                vr[u].zero();
            }
        }
        float dot[QPB][UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float kf[VEC];
            kr[u].unpack(kf);
#pragma unroll
            for (int j = 0; j < QPB; ++j) {
                float d = 0.0f;
#pragma unroll
                for (int i = 0; i < VEC; ++i) d = fmaf(qv[j][i], kf[i], d);
                dot[j][u] = d;
            }
        }
#pragma unroll
        for (int j = 0; j < QPB; ++j) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
                for (int off = G / 2; off > 0; off >>= 1) dot[j][u] += __shfl_xor_sync(FULL_MASK, dot[j][u], off);
            }
        }
        float p[QPB][UNROLL];
#pragma unroll
        for (int j = 0; j < QPB; ++j) {
            float tile_max = -INFINITY;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int s = base + u * GROUPS + group;
                dot[j][u] = s < s_end ? fmaf(slope[j], static_cast<float>(s - len + 1), dot[j][u] * ksc[u]) : -INFINITY;
                tile_max = fmaxf(tile_max, dot[j][u]);
            }
            const float m_new = fmaxf(m[j], tile_max);
            const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // nothing seen yet: keep exp2 finite
            const float alpha = exp2f(m[j] - m_use);
            l[j] *= alpha;
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[j][i] *= alpha;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                p[j][u] = exp2f(dot[j][u] - m_use);
                l[j] += p[j][u];
                p[j][u] *= vsc[u];
            }
            m[j] = m_new;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float vf[VEC];
            vr[u].unpack(vf);
#pragma unroll
            for (int j = 0; j < QPB; ++j) {
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[j][i] = fmaf(p[j][u], vf[i], acc[j][i]);
            }
        }
    }

#pragma unroll
    for (int j = 0; j < QPB; ++j) {
        if (sub == 0) {
            s_m[j][group] = m[j];
            s_l[j][group] = l[j];
        }
#pragma unroll
        for (int i = 0; i < VEC; ++i) s_o[j][group][sub * VEC + i] = acc[j][i];
    }
    __syncthreads();

    for (int e = threadIdx.x; e < QPB * D; e += THREADS) {
        const int j = e / D, d = e % D;
        float mx = -INFINITY;
        for (int k = 0; k < GROUPS; ++k) mx = fmaxf(mx, s_m[j][k]);
        float sum = 0.0f, o = 0.0f;
        if (mx != -INFINITY) {
            for (int k = 0; k < GROUPS; ++k) {
                const float w = exp2f(s_m[j][k] - mx);
                sum += s_l[j][k] * w;
                o += s_o[j][k][d] * w;
            }
        }
        const long long row = static_cast<long long>(b) * H + h0 + j;  // (b, h)
        const float o_norm = sum > 0.0f ? o / sum : 0.0f;
        if (splits == 1) {
            out[row * D + d] = from_float<T>(o_norm);
        } else {
            const long long part = static_cast<long long>(split) * gridDim.y * H + row;
            part_o[part * D + d] = o_norm;
            if (d == 0) part_lse[part] = sum > 0.0f ? mx + __log2f(sum) : -INFINITY;
        }
    }
    if (splits == 1 || counters == nullptr) return;

    // The last of the splits of these heads to finish merges them all (no second launch).
    // atomicInc wraps to 0 after splits - 1, so the counters are zero again for the next call.
    __shared__ bool s_last;
    __threadfence();  // this thread's partial results are visible to the GPU before it is counted
    __syncthreads();
    if (threadIdx.x == 0) s_last = atomicInc(&counters[b * gridDim.x + blockIdx.x], splits - 1) == splits - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int e = threadIdx.x; e < QPB * D; e += THREADS) {
        const long long row = static_cast<long long>(b) * H + h0 + e / D;
        merge_splits<T, D>(out, part_o, part_lse, row, gridDim.y * H, splits, e % D);
    }
}

// The merge as a kernel of its own, for launches without counters: one block of D
// threads per (sequence, head) row.
template <typename T, int D>
__global__ void __launch_bounds__(D)
    decode_attention_merge_kernel(T* __restrict__ out, const float* __restrict__ part_o,
                                  const float* __restrict__ part_lse, int rows, int splits) {
    merge_splits<T, D>(out, part_o, part_lse, blockIdx.x, rows, splits, threadIdx.x);
}
