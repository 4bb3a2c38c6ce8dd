// fixed_attention.cu - decoding attention whose bits do not depend on its block width: the
// decode step's attention for 16-bit caches, whose block width can then follow the batch.
//
//   out[b, h] = sum_s p_s v_s / sum_s p_s,   p_s = 2^(score_s - M),  M = max_s score_s,
//   score_s = (q . k_s) scale log2(e)
//
// The unit of work is a tile of 16 keys, run by one warp whatever the width: 4 groups of 8
// lanes, each group 4 keys (16 t + 4 group + u), each key's dot product over the 8 lanes' 8
// dimensions in order and an xor tree over the group. One pass: a warp loads a tile's keys and
// values together (two tiles in flight), takes the tile's maximum m_t (exact in any order),
// p = 2^(score - m_t) and the tile's sum p v and sum p in float32 in a fixed order (keys u =
// 0..3, then the groups' xor tree: every lane ends with the same bits), and keeps them with
// m_t in shared memory. Then M, the maximum of the m_t (exact in any order); each tile's sums
// times 2^(m_t - M), rounded once to 64-bit fixed point (x 2^32, 2.3e-10 absolute), are added
// as integers, by the warp that made them and then across warps. Integer addition is exact, so
// the output is the same for every block width (THREADS): the tiles' placement changes, their
// values and the sums do not. A sequence gets the same numbers in a batch of one, run by 512
// threads, as in a batch of 64, run by 128 (gpt2_cupy/model.py, DECODE_FIXED_THREADS).
//
// Programmatic dependent launch: each warp's first two tiles are requested before
// griddep_wait(). With positions (a decode step: the row the q|k|v product appends for each
// sequence, seq_lens = positions + 1), the rows below it, written by earlier steps, come before
// the wait and the appended row after it, through L2; without, all of them after it. (So the
// positions must be final when this kernel starts: where decode steps chain in one CUDA graph,
// the step's first q|k|v product lets it start only after that product's own wait;
// gpt2_cupy/model.py, record_step's chained.) The next
// kernel may start once every block has passed its wait, or with early, once every block has
// requested those rows (before its wait): the same numbers either way.
//
// Layout: q [B, H, 64] (rows q_sb elements apart); k_cache, v_cache [B, H, S_max, 64] in q's
// dtype (float16 / bfloat16), S_max <= 1024; seq_lens [B]; out [B, H, 64]. Grid (H, B).
// Bytes: every key and value row once (2 x 128 bytes a key); FLOPs 4 x 64 a key.
// Specializations: T in {__half, __nv_bfloat16} x THREADS in {128, 256, 512}.
// Wrapper: cupy_kernels/fixed_attention.py   Tests: tests/test_fixed_attention_gpu.py
// Benchmark: benchmarks/fixed_attention.py, benchmarks/step_variants.py
#include "common.cuh"

using namespace g2c;

namespace {
constexpr int HD = 64;
constexpr int TILE_KEYS = 16;
constexpr int MAX_KEYS = 1024;
constexpr float FIX = 4294967296.0f;  // 2^32

template <typename T> __device__ __forceinline__ void unpack8(const uint4& raw, float (&v)[8]) {
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = to_float(e[i]);
}
}  // namespace

