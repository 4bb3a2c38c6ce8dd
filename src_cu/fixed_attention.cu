// fixed_attention.cu - decoding attention whose bits do not depend on its block width: the
// decode step's attention, whose block width can then follow the batch.
//
//   out[b, h] = sum_s p_s v_s / sum_s p_s,   p_s = 2^(score_s - M),  M = max_s score_s,
//   score_s = (q . k_s) scale log2(e)
//
// The unit of work is a tile of keys, run by one warp whatever the width: each lane holds 16
// bytes of a key's row (VEC dimensions: 8 of a 16-bit row, 4 of a float32 one), so a key takes
// LPK = 64 / VEC lanes, and the warp's GROUPS = 32 / LPK groups of lanes take 4 keys each: tiles
// of TILE_KEYS = 4 GROUPS keys (16 in 16-bit, 8 in float32), key TILE_KEYS t + 4 group + u, each
// key's dot product over its lanes' VEC dimensions in order and an xor tree over the group.
// One pass: a warp loads a tile's keys and
// values together (two tiles in flight, the warp's last two computed together), takes the
// tile's maximum m_t (exact in any order), p = 2^(score - m_t) and the tile's sum p v and sum p
// in float32 in a fixed order (keys u = 0..3, then the groups' xor tree, as a reduce-scatter),
// and keeps them with m_t in shared memory. Then M, the maximum of the m_t (exact in any
// order); each tile's sums times 2^(m_t - M), rounded once to 64-bit fixed point, are added as
// integers, by the warp that made them and then across warps. The point: 2^32 for the sums of
// p (at most 1 a key) and for the sums of p v of 16-bit rows (2.3e-10 absolute; their values
// are bounded, below); for the
// sums of p v of float32 rows, whose values are not, a power of two chosen from a bound on
// every tile's sums (the maximum over tiles of the binary exponent of the tile's largest sum
// plus m_t, exact in any order), so that the integers cannot overflow and the largest sum keeps
// 54 bits whether the values are near 1e-38 or 1e38; the quotient is scaled back by the two
// points' ratio, a power of two. Integer addition is exact, so
// the output is the same for every block width (THREADS): the tiles' placement changes, their
// values and the sums do not. A sequence gets the same numbers in a batch of one, run by 512
// threads, as in a batch of 64, run by 128 (gpt2_cupy/model.py, DECODE_FIXED_THREADS;
// float32: DECODE_FIXED_FLOAT32).
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
// dtype (float32 / float16 / bfloat16), S_max <= 1024; seq_lens [B]; out [B, H, 64]. Grid (H, B).
// Bytes: every key and value row once (2 x 64 x sizeof(T) a key); FLOPs 4 x 64 a key.
// Specializations: T in {float, __half, __nv_bfloat16} x THREADS in {128, 256, 512}.
// Wrapper: cupy_kernels/fixed_attention.py   Tests: tests/test_fixed_attention_gpu.py
// Benchmark: benchmarks/fixed_attention.py, benchmarks/step_variants.py
#include "common.cuh"

using namespace g2c;