template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS)
    fixed_attention_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k_cache,
                           const T* __restrict__ v_cache, const int* __restrict__ seq_lens, int H, int S_max,
                           float scale, long long q_sb, const int* __restrict__ positions, int early) {
    constexpr int WARPS = THREADS / 32;
    __shared__ float s_o[MAX_KEYS / TILE_KEYS][HD];  // each tile's sum p v, sum p and maximum
    __shared__ float s_l[MAX_KEYS / TILE_KEYS], s_m[MAX_KEYS / TILE_KEYS];
    __shared__ float s_wmax[WARPS];
    __shared__ float s_bmax;
    __shared__ long long s_warp[WARPS][HD + 1];  // each warp's fixed-point sums: p v [64], p
    __shared__ bool s_finite[WARPS];
    const int h = blockIdx.x, b = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / 8, sub = lane % 8;
    const long long row0 = (static_cast<long long>(b) * H + h) * S_max;
    const T* kc = k_cache + row0 * HD + sub * 8;
    const T* vc = v_cache + row0 * HD + sub * 8;
    auto load_rows = [&](const T* base, int t, int end, uint4 (&rows)[4]) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int s = t * TILE_KEYS + grp * 4 + u;
            rows[u] = s < end ? *reinterpret_cast<const uint4*>(base + static_cast<long long>(s) * HD)
                              : make_uint4(0, 0, 0, 0);
        }
    };
    // The warp's first two tiles: keys and values requested at once, before the length arrives;
    // rows past it are zeroed once it has (a cache's unused rows may hold NaN). With positions
    // (the row the kernel ahead appends for each sequence; a decode step's, which only its last
    // kernel moves on), the rows below it, written in earlier steps, are requested before the
    // wait for the kernel ahead, and the appended row after it, through L2.
    const int t0 = warp, stride = WARPS;
    const int rows_max = min(S_max, MAX_KEYS);
    const int early_rows = positions != nullptr ? min(positions[b], rows_max) : 0;
    uint4 k0[4], v0[4], k1[4], v1[4];
    load_rows(kc, t0, early_rows, k0);
    load_rows(vc, t0, early_rows, v0);
    load_rows(kc, t0 + stride, early_rows, k1);
    load_rows(vc, t0 + stride, early_rows, v1);
    if (early) griddep_launch_dependents();
    griddep_wait();  // (programmatic dependent launch: q, the lengths and the appended rows are the kernel ahead's)
    if (!early) griddep_launch_dependents();
    if (positions == nullptr) {
        load_rows(kc, t0, rows_max, k0);
        load_rows(vc, t0, rows_max, v0);
        load_rows(kc, t0 + stride, rows_max, k1);
        load_rows(vc, t0 + stride, rows_max, v1);
    } else if (early_rows < rows_max) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const long long at = static_cast<long long>(early_rows) * HD;
            if (t0 * TILE_KEYS + grp * 4 + u == early_rows) {
                k0[u] = __ldcg(reinterpret_cast<const uint4*>(kc + at));
                v0[u] = __ldcg(reinterpret_cast<const uint4*>(vc + at));
            }
            if ((t0 + stride) * TILE_KEYS + grp * 4 + u == early_rows) {
                k1[u] = __ldcg(reinterpret_cast<const uint4*>(kc + at));
                v1[u] = __ldcg(reinterpret_cast<const uint4*>(vc + at));
            }
        }
    }
    float qv[8];
    unpack8<T>(*reinterpret_cast<const uint4*>(q + b * q_sb + static_cast<long long>(h) * HD + sub * 8), qv);
#pragma unroll
    for (int i = 0; i < 8; ++i) qv[i] *= scale * LOG2E;
    const int len = min(seq_lens[b], rows_max);
    const int tiles = (len + TILE_KEYS - 1) / TILE_KEYS;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const uint4 z = make_uint4(0, 0, 0, 0);
        if (t0 * TILE_KEYS + grp * 4 + u >= len) k0[u] = v0[u] = z;
        if ((t0 + stride) * TILE_KEYS + grp * 4 + u >= len) k1[u] = v1[u] = z;
    }

    // One pass over the warp's tiles, two in flight: each tile's keys and values together, its
    // scores, their maximum m_t (exact in any order), p = 2^(score - m_t), and sum p v, sum p
    // in float32 in a fixed order (keys u = 0..3, then the groups' xor tree: every lane ends
    // with the same bits), kept in shared memory with m_t.
    float wmax = -INFINITY;
    auto do_tile = [&](const uint4 (&kr)[4], const uint4 (&vr)[4], int t) {
        float sc[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const int s = t * TILE_KEYS + grp * 4 + u;
            float kf[8];
            unpack8<T>(kr[u], kf);
            float d = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i) d = __fmaf_rn(qv[i], kf[i], d);
#pragma unroll
            for (int off = 4; off > 0; off >>= 1) d = __fadd_rn(d, __shfl_xor_sync(0xffffffffu, d, off));
            sc[u] = s < len ? d : -INFINITY;
        }
        float mt = fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3]));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 8));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 16));
        float o[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        float l = 0.0f;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const float p = sc[u] == -INFINITY ? 0.0f : exp2_approx(sc[u] - mt);
            float vf[8];
            unpack8<T>(vr[u], vf);
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = __fmaf_rn(p, vf[i], o[i]);
            l = __fadd_rn(l, p);
        }