namespace {
constexpr int HD = 64;
constexpr int MAX_KEYS = 1024;
constexpr float FIX = 4294967296.0f;  // 2^32: 16-bit rows' fixed point

template <typename T> struct Tiling {
    static constexpr int VEC = 16 / sizeof(T);        // dimensions a lane holds (one 16-byte load)
    static constexpr int LPK = HD / VEC;              // lanes a key
    static constexpr int GROUPS = 32 / LPK;           // keys a warp takes at once
    static constexpr int TILE_KEYS = 4 * GROUPS;      // a tile: 4 keys a group
    static constexpr int TILES = MAX_KEYS / TILE_KEYS;
};

template <typename T, int N> __device__ __forceinline__ void unpack(const uint4 raw, float (&v)[N]) {
    static_assert(N * sizeof(T) == 16, "a 16-byte load");
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = to_float(e[i]);
}

// N tiles of one warp at once, their instructions interleaved (the warp's last two tiles, where
// no loads follow: at 264 keys in 16 warps, warp 0's 17th tile would otherwise run alone after
// its first): kr[n], vr[n] the rows of tile t[n] that this lane holds (key 4 grp + u of the
// tile, VEC dimensions from sub VEC). Each tile's scores (each key's dot product over its LPK
// lanes by an xor tree), their maximum m_t (exact in any order), p = 2^(score - m_t), and sum
// p v, sum p in float32 in a fixed order (keys u = 0..3, then the groups' xor tree), kept in
// shared memory with m_t; wmax: the warp's running maximum (the same in every lane), wbound
// (float32 rows): the largest binary exponent of the lane's sums plus m_t.
//
// The groups' xor tree of the sums p v is a reduce-scatter: at each level a lane keeps half
// its dimensions, adds the other lane's copy of them and sends it the other half, so each sum
// is the tree's own (the bits of every lane adding all of them) and each lane ends with 2
// dimensions: 4 + 2 shuffles and adds in 16-bit (2 in float32) instead of 16 (4). The same
// scatter for the dot products (the 4 keys over the tree's first two levels, the scores
// gathered back: 7 shuffles instead of 12, in two more dependent levels) lost at batch 8 and
// gained less at batch 1: GPT-2 small float16 223.8 / 224.1 against 221.3 / 221.5 us a sweep
// at batch 8, 165.8 / 165.7 against 165.1 / 165.2 at batch 1, XL 1302.8 / 1303.3 against
// 1300.3 / 1301.2 (H200, benchmarks/results/fixed_attention_ab-h200.log). This function, with M
// read by every thread (below), against one tile at a time, the plain xor trees and thread 0
// folding the warps' maxima: 164.8 / 165.2 against 168.7 / 168.4 us at batch 1, XL 1302.8 /
// 1304.3 against 1313.6 / 1312.5, small at batch 8 221.9 / 221.2 against 221.8 / 221.5, the same
// bits (fixed_attention_ab2-h200.log, fixed_attention_kept_bits-h200.log). The 16-bit scores on
// mma.sync instead (the tile's keys as the A operand, q in every column of B, one shuffle a key
// to this layout) lost at batch 1: GPT-2 small 167.2 against 165.4 us, though batch 8 took 219.3
// against 222.5 (H200, benchmarks/results/fixed_attention_mma_qk-h200.log; NOTES.md).
template <typename T, int N>
__device__ __forceinline__ void attend(const uint4 (*kr)[4], const uint4 (*vr)[4], const int (&t)[N],
                                       const float (&qv)[Tiling<T>::VEC], int len, int lane,
                                       float (*s_o)[HD], float* s_m, float* s_l, float& wmax, float& wbound) {
    constexpr int VEC = Tiling<T>::VEC, LPK = Tiling<T>::LPK, TILE_KEYS = Tiling<T>::TILE_KEYS;
    static_assert(VEC / Tiling<T>::GROUPS == 2, "each lane keeps 2 dimensions of a tile's sums");
    const int grp = lane / LPK, sub = lane % LPK;
    float d[N][4];
#pragma unroll
    for (int n = 0; n < N; ++n) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            float kf[VEC];
            unpack<T>(kr[n][u], kf);
            float x = 0.0f;
#pragma unroll
            for (int i = 0; i < VEC; ++i) x = __fmaf_rn(qv[i], kf[i], x);
            d[n][u] = x;
        }
    }
#pragma unroll
    for (int off = LPK / 2; off > 0; off >>= 1) {
#pragma unroll
        for (int n = 0; n < N; ++n) {
#pragma unroll
            for (int u = 0; u < 4; ++u) d[n][u] = __fadd_rn(d[n][u], __shfl_xor_sync(0xffffffffu, d[n][u], off));
        }
    }
    float sc[N][4], mt[N];
#pragma unroll
    for (int n = 0; n < N; ++n) {
#pragma unroll
        for (int u = 0; u < 4; ++u) sc[n][u] = t[n] * TILE_KEYS + grp * 4 + u < len ? d[n][u] : -INFINITY;
        mt[n] = fmaxf(fmaxf(sc[n][0], sc[n][1]), fmaxf(sc[n][2], sc[n][3]));
    }
#pragma unroll
    for (int off = LPK; off < 32; off <<= 1) {
#pragma unroll
        for (int n = 0; n < N; ++n) mt[n] = fmaxf(mt[n], __shfl_xor_sync(0xffffffffu, mt[n], off));
    }
    float o[N][VEC], l[N];
#pragma unroll
    for (int n = 0; n < N; ++n) {
#pragma unroll
        for (int i = 0; i < VEC; ++i) o[n][i] = 0.0f;
        l[n] = 0.0f;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const float p = sc[n][u] == -INFINITY ? 0.0f : exp2_approx(sc[n][u] - mt[n]);
            float vf[VEC];
            unpack<T>(vr[n][u], vf);
#pragma unroll
            for (int i = 0; i < VEC; ++i) o[n][i] = __fmaf_rn(p, vf[i], o[n][i]);
            l[n] = __fadd_rn(l[n], p);
        }
    }
    int base = 0;  // the first of this lane's 2 dimensions within its VEC
#pragma unroll
    for (int off = LPK, half = VEC / 2; off < 32; off <<= 1, half >>= 1) {  // the tile's groups
        const bool hi = lane & off;
#pragma unroll
        for (int n = 0; n < N; ++n) {
#pragma unroll
            for (int i = 0; i < half; ++i) {
                const float send = hi ? o[n][i] : o[n][half + i];
                o[n][i] = __fadd_rn(hi ? o[n][half + i] : o[n][i], __shfl_xor_sync(0xffffffffu, send, off));
            }
            l[n] = __fadd_rn(l[n], __shfl_xor_sync(0xffffffffu, l[n], off));
        }
        base += hi ? half : 0;
    }
#pragma unroll
    for (int n = 0; n < N; ++n) {
        *reinterpret_cast<float2*>(&s_o[t[n]][sub * VEC + base]) = make_float2(o[n][0], o[n][1]);
        s_m[t[n]] = mt[n], s_l[t[n]] = l[n];  // (every lane, the same values: no branch)
        wmax = fmaxf(wmax, mt[n]);
        if constexpr (sizeof(T) == 4) {  // |sum| < 2^e (e: the biased exponent - 126; subnormals and
                                         // 0 take -126); scaled by 2^(m_t - M), < 2^(e + m_t - M)
            const float big = fmaxf(fabsf(o[n][0]), fabsf(o[n][1]));
            const int e = max((__float_as_int(big) >> 23) & 0xff, 1) - 126;
            wbound = fmaxf(wbound, static_cast<float>(e) + mt[n]);
        }
    }
}
}  // namespace

// (float32: a minimum of one block an SM, which changes no limit, moves ptxas's allocation off a
// 12-byte spill at 128 threads on sm_90, 96 registers; the 16-bit kernels keep their code.)
template <typename T, int THREADS>
__global__ void __launch_bounds__(THREADS, sizeof(T) == 4 ? 1 : 0)
    fixed_attention_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k_cache,
                           const T* __restrict__ v_cache, const int* __restrict__ seq_lens, int H, int S_max,
                           float scale, long long q_sb, const int* __restrict__ positions, int early) {
    constexpr int WARPS = THREADS / 32;
    static_assert(WARPS % 4 == 0, "the warps' maxima read 4 at a time");
    constexpr int VEC = Tiling<T>::VEC, LPK = Tiling<T>::LPK, TILE_KEYS = Tiling<T>::TILE_KEYS;
    constexpr bool WIDE = sizeof(T) == 4;  // float32 rows: the fixed point follows the sums (above)
    __shared__ float s_o[Tiling<T>::TILES][HD];  // each tile's sum p v, sum p and maximum
    __shared__ float s_l[Tiling<T>::TILES], s_m[Tiling<T>::TILES];
    __shared__ __align__(16) float s_wmax[WARPS];
    __shared__ __align__(16) float s_wbound[WARPS];
    __shared__ long long s_warp[WARPS][HD + 1];  // each warp's fixed-point sums: p v [64], p
    __shared__ bool s_finite[WARPS];
    const int h = blockIdx.x, b = blockIdx.y;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, grp = lane / LPK, sub = lane % LPK;
    const long long row0 = (static_cast<long long>(b) * H + h) * S_max;
    const T* kc = k_cache + row0 * HD + sub * VEC;
    const T* vc = v_cache + row0 * HD + sub * VEC;
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
    uint4 kr[2][4], vr[2][4];  // the warp's tiles t0 and t0 + stride
    load_rows(kc, t0, early_rows, kr[0]);
    load_rows(vc, t0, early_rows, vr[0]);
    load_rows(kc, t0 + stride, early_rows, kr[1]);
    load_rows(vc, t0 + stride, early_rows, vr[1]);
    if (early) griddep_launch_dependents();
    griddep_wait();  // (programmatic dependent launch: q, the lengths and the appended rows are the kernel ahead's)
    if (!early) griddep_launch_dependents();
    if (positions == nullptr) {
        load_rows(kc, t0, rows_max, kr[0]);
        load_rows(vc, t0, rows_max, vr[0]);
        load_rows(kc, t0 + stride, rows_max, kr[1]);
        load_rows(vc, t0 + stride, rows_max, vr[1]);
    } else if (early_rows < rows_max) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const long long at = static_cast<long long>(early_rows) * HD;
            if (t0 * TILE_KEYS + grp * 4 + u == early_rows) {
                kr[0][u] = __ldcg(reinterpret_cast<const uint4*>(kc + at));
                vr[0][u] = __ldcg(reinterpret_cast<const uint4*>(vc + at));
            }
            if ((t0 + stride) * TILE_KEYS + grp * 4 + u == early_rows) {
                kr[1][u] = __ldcg(reinterpret_cast<const uint4*>(kc + at));
                vr[1][u] = __ldcg(reinterpret_cast<const uint4*>(vc + at));
            }
        }
    }
    float qv[VEC];
    unpack<T>(*reinterpret_cast<const uint4*>(q + b * q_sb + static_cast<long long>(h) * HD + sub * VEC), qv);