#pragma unroll
        for (int off = 8; off < 32; off <<= 1) {  // the tile's four groups
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = __fadd_rn(o[i], __shfl_xor_sync(0xffffffffu, o[i], off));
            l = __fadd_rn(l, __shfl_xor_sync(0xffffffffu, l, off));
        }
        if (grp == 0) {
#pragma unroll
            for (int i = 0; i < 8; ++i) s_o[t][sub * 8 + i] = o[i];
            if (sub == 0) s_m[t] = mt, s_l[t] = l;
        }
        wmax = fmaxf(wmax, mt);
    };
    if (t0 < tiles) do_tile(k0, v0, t0);
    load_rows(kc, t0 + 2 * stride, len, k0);
    load_rows(vc, t0 + 2 * stride, len, v0);
    if (t0 + stride < tiles) do_tile(k1, v1, t0 + stride);
    load_rows(kc, t0 + 3 * stride, len, k1);
    load_rows(vc, t0 + 3 * stride, len, v1);
    for (int t = t0 + 2 * stride; t < tiles; t += 2 * stride) {
        do_tile(k0, v0, t);
        load_rows(kc, t + 2 * stride, len, k0);
        load_rows(vc, t + 2 * stride, len, v0);
        if (t + stride < tiles) do_tile(k1, v1, t + stride);
        load_rows(kc, t + 3 * stride, len, k1);
        load_rows(vc, t + 3 * stride, len, v1);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) wmax = fmaxf(wmax, __shfl_xor_sync(0xffffffffu, wmax, off));
    if (lane == 0) s_wmax[warp] = wmax;
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = -INFINITY;
        for (int w = 0; w < WARPS; ++w) m = fmaxf(m, s_wmax[w]);
        s_bmax = m;
    }
    __syncthreads();
    const float M = s_bmax;

    // Each tile's sums scaled to the maximum, 2^(m_t - M), rounded once to 64-bit fixed point and
    // added as integers by the warp that made them: lane i takes dimensions i and i + 32.
    // (A first build kept the scores in shared memory and summed p v in a second pass over the
    // values, prefetched into L2 during the first, with the exact M from the start: in the
    // decode step at B = 1 it took 208.1 / 200.2 / 193.1 us a step for GPT-2 small at 128 /
    // 256 / 512 threads against 198.6 for decode_attention, B = 64 634.4 at 128 against 614.6;
    // H100, benchmarks/results/fixed_attention_prewait*-h100.json.)
    // A sum that is not finite (a NaN or infinity in the rows) would convert to a finite
    // integer: the warp flags it and the output is NaN. (Finite 16-bit rows cannot overflow:
    // |sum p v| <= 16 x 65504 a tile, under 2^21; 64 tiles of it x 2^32 stay under 2^63.)
    long long acc0 = 0, acc1 = 0, acc_l = 0;
    bool finite = true;
    for (int t = t0; t < tiles; t += stride) {
        const float sc = exp2_approx(s_m[t] - M);
        const float a = __fmul_rn(s_o[t][lane], sc), c = __fmul_rn(s_o[t][lane + 32], sc), l = __fmul_rn(s_l[t], sc);
        finite = finite && isfinite(a) && isfinite(c) && isfinite(l);
        acc0 += __float2ll_rn(a * FIX);
        acc1 += __float2ll_rn(c * FIX);
        acc_l += __float2ll_rn(l * FIX);
    }
    s_warp[warp][lane] = acc0;
    s_warp[warp][lane + 32] = acc1;
    if (lane == 0) s_warp[warp][HD] = acc_l;
    finite = __all_sync(0xffffffffu, finite);
    if (lane == 0) s_finite[warp] = finite;
    __syncthreads();
    if (threadIdx.x < HD) {  // integer sums: any order gives the same
        long long num = 0, den = 0;
        bool ok = true;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) num += s_warp[w][threadIdx.x], den += s_warp[w][HD], ok = ok && s_finite[w];
        const float d = __ll2float_rn(den);
        out[(static_cast<long long>(b) * H + h) * HD + threadIdx.x] =
            from_float<T>(!ok ? __int_as_float(0x7fc00000) : d > 0.0f ? __fdiv_rn(__ll2float_rn(num), d) : 0.0f);
    }
}