#pragma unroll
    for (int i = 0; i < VEC; ++i) qv[i] *= scale * LOG2E;
    const int len = min(seq_lens[b], rows_max);
    const int tiles = (len + TILE_KEYS - 1) / TILE_KEYS;
#pragma unroll
    for (int u = 0; u < 4; ++u) {
        const uint4 z = make_uint4(0, 0, 0, 0);
        if (t0 * TILE_KEYS + grp * 4 + u >= len) kr[0][u] = vr[0][u] = z;
        if ((t0 + stride) * TILE_KEYS + grp * 4 + u >= len) kr[1][u] = vr[1][u] = z;
    }

    // One pass over the warp's tiles, two in flight: each tile's keys and values together
    // (attend, above); the last two together.
    float wmax = -INFINITY, wbound = -INFINITY;
    int t = t0;  // kr[0] holds tile t, kr[1] tile t + stride
    while (t + 2 * stride < tiles) {  // tiles after these two: each one's loads requested behind it
        attend<T, 1>(kr, vr, {t}, qv, len, lane, s_o, s_m, s_l, wmax, wbound);
        load_rows(kc, t + 2 * stride, len, kr[0]);
        load_rows(vc, t + 2 * stride, len, vr[0]);
        attend<T, 1>(kr + 1, vr + 1, {t + stride}, qv, len, lane, s_o, s_m, s_l, wmax, wbound);
        load_rows(kc, t + 3 * stride, len, kr[1]);
        load_rows(vc, t + 3 * stride, len, vr[1]);
        t += 2 * stride;
    }
    if (t < tiles) {  // (this form, and the stores above from every lane: no stack in ptxas's sm_80 code)
        if (t + stride < tiles) {
            attend<T, 2>(kr, vr, {t, t + stride}, qv, len, lane, s_o, s_m, s_l, wmax, wbound);
        } else {
            attend<T, 1>(kr, vr, {t}, qv, len, lane, s_o, s_m, s_l, wmax, wbound);
        }
    }
    if (lane == 0) s_wmax[warp] = wmax;  // (every lane holds the same: the tiles' maxima are the warp's)
    if constexpr (WIDE) {
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) wbound = fmaxf(wbound, __shfl_xor_sync(0xffffffffu, wbound, off));
        if (lane == 0) s_wbound[warp] = wbound;
    }
    __syncthreads();
    // M, the block's maximum (and float32's bound), read by every thread: no thread waits for
    // another to fold them.
    float M = -INFINITY, bound = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; w += 4) {
        const float4 m4 = *reinterpret_cast<const float4*>(&s_wmax[w]);
        M = fmaxf(fmaxf(fmaxf(M, m4.x), m4.y), fmaxf(m4.z, m4.w));
        if constexpr (WIDE) {
            const float4 b4 = *reinterpret_cast<const float4*>(&s_wbound[w]);
            bound = fmaxf(fmaxf(fmaxf(bound, b4.x), b4.y), fmaxf(b4.z, b4.w));
        }
    }
    // float32's point for the sums of p v, 2^k: every scaled sum is below 2^E, E = ceil(bound -
    // M) + 1 (one for the rounding of e + m_t), and at most TILES = 2^7 of them add up, so k =
    // 55 - E keeps the total under 2^62. (E >= -124: the tile holding M has e >= -125; the clamp
    // only keeps the powers below representable.) The scaling by 2^k, and back by 2^(32 - k),
    // goes in two exact steps, each a power of two a float holds. A bound that is not finite
    // comes with a sum that is not: the output is NaN either way.
    float fix_a = 1.0f, fix_b = 1.0f, back_a = 1.0f, back_b = 1.0f;
    if constexpr (WIDE) {
        static_assert(Tiling<T>::TILES <= 128, "the fixed point's headroom");
        const float E = ceilf(bound - M) + 1.0f;
        const int k = isfinite(E) ? 55 - static_cast<int>(fminf(fmaxf(E, -160.0f), 160.0f)) : 0;  // [-105, 215]
        auto pow2 = [](int n) { return __int_as_float((n + 127) << 23); };  // n in [-126, 127]
        fix_a = pow2(k / 2), fix_b = pow2(k - k / 2);
        back_a = pow2((32 - k) / 2), back_b = pow2(32 - k - (32 - k) / 2);
    }

    // Each tile's sums scaled to the maximum, 2^(m_t - M), rounded once to 64-bit fixed point and
    // added as integers by the warp that made them: lane i takes dimensions i and i + 32.
    // (A first build kept the scores in shared memory and summed p v in a second pass over the
    // values, prefetched into L2 during the first, with the exact M from the start: in the
    // decode step at B = 1 it took 208.1 / 200.2 / 193.1 us a step for GPT-2 small at 128 /
    // 256 / 512 threads against 198.6 for decode_attention, B = 64 634.4 at 128 against 614.6;
    // H100, benchmarks/results/fixed_attention_prewait*-h100.json.)
    // A sum that is not finite (a NaN or infinity in the rows) would convert to a finite
    // integer: the warp flags it and the output is NaN. (Finite 16-bit rows cannot overflow:
    // |sum p v| <= 16 x 65504 a tile, under 2^21; 64 tiles of it x 2^32 stay under 2^63.
    // float32 rows: their point, above.)
    long long acc0 = 0, acc1 = 0, acc_l = 0;
    bool finite = true;
    for (int t = t0; t < tiles; t += stride) {
        const float sc = exp2_approx(s_m[t] - M);
        const float a = __fmul_rn(s_o[t][lane], sc), c = __fmul_rn(s_o[t][lane + 32], sc), l = __fmul_rn(s_l[t], sc);
        finite = finite && isfinite(a) && isfinite(c) && isfinite(l);
        if constexpr (WIDE) {
            acc0 += __float2ll_rn(__fmul_rn(__fmul_rn(a, fix_a), fix_b));
            acc1 += __float2ll_rn(__fmul_rn(__fmul_rn(c, fix_a), fix_b));
        } else {
            acc0 += __float2ll_rn(a * FIX);
            acc1 += __float2ll_rn(c * FIX);
        }
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
        if constexpr (WIDE) {
            const float r = d > 0.0f ? __fmul_rn(__fmul_rn(__fdiv_rn(__ll2float_rn(num), d), back_a), back_b) : 0.0f;
            out[(static_cast<long long>(b) * H + h) * HD + threadIdx.x] = !ok ? __int_as_float(0x7fc00000) : r;
        } else {
            out[(static_cast<long long>(b) * H + h) * HD + threadIdx.x] =
                from_float<T>(!ok ? __int_as_float(0x7fc00000) : d > 0.0f ? __fdiv_rn(__ll2float_rn(num), d) : 0.0f);
        }
    }
}
