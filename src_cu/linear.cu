// linear.cu - y = x W^T + bias for a few to a few hundred rows of x: the decode step's
// products and the LM head, with the neighbouring element-wise work fused in. Two kernels:
// linear_kernel on CUDA cores (float32, and 16-bit rows that are not 16-byte vectors), and
// linear_mma_kernel on tensor cores (float16 / bfloat16), after the first; same epilogues.
// Beside the second, four variants with its bits: linear_mma_ahead_kernel (W a batch ahead),
// linear_mma_stats_warp_kernel (a warp more a block for the folded LayerNorm's statistics),
// linear_mma_stream_kernel (the LM head of 17 to 64 rows, W through shared memory) and
// linear_mma_list_kernel (the exact tiles of a screened LM head, whose 8-bit pass,
// linear_q8_max_kernel, closes this file).
//
//   xn        = LN ? layernorm(x; ln_w, ln_b, eps) rounded to T : x          (prologue; on tensor
//               cores also folded: W = W0 diag(ln_w), the rows' mean / rstd from the row
//               statistics of the RESIDUAL product that wrote x, applied in the epilogue)
//   s[b, n]   = sum_k xn[b, k] W[n, k]                                        W: (out, in)
//   STORE     y = s + bias                       GELU      y = gelu_tanh(s + bias)
//   RESIDUAL  y = T(res + T(s) + bias)  (res may be y: the residual stream, updated in place);
//             on tensor cores optionally each block's (mean, m2) of its 16 outputs of each row
//   QKV_CACHE y = s + bias (the fused q|k|v row), and the k and v columns also into the KV
//             cache [B, H, S_max, D] at positions[b]; seq_lens[b] = positions[b] + 1
//   ARGMAX    y = s + bias (float logits, optional) and, per block and row of x, the largest
//             value and its first index (argmax_partials_kernel in sampling.cu finishes)
//
// linear_kernel. Mapping: a warp owns RW consecutive rows of W at a time (blocks of 4 or 8 warps; a warp
// walks further row groups when the grid has fewer warps than groups). Each lane loads U
// 16-byte chunks of each of its RW rows before it uses the first (RW * U loads in flight
// per lane, through the non-coherent path without L1 allocation: every weight byte is read
// once per step), dots them with up to BR rows of x staged in shared memory as float32,
// then requests the next U chunks. Shuffles sum within a warp. Each lane visits its columns
// in increasing order, so an output's bits depend on K (and, with LN, on the block width,
// which the wrapper fixes by shape), never on RW, U, BR or the batch: a sequence gets the
// same numbers alone and in a batch. More than BR rows of x: passes of BR rows, W re-read.
// LayerNorm prologue: each thread sums the chunks of x it stages (kept in registers for a
// single row), warp shuffles, then the warps' sums in a fixed order; two passes (mean, then
// variance), as layernorm.cu.
//
// Programmatic dependent launch: the first U chunks of W, the bias and the LayerNorm
// parameters are requested before griddep_wait(), so they stream in while the kernel before
// this one finishes (the step never writes them); x, the residual, the positions and every
// output are touched only after it (on tensor cores, what the epilogue reads is requested
// by cp.async right after it, so that it lands while the product runs). The loads of W are
// coherent (load_stream16), which ptxas cannot move past the wait; it moved most of the
// first batch of non-coherent ones after it in the products with the folded LayerNorm
// (common.cuh: 512-token calls of GPT-2 XL float16 1755 -> 1683-1688 us a token with this).
//
// Bytes: N K sizeof(T) of W once per pass (+ B K of x from L2 per block); 2 B N K FLOPs:
// bandwidth bound for a few rows. Used inside the decode step instead of cuBLAS, which cannot
// run in a captured CUDA graph.
//
// Specializations: linear_kernel: T in {float, __half, __nv_bfloat16} x OutT in {T, float}
// x VEC (1, and 4 for float) x (RW, U) tiles x BR in {1, 4} x LN x EPI; linear_mma_kernel:
// T in {__half, __nv_bfloat16} x OutT x NT n-tiles x U x XIN x EPI x MT m-tiles (2: float
// logits at NT = 8); linear_mma_ahead_kernel: T x U x EPI (store, GELU, residual);
// linear_mma_stats_warp_kernel: T x U x EPI (store, GELU, q|k|v into the cache), folded;
// linear_mma_stream_kernel: T x XIN (plain, folded) x EPI (store, argmax), float logits;
// linear_mma_list_kernel: T x U (folded, argmax); linear_q8_max_kernel: T;
// ln_rows_kernel: T (cupy_kernels/linear.py, where each launch shape is chosen, with the
// measurements behind it).
// Wrapper: cupy_kernels/linear.py   Tests: tests/test_kernels_gpu.py, tests/test_head_screen_gpu.py
// Benchmark: benchmarks/decode_step.py (every GPT-2 weight shape, each tile)
#include "common.cuh"
#include "mma.cuh"
#include "linear.cuh"

using namespace g2c;

namespace {
constexpr int MAX_WARPS = 8;
constexpr int LN_CHUNKS = 2;  // chunks of a LayerNorm row per thread (the wrapper sizes blocks for it); 4 cost registers
enum Epilogue : int { STORE = 0, GELU = 1, RESIDUAL = 2, ARGMAX = 3, QKV_CACHE = 4 };

// VEC elements of W as they came from memory, kept packed until used.
template <typename T, int VEC> struct WChunk {
    uint4 raw;
    __device__ __forceinline__ void load(const T* p) { raw = load_stream16(p); }
    __device__ __forceinline__ void zero() { raw = make_uint4(0, 0, 0, 0); }
    __device__ __forceinline__ void unpack(float (&v)[VEC]) const {
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < VEC; ++i) v[i] = to_float(e[i]);
    }
};
template <typename T> struct WChunk<T, 1> {
    T raw;
    __device__ __forceinline__ void load(const T* p) { raw = __ldg(p); }
    __device__ __forceinline__ void zero() { raw = from_float<T>(0.0f); }
    __device__ __forceinline__ void unpack(float (&v)[1]) const { v[0] = to_float(raw); }
};

// Batch of loads: chunk u of row r covers columns k0 + (u * 32 + lane) * VEC.
template <typename T, int VEC, int RW, int U>
__device__ __forceinline__ void load_batch(WChunk<T, VEC> (&w)[RW][U], const T* __restrict__ W, int n0, int N,
                                           int K, int k0, int lane) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int k = k0 + (u * 32 + lane) * VEC;
#pragma unroll
        for (int r = 0; r < RW; ++r) {
            const bool ok = n0 + r < N && k < K;
            if constexpr (VEC == 1) {
                // the element loaded whatever the bounds, from inside W (row 0) when out of
                // them, then dropped: compute-sanitizer saw the guarded __ldg of rows past N
                // read past W here (the second pass of 5 rows of 781 features, H100)
                w[r][u].load(W + (ok ? static_cast<long long>(n0 + r) * K + k : 0));
                if (!ok) w[r][u].zero();
            } else if (ok) {
                w[r][u].load(W + static_cast<long long>(n0 + r) * K + k);
            } else {
                w[r][u].zero();
            }
        }
    }
}

// VEC floats into shared memory: 16-byte stores where VEC allows (the row is 16-byte aligned).
template <int VEC>
__device__ __forceinline__ void store_row(float* p, const float (&v)[VEC]) {
    if constexpr (VEC % 4 == 0) {
#pragma unroll
        for (int e = 0; e < VEC; e += 4) *reinterpret_cast<float4*>(p + e) = make_float4(v[e], v[e + 1], v[e + 2], v[e + 3]);
    } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) p[e] = v[e];
    }
}

}  // namespace

// Where a block of a product lets the next kernel start (programmatic dependent launch): at its
// start, once its first batch of W is requested, or once it has passed its wait (linear.py's
// trigger=; cupy_kernels/linear.py TRIGGERS, the same order).
enum Trigger : int { TRIGGER_START = 0, TRIGGER_REQUESTED = 1, TRIGGER_WAITED = 2 };

// Blocks an SM linear_kernel is compiled to fit: 1 (without it, ptxas capped some tiles at 128
// registers and spilled), but 2 for the LM head's tile (float rows of 16-byte vectors, 4 rows x
// 2 loads, in many waves) at one row of x a pass. With the LayerNorm prologue that tile took
// 133 registers, so one block an SM: each block of each wave normalized x before it used its
// first loads, with no other block's loads to cover the wait. At 128 registers it does not
// spill; four rows of x a pass (BR = 4) spill, and keep one. H100, float32, the decode step's
// profile (benchmarks/results/lm_head_two_blocks-h100.json against lm_head_one_block-h100.json,
// one run): GPT-2 small's LM head 55.4 against 77.4 us, the step with programmatic launch 337.1
// against 357.7; medium 71.6 / 92.2 and 840.0 / 854.9; XL 114.6 / 141.2 and 3513.1 / 3537.6.
template <int VEC, int RW, int U, int BR>
constexpr int linear_min_blocks() {
    return (VEC == 4 && RW == 4 && U == 2 && BR == 1) ? 2 : 1;
}

#define LINEAR_ROWS_PARAMS                                                                                     \
    OutT *y, const T *x, const T *__restrict__ W, const T *__restrict__ bias, const T *__restrict__ ln_w,       \
        const T *__restrict__ ln_b, float eps, const T *res, float *__restrict__ part_val,                      \
        int *__restrict__ part_idx, T *__restrict__ k_cache, T *__restrict__ v_cache,                           \
        const int *__restrict__ positions, int *__restrict__ seq_lens, int H, int S_max, int B, int N, int K,   \
        int trigger
#define LINEAR_ROWS_ARGS \
    y, x, W, bias, ln_w, ln_b, eps, res, part_val, part_idx, k_cache, v_cache, positions, seq_lens, H, S_max, B, N, K, trigger

#define BLK (LISTED ? listed : static_cast<int>(blockIdx.x))
#define GRID (LISTED ? grid : static_cast<int>(gridDim.x))
// linear_kernel's work; with LISTED, block `listed` of a grid of `grid` blocks (the screened
// float32 LM head's exact kernel runs it for the blocks it lists, below). (Without, blockIdx.x
// and gridDim.x are read where they are used, as before there was a list: the same code.)
template <typename T, typename OutT, int VEC, int RW, int U, int BR, bool LN, int EPI, bool LISTED = false>
__device__ __forceinline__ void linear_rows(LINEAR_ROWS_PARAMS, int listed = 0, int grid = 0) {
    extern __shared__ float4 smem4[];
    float* xs = reinterpret_cast<float*>(smem4);  // [BR][K]: this pass's rows of x, as float
    __shared__ float s_sum[MAX_WARPS][BR], s_sq[MAX_WARPS][BR];  // LayerNorm partial sums
    __shared__ float s_best[MAX_WARPS][BR];
    __shared__ int s_idx[MAX_WARPS][BR];
    if (trigger == TRIGGER_START) griddep_launch_dependents();

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    constexpr int STEP = 32 * VEC * U;  // columns covered by one batch of loads
    // The warp's work: row groups g0, g0 + g_stride, ... (RW rows each), each in n_batches
    // steps of STEP columns.
    const int n_batches = (K + STEP - 1) / STEP;
    const int n_groups = (N + RW - 1) / RW;
    const int g0 = BLK * n_warps + warp, g_stride = GRID * n_warps;
    const int n_steps = g0 < n_groups ? ((n_groups - 1 - g0) / g_stride + 1) * n_batches : 0;
    auto row0 = [&](int s) { return (g0 + (s / n_batches) * g_stride) * RW; };
    auto col0 = [&](int s) { return (s % n_batches) * STEP; };

    // before the wait: only what no kernel of the step writes (weights, biases, LN params)
    WChunk<T, VEC> w[RW][U];
    if (n_steps > 0) load_batch<T, VEC, RW, U>(w, W, row0(0), N, K, 0, lane);
    float bn[RW];  // the bias of the warp's current group
    auto load_bias = [&](int n0) {
#pragma unroll
        for (int r = 0; r < RW; ++r) bn[r] = (bias != nullptr && n0 + r < N) ? to_float(bias[n0 + r]) : 0.0f;
    };
    load_bias(n_steps > 0 ? row0(0) : 0);
    const int kv = K / VEC;  // vectors in a row of x
    WChunk<T, VEC> lw[LN_CHUNKS], lb[LN_CHUNKS];  // this thread's columns of the LayerNorm parameters
    auto load_ln = [&]() {
#pragma unroll
        for (int j = 0; j < LN_CHUNKS; ++j) {
            const int i = threadIdx.x + j * blockDim.x;
            if (i < kv) {
                lw[j].load(ln_w + i * VEC);
                lb[j].load(ln_b + i * VEC);
            }
        }
    };
    if constexpr (LN) load_ln();
    if (trigger == TRIGGER_REQUESTED) griddep_launch_dependents();
    griddep_wait();  // x, res, positions: the previous kernels' work
    if (trigger == TRIGGER_WAITED) griddep_launch_dependents();

    for (int b0 = 0; b0 < B; b0 += BR) {
        const int nb = min(BR, B - b0);
        if (b0 > 0) {
            __syncthreads();  // the last pass is done with xs
            if (n_steps > 0) load_batch<T, VEC, RW, U>(w, W, row0(0), N, K, 0, lane);
            load_bias(n_steps > 0 ? row0(0) : 0);
            if constexpr (LN) load_ln();  // again: not kept in registers across a pass
        }
        // what the epilogue reads, requested now so that it arrives with x
        float rv[RW][BR];
        auto load_res = [&](int n0) {
#pragma unroll
            for (int r = 0; r < RW; ++r)
#pragma unroll
                for (int b = 0; b < BR; ++b)
                    rv[r][b] = (b < nb && n0 + r < N) ? to_float(res[static_cast<long long>(b0 + b) * N + n0 + r]) : 0.0f;
        };
        if constexpr (EPI == RESIDUAL) load_res(n_steps > 0 ? row0(0) : 0);
        int pos[BR];
#pragma unroll
        for (int b = 0; b < BR; ++b) pos[b] = (EPI == QKV_CACHE && b < nb) ? positions[b0 + b] : 0;

        // stage rows b0 .. b0 + nb of x as float; rows nb .. BR are zeros (no branch later)
        const T* xb = x + static_cast<long long>(b0) * K;
        bool staged = false;
        if constexpr (LN && BR == 1) {
            // one row (the decode step at batch 1): every thread keeps the chunks it loads in
            // registers through both passes and normalizes them there; the same order of every
            // sum as the many-row path below, so a row gets the same bits either way
            if (kv <= LN_CHUNKS * static_cast<int>(blockDim.x)) {
                float v[LN_CHUNKS][VEC];
#pragma unroll
                for (int j = 0; j < LN_CHUNKS; ++j) {
                    const int i = threadIdx.x + j * blockDim.x;
                    if (i < kv) load_vec<T, VEC>(xb + i * VEC, v[j]);
                }
                float ps = 0.0f;
#pragma unroll
                for (int j = 0; j < LN_CHUNKS; ++j) {
                    if (threadIdx.x + j * blockDim.x < kv) {
#pragma unroll
                        for (int e = 0; e < VEC; ++e) ps += v[j][e];
                    }
                }
                ps = warp_sum(ps);
                if (lane == 0) s_sum[warp][0] = ps;
                __syncthreads();
                float t = 0.0f;
                for (int wi = 0; wi < n_warps; ++wi) t += s_sum[wi][0];
                const float mean = t / K;
                float q = 0.0f;
#pragma unroll
                for (int j = 0; j < LN_CHUNKS; ++j) {
                    if (threadIdx.x + j * blockDim.x < kv) {
#pragma unroll
                        for (int e = 0; e < VEC; ++e) {
                            const float d = v[j][e] - mean;
                            q += d * d;
                        }
                    }
                }
                q = warp_sum(q);
                if (lane == 0) s_sq[warp][0] = q;
                __syncthreads();
                q = 0.0f;
                for (int wi = 0; wi < n_warps; ++wi) q += s_sq[wi][0];
                const float rstd = rsqrtf(q / K + eps);
#pragma unroll
                for (int j = 0; j < LN_CHUNKS; ++j) {
                    const int i = threadIdx.x + j * blockDim.x;
                    if (i < kv) {
                        float gw[VEC], gb[VEC];
                        lw[j].unpack(gw);
                        lb[j].unpack(gb);
#pragma unroll
                        for (int e = 0; e < VEC; ++e) v[j][e] = to_float(from_float<T>((v[j][e] - mean) * rstd * gw[e] + gb[e]));
                        store_row(xs + i * VEC, v[j]);
                    }
                }
                __syncthreads();
                staged = true;
            }
        }
        if (staged) {
            // x is in xs, normalized
        } else if constexpr (LN) {
            // every thread normalizes the columns it staged: two-pass mean / variance (as
            // layernorm.cu) through warp shuffles and one shared-memory sum per pass
            // (chunks past LN_CHUNKS per thread: loaded in further rounds, their parameters at use)
            const int chunks = (kv + blockDim.x - 1) / blockDim.x;
            for (int b = 0; b < nb; ++b) {
                float ps = 0.0f;
                for (int j0 = 0; j0 < chunks; j0 += LN_CHUNKS) {
                    float v[LN_CHUNKS][VEC];
#pragma unroll
                    for (int j = 0; j < LN_CHUNKS; ++j) {
                        const int i = threadIdx.x + (j0 + j) * blockDim.x;
                        if (i < kv) load_vec<T, VEC>(xb + b * K + i * VEC, v[j]);
                    }
#pragma unroll
                    for (int j = 0; j < LN_CHUNKS; ++j) {
                        const int i = threadIdx.x + (j0 + j) * blockDim.x;
                        if (i < kv) {
                            store_row(xs + b * K + i * VEC, v[j]);
#pragma unroll
                            for (int e = 0; e < VEC; ++e) ps += v[j][e];
                        }
                    }
                }
                ps = warp_sum(ps);
                if (lane == 0) s_sum[warp][b] = ps;
            }
            __syncthreads();
            for (int b = 0; b < nb; ++b) {
                float t = 0.0f;
                for (int wi = 0; wi < n_warps; ++wi) t += s_sum[wi][b];
                const float mean = t / K;
                float q = 0.0f;
                for (int i = threadIdx.x; i < kv; i += blockDim.x) {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) {
                        const float d = xs[b * K + i * VEC + e] - mean;
                        q += d * d;
                    }
                }
                q = warp_sum(q);
                if (lane == 0) s_sq[warp][b] = q;
            }
            __syncthreads();
            for (int b = 0; b < nb; ++b) {
                float t = 0.0f, q = 0.0f;
                for (int wi = 0; wi < n_warps; ++wi) t += s_sum[wi][b], q += s_sq[wi][b];
                const float mean = t / K, rstd = rsqrtf(q / K + eps);
                for (int j = 0; j < chunks; ++j) {
                    const int i = threadIdx.x + j * blockDim.x;
                    if (i >= kv) break;
                    float gw[VEC], gb[VEC];
                    if (j < LN_CHUNKS) {
#pragma unroll
                        for (int jj = 0; jj < LN_CHUNKS; ++jj) {  // a constant index into the registers
                            if (jj == j) lw[jj].unpack(gw), lb[jj].unpack(gb);
                        }
                    } else {
                        load_vec<T, VEC>(ln_w + i * VEC, gw);
                        load_vec<T, VEC>(ln_b + i * VEC, gb);
                    }
#pragma unroll
                    for (int e = 0; e < VEC; ++e) {
                        float* p = xs + b * K + i * VEC + e;
                        *p = to_float(from_float<T>((*p - mean) * rstd * gw[e] + gb[e]));  // stored in T
                    }
                }
            }
        } else if constexpr (VEC > 1) {  // the wrapper chose VEC only if x rows are 16-byte aligned
#pragma unroll 4
            for (int i = threadIdx.x * VEC; i < nb * K; i += blockDim.x * VEC) {
                float v[VEC];
                load_vec<T, VEC>(xb + i, v);
                store_row(xs + i, v);
            }
        } else {
            for (int i = threadIdx.x; i < nb * K; i += blockDim.x) xs[i] = to_float(xb[i]);
        }
        if (!staged) {
            for (int i = nb * K + threadIdx.x; i < BR * K; i += blockDim.x) xs[i] = 0.0f;
            __syncthreads();
        }

        float acc[RW][BR];
#pragma unroll
        for (int r = 0; r < RW; ++r)
#pragma unroll
            for (int b = 0; b < BR; ++b) acc[r][b] = 0.0f;
        float best[BR];
        int best_n[BR];
#pragma unroll
        for (int b = 0; b < BR; ++b) best_n[b] = -1, best[b] = -INFINITY;

        // one step: use the chunks in w, then request the next step's. (Requesting them first,
        // into a second set of registers, cost occupancy and measured slower on the H100.)
        for (int s = 0; s < n_steps; ++s) {
            const int n0 = row0(s), k0 = col0(s);
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int k = k0 + (u * 32 + lane) * VEC;
                if (k < K) {
                    float wf[RW][VEC];
#pragma unroll
                    for (int r = 0; r < RW; ++r) w[r][u].unpack(wf[r]);
#pragma unroll
                    for (int b = 0; b < BR; ++b) {
                        float xv[VEC];
#pragma unroll
                        for (int j = 0; j < VEC; j += 4) {
                            if constexpr (VEC >= 4) {
                                const float4 t = *reinterpret_cast<const float4*>(xs + b * K + k + j);
                                xv[j] = t.x, xv[j + 1] = t.y, xv[j + 2] = t.z, xv[j + 3] = t.w;
                            } else {
                                xv[0] = xs[b * K + k];
                            }
                        }
#pragma unroll
                        for (int r = 0; r < RW; ++r)
#pragma unroll
                            for (int i = 0; i < VEC; ++i) acc[r][b] = fmaf(wf[r][i], xv[i], acc[r][b]);
                    }
                }
            }
            if (s + 1 < n_steps) load_batch<T, VEC, RW, U>(w, W, row0(s + 1), N, K, col0(s + 1), lane);
            if (k0 + STEP < K) continue;
            // the group's last step: sums over the warp, then the epilogue; lane (r * BR + b) % 32 writes (r, b)
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                const int n = n0 + r;
#pragma unroll
                for (int b = 0; b < BR; ++b) {
                    const float sum = warp_sum(acc[r][b]);
                    acc[r][b] = 0.0f;
                    const long long o = static_cast<long long>(b0 + b) * N + n;
                    const bool valid = b < nb && n < N;
                    const bool mine = valid && lane == ((r * BR + b) & 31);
                    if constexpr (EPI == STORE) {
                        if (mine) y[o] = from_float<OutT>(sum + bn[r]);
                    } else if constexpr (EPI == GELU) {
                        if (mine) y[o] = from_float<OutT>(gelu_tanh(sum + bn[r]));
                    } else if constexpr (EPI == RESIDUAL) {
                        const float v = to_float(from_float<T>(sum));  // the product as stored in T
                        if (mine) y[o] = from_float<OutT>(rv[r][b] + v + bn[r]);
                    } else if constexpr (EPI == QKV_CACHE) {
                        const T v = from_float<T>(sum + bn[r]);
                        if (mine) {
                            y[o] = v;
                            store_kv_column(k_cache, v_cache, v, n, N, H, S_max, b0 + b, pos[b]);
                        }
                    } else {  // ARGMAX
                        const float v = sum + bn[r];
                        if (mine && y != nullptr) y[o] = from_float<OutT>(v);
                        if (valid) keep_max(best[b], best_n[b], v, n);
                    }
                }
            }
            if (s + 1 < n_steps) {  // the next group's bias (and residual): used n_batches steps from now
                load_bias(row0(s + 1));
                if constexpr (EPI == RESIDUAL) load_res(row0(s + 1));
            }
        }

        if constexpr (EPI == QKV_CACHE) {
            if (BLK == 0 && threadIdx.x < nb) seq_lens[b0 + threadIdx.x] = positions[b0 + threadIdx.x] + 1;
        }
        if constexpr (EPI == ARGMAX) {
            if (lane == 0) {
#pragma unroll
                for (int b = 0; b < BR; ++b) s_best[warp][b] = best[b], s_idx[warp][b] = best_n[b];
            }
            __syncthreads();
            if (threadIdx.x < nb) {
                const int b = threadIdx.x;
                float v = -INFINITY;
                int idx = -1;
                for (int wi = 0; wi < n_warps; ++wi) keep_max(v, idx, s_best[wi][b], s_idx[wi][b]);
                part_val[static_cast<long long>(b0 + b) * GRID + BLK] = v;
                part_idx[static_cast<long long>(b0 + b) * GRID + BLK] = idx;
            }
        }
    }
}

template <typename T, typename OutT, int VEC, int RW, int U, int BR, bool LN, int EPI>
__global__ void __launch_bounds__(MAX_WARPS * 32, linear_min_blocks<VEC, RW, U, BR>())
    linear_kernel(LINEAR_ROWS_PARAMS) {
    linear_rows<T, OutT, VEC, RW, U, BR, LN, EPI>(LINEAR_ROWS_ARGS);
}
#undef BLK
#undef GRID

// =======================================================================================
// Tensor cores: T = __half / __nv_bfloat16, K a multiple of 8, 16-byte aligned rows.
//
//   s[n, b] = sum_k W[n, k] xn[b, k] on mma.sync.m16n8k16, float32 accumulation: W is the
//   A operand (a tile of 16 rows of W), x the B operand (an "n-tile" of 8 rows of x).
//
// A chunk is 32 columns of K. Lane (g, t) = (lane / 4, lane % 4) loads 16 bytes of W rows
// m0 + g and m0 + g + 8, and of x row g, at columns 32 c + 8 t .. + 7. The chunk's columns
// are taken in a permuted order: fragment columns 2t, 2t+1, 2t+8, 2t+9 of the chunk's first
// mma are memory columns 8t .. 8t+3, those of the second 8t+4 .. 8t+7. Each 16-byte load
// is then two registers of each of two mma fragments (mma.cuh has the layouts): W goes from
// memory to the tensor cores without shuffles or shared memory, and one load instruction
// of the warp covers 8 rows x 64 contiguous bytes. At batch 1 seven of the eight columns
// of each mma are zeros; the tensor cores have the time (2 mma per 1 KB of W read).
//
// Block (blockIdx.x, blockIdx.y): KW warps on MT tiles of 16 rows of W and NT n-tiles of x
// (rows blockIdx.y * 8 NT ..; each tile of W is read once per block row, from L2 after the
// first); warp w takes chunks w, w + KW, w + 2 KW, ... in increasing order (together the
// warps sweep each row front to back), in batches of U chunks (2 U MT loads of W and U NT of
// x in flight per lane; the next batch's W once these are used, or with several n-tiles
// before this batch's mma: W_AHEAD). The warps' float32 partial tiles then meet in shared
// memory and are added in warp order. MT = 2 only for float logits of tall weights at 8
// n-tiles: each x fragment then feeds two tiles of W, half the reads of x from L2 (GPT-2
// small's LM head at B = 64 in the step, graph + PDL: 71 against 77 us).
// KW is a function of K alone (the wrapper), so an output's bits depend on K alone: not on
// the batch, the row's place in its n-tile, the n-tiles per block (NT) or the grid. A
// sequence gets the same numbers alone and in any batch.
//
// LayerNorm prologue (X_LN): warp b normalizes row b of x (rows b + KW, ... too) into shared
// memory as T, ln_row below, which ln_rows_kernel also runs: for batches past what the
// prologue holds, the wrapper normalizes once with ln_rows_kernel and runs the product on
// the result, with the same bits. Folded (X_LN_FOLD, any batch): the product runs on x as
// it is while the rows' statistics (16-column sets, 8 bytes each) come into shared memory by
// cp.async (where the partial tiles go later); the warps then combine them (row_stats, 4 rows
// a warp at once) and the epilogue takes
// s -> rstd (s - mean u) + c. No pass over x and no launch for the LayerNorm at any batch.
// (H100, graph + PDL: GPT-2 small's float16 step with every LayerNorm dropped, a timing-only
// bound, took 224 against 288 us at batch 1, 265 / 351 at 8, 796 / 874 at 64, GPT-2 XL's
// 1778 / 2180 at 1; folded, benchmarks/results/decode_step-h100.json: 254 / 281 at batch 1,
// 302 / 345 at 8, 888 / 874 at 64 (863 without PDL), XL 1919 / 2256. Staging the sets
// beside the partial tiles instead of over them took the LM head at 64 rows from 63 to 122
// us: shared memory cut its blocks an SM in half; combining them in the product's first
// batch, from L2, spilled.)
// =======================================================================================
namespace {
constexpr int MMA_MAX_WARPS = 16;  // rows that would give 8 warps more than a batch of W each (linear.py's _mma_warps)
constexpr int MMA_NARROW_WARPS = 8;  // blocks that hold more than 128 registers a thread: two m-tiles, W ahead
constexpr int RED_STRIDE = 20;  // floats a column of a warp's partial tile takes in shared memory
                                // (16 rows + 4: a fragment's 32 stores hit 32 distinct banks)
// What the product does with x: use the rows as they are (X_PLAIN); normalize them first, each
// block by itself (X_LN, ln_row below); or use them as they are with their LayerNorm folded
// into W and the epilogue (X_LN_FOLD): W = W0 diag(gamma), and for a row of mean m and
// reciprocal deviation r,  LN(x) W0^T + b = r (x W^T - m u) + c,  u = W 1, c = b + W0 beta,
// where m and r come from the row statistics the product that wrote x left (row_stats).
enum XInput : int { X_PLAIN = 0, X_LN = 1, X_LN_FOLD = 2 };

// Several n-tiles (B > 8) request the next batch's W before this batch's mma: two sets of W
// registers. H100, the decode step in a CUDA graph with PDL, GPT-2 small float16, us without
// / with: B = 16 424 / 390, 32 624 / 498, 64 854 / 716, 128 1352 / 1307, 256 2480 / 2368
// (GPT-2 XL at 64: 6786 / 6793). One n-tile lost with it (110 registers for 64, half the
// blocks an SM: small at B = 1 251 / 258 us, XL 1892 / 2167). x's next batch ahead as well,
// by cp.async into a ring of two batches a thread in shared memory, lost: B = 64 790 against
// 691 us, XL at 64 7541 / 6308. So did the block's rows of x staged whole (each warp's chunks
// by cp.async right after the wait, one wait before the first mma): B = 32 470 / 496 us,
// B = 64 635 / 705.
template <int NT> constexpr bool W_AHEAD() { return NT >= 2; }

// The statistics sets of rows b0 .. b0 + nb - 1 (stats_in: [B][n_sets]) into shared memory
// (sets: [nb][n_sets]) by cp.async, 16 bytes a thread at a time (b0 is even: aligned), by
// `count` threads from `first` (the block's, or one warp's lanes). Where nb n_sets is odd the
// last copy still writes 16 bytes (its second half zero): sets needs room for an even count.
__device__ __forceinline__ void copy_row_sets(float2* sets, const float2* stats_in, int b0, int nb, int n_sets,
                                              int first = threadIdx.x, int count = blockDim.x) {
    const int n = nb * n_sets;
    const float2* src = stats_in + static_cast<long long>(b0) * n_sets;
    for (int i = 2 * first; i < n; i += 2 * count) cp_async_16(smem_addr(sets + i), src + i, i + 1 < n ? 16 : 8);
}

// The mean and rstd of a block's nb rows of x from their statistics in shared memory (sets:
// [nb][n_sets]), 4 rows a warp at once (row_stats), warp w of `warps` taking rows 4w, 4w + 4
// warps, ...; every lane of a warp takes each trip (the shuffles).
__device__ __forceinline__ void rows_mean_rstd(float* s_mean, float* s_rstd, const float2* sets, int n_sets, int nb,
                                               int K, float eps, int warp, int warps, int lane) {
    constexpr int RPW = 32 / ROW_LANES;
    const int sub = lane % ROW_LANES;
#pragma unroll 1
    for (int b1 = warp * RPW; b1 < nb; b1 += warps * RPW) {
        const int bl = min(b1 + lane / ROW_LANES, nb - 1);
        float mean, m2;
        row_stats(sets + bl * n_sets, n_sets, K, sub, mean, m2);
        if (sub == 0 && b1 + lane / ROW_LANES < nb) {
            s_mean[bl] = mean;
            s_rstd[bl] = rsqrtf(__fadd_rn(__fdividef(m2, static_cast<float>(K)), eps));
        }
    }
}

// Threads a block may have: MMA_MAX_WARPS warps, or MMA_NARROW_WARPS for two m-tiles (their
// registers, below).
template <int MT> constexpr int mma_max_threads() { return 32 * (MT > 1 ? MMA_NARROW_WARPS : MMA_MAX_WARPS); }

// Blocks of mma_max_threads an SM holds at once: registers per thread <= 65536 / (threads x
// this). One n-tile: 64 registers for U <= 4 chunks a batch, 128 for U = 8 or with the LayerNorm
// prologue (ptxas spilled it at 64); with the folded LayerNorm 128 for the argmax (8 bytes
// spilled at 80) or U = 8, else 64 (80 put GPT-2 XL's MLP up, 400 blocks of 8 warps, in two
// waves: 10.75 against 8.08 us). Several n-tiles (W_AHEAD): 106-128 registers. Two m-tiles:
// 156-188 registers in blocks of at most 8 warps. (Tuned on the H100 in blocks of at most 8
// warps; before sm_90, ptxas spilled at 64 registers: 128 there.)
template <int NT, int U, int XIN, int EPI, int MT> constexpr int mma_min_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    return 1;
#else
    if constexpr (MT > 1 || W_AHEAD<NT>() || XIN == X_LN) return 1;
    if constexpr (XIN == X_LN_FOLD) return U > 4 || EPI == ARGMAX ? 1 : 2;
    return U > 4 ? 1 : 2;
#endif
}

}  // namespace

// linear_mma_kernel's parameters, and the arguments that pass them on
#define LINEAR_MMA_PARAMS                                                                                          \
    OutT *y, const T *x, const T *__restrict__ W, const T *__restrict__ bias, const T *__restrict__ ln_w,          \
        const T *__restrict__ ln_b, float eps, const T *res, float *__restrict__ part_val,                          \
        int *__restrict__ part_idx, T *__restrict__ k_cache, T *__restrict__ v_cache,                               \
        const int *__restrict__ positions, int *__restrict__ seq_lens, int H, int S_max, int B, int N, int K,       \
        int xs_stride, const float2 *stats_in, float2 *__restrict__ stats_out, const float *__restrict__ fold_u,   \
        const float *__restrict__ fold_c, int pace_ps, int trigger
#define LINEAR_MMA_ARGS                                                                                            \
    y, x, W, bias, ln_w, ln_b, eps, res, part_val, part_idx, k_cache, v_cache, positions, seq_lens, H, S_max, B, N, \
        K, xs_stride, stats_in, stats_out, fold_u, fold_c, pace_ps, trigger

// The product. AHEAD: each warp requests its next batch of W before it multiplies this one
// (W_AHEAD, or linear_mma_ahead_kernel). SW: the block has one warp more than the KW that
// multiply, which combines the rows' statistics while they do (linear_mma_stats_warp_kernel).
template <typename T, typename OutT, int NT, int U, int XIN, int EPI, int MT, bool AHEAD, bool LISTED = false,
          bool SW = false>
__device__ __forceinline__ void linear_mma(LINEAR_MMA_PARAMS, int listed_tile = 0) {
    // the block's tile of rows of W, of how many: blockIdx.x of gridDim.x, or (LISTED,
    // linear_mma_list_kernel) listed_tile of all N's (read where used: a register less)
#define MMA_TILE (LISTED ? listed_tile : static_cast<int>(blockIdx.x))
#define MMA_N_TILES (LISTED ? (N + TM - 1) / TM : static_cast<int>(gridDim.x))
    constexpr int COLS = 8 * NT;  // rows of x per block
    constexpr int TM = 16 * MT;   // rows of W per block
    static_assert(MT == 1 || EPI == STORE || EPI == ARGMAX, "several m-tiles: the LM head's epilogues");
    constexpr bool LN = XIN == X_LN;
    static_assert(!SW || (XIN == X_LN_FOLD && NT == 1 && MT == 1 && !LISTED), "the statistics warp: one n-tile");
    extern __shared__ float4 smem4[];
    const int KW = (blockDim.x >> 5) - (SW ? 1 : 0);
    const int n_sets = (K + 15) / 16;  // X_LN_FOLD: statistics sets of a row
    float* red = reinterpret_cast<float*>(smem4);                      // [KW][MT][COLS][RED_STRIDE] partial tiles
    T* xs = reinterpret_cast<T*>(red + KW * MT * COLS * RED_STRIDE);  // LN: [B][xs_stride] normalized rows
    T* lnp = xs + B * xs_stride;                                       // LN: [2][K] its weight and bias
    // X_LN_FOLD: [COLS][n_sets], where the partial tiles go later (SW: after them)
    float2* sets = reinterpret_cast<float2*>(SW ? red + KW * COLS * RED_STRIDE : red);
    __shared__ float s_bias[TM];       // (X_LN_FOLD: c)
    __shared__ float s_u[TM];          // X_LN_FOLD: u
    __shared__ float s_mean[COLS], s_rstd[COLS];  // X_LN_FOLD: of the block's rows of x
    __shared__ float s_out[EPI == ARGMAX ? COLS : 1][TM];  // ARGMAX: the block's values
    __shared__ __align__(16) T s_res[EPI == RESIDUAL ? COLS : 1][TM];  // RESIDUAL: the block's residual values
    __shared__ int s_pos[EPI == QKV_CACHE ? COLS : 1];  // QKV_CACHE: the rows' cache positions
    // the next kernel may start: its weights stream in while this one runs (triggering after
    // the main loop instead, in grids of several block rows, gained up to 6% at B = 32 and 64
    // before W_AHEAD and nothing after it: B = 64 719 against 726 us, B = 16 384 / 376). Or
    // (linear.py's trigger=) once the block's first batch of W is requested (TRIGGER_REQUESTED),
    // or once it has passed its wait (TRIGGER_WAITED).
    if (trigger == TRIGGER_START) griddep_launch_dependents();

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int m0 = MMA_TILE * TM, b0 = blockIdx.y * COLS;  // the block's TM rows of W, COLS rows of x
    const int n_chunks = (K + 31) / 32;
    const int my_chunks = warp < n_chunks && (!SW || warp < KW) ? (n_chunks - 1 - warp) / KW + 1 : 0;
    bool row_a[MT], row_b[MT];  // m-tile mt: rows m0 + 16 mt + g and + 8 of W
    const T *wa_p[MT], *wb_p[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int ra = m0 + 16 * mt + g;
        row_a[mt] = ra < N, row_b[mt] = ra + 8 < N;
        wa_p[mt] = W + static_cast<long long>(row_a[mt] ? ra : 0) * K + 8 * t;
        wb_p[mt] = W + static_cast<long long>(row_b[mt] ? ra + 8 : 0) * K + 8 * t;
    }

    uint4 wa[MT][U], wb[MT][U];  // this batch's chunks of rows g and g + 8 of each m-tile
    auto load_w = [&](uint4 (&a)[MT][U], uint4 (&b)[MT][U], int j0) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u, col = 32 * (warp + j * KW);
            const bool ok = j < my_chunks && col + 8 * t < K;
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                a[mt][u] = ok && row_a[mt] ? load_stream16(wa_p[mt] + col) : make_uint4(0, 0, 0, 0);
                b[mt][u] = ok && row_b[mt] ? load_stream16(wb_p[mt] + col) : make_uint4(0, 0, 0, 0);
            }
        }
    };
    // before the wait: only what no kernel of the step writes (weights, bias, LN parameters).
    // Also requesting a warp's chunks past this batch into L2 here (prefetch.global.L2, one
    // request a 32-byte sector; branch w-prefetch) lost: H200, the step with PDL at 64 / 264 /
    // 520 / 900 cached keys, us, two rounds of one run (benchmarks/results/
    // w_prefetch_k_slices_epilogue-h200.log, "pf"): GPT-2 small float16 B = 1 208.3 / 228.1 /
    // 254.2 / 278.5 against 208.6 / 220.4 / 240.9 / 267.1, XL 1438.0 / 1514.1 / 1622.3 /
    // 1731.5 against 1390.1 / 1453.3 / 1557.3 / 1664.8.
    // Paced (pace_ps > 0): a block of W's tile i requests its weights i x pace_ps
    // picoseconds after its start, so that a product launched early does not put all of its
    // weights in the memory's queues at once, ahead of the loads the kernels before it wait for
    // (the attention's rows, the next product's x). A load that hits in L2 waited 144 ns idle,
    // 168 ns while 2.2 MB streamed (2.5 TB/s), 244 ns at 4.3 MB (2.8 TB/s), 1.66 us with 8.7 MB
    // requested at once (H100; benchmarks/results/memory_queue-h100.json). linear.py's pace=;
    // the decode step's choice is DECODE_PACE_GBPS in gpt2_cupy/model.py, with its measurements.
    if (pace_ps > 0) {
        const unsigned long long until = global_ns() + static_cast<unsigned long long>(MMA_TILE) * pace_ps / 1000;
        while (global_ns() < until) {}
    }
    load_w(wa, wb, 0);
    if (trigger == TRIGGER_REQUESTED) griddep_launch_dependents();
    if constexpr (XIN == X_LN_FOLD) {
        if (threadIdx.x < TM) {
            const bool in = m0 + threadIdx.x < N;
            s_bias[threadIdx.x] = in ? fold_c[m0 + threadIdx.x] : 0.0f;
            s_u[threadIdx.x] = in ? fold_u[m0 + threadIdx.x] : 0.0f;
        }
    } else if (threadIdx.x < TM) {
        s_bias[threadIdx.x] = bias != nullptr && m0 + threadIdx.x < N ? to_float(bias[m0 + threadIdx.x]) : 0.0f;
    }
    if constexpr (LN) {  // into shared memory, without registers: one L2 round trip less after the wait
        for (int i = threadIdx.x; i < K / 8; i += blockDim.x) {
            cp_async_16(smem_addr(lnp + 8 * i), ln_w + 8 * i, 16);
            cp_async_16(smem_addr(lnp + K + 8 * i), ln_b + 8 * i, 16);
        }
        cp_async_commit();
    }
    griddep_wait();  // x, res, positions: the previous kernels' work
    if (trigger == TRIGGER_WAITED) griddep_launch_dependents();
    // what the epilogue reads comes in while the product runs: the rows' statistics (X_LN_FOLD),
    // the residual tile (16-byte pieces where rows of N values allow them), the cache positions.
    // H100, the decode step in a CUDA graph with PDL at 264 cached keys, float16, us a step
    // before / after (same run): GPT-2 small B = 1 245.6 / 243.7, 8 293.6 / 290.9, 16 367.1 /
    // 359.5, 32 471.5 / 473.6, 64 636.1 / 627.3; GPT-2 XL B = 1 1916.7 / 1902.8, 8 2178.6 / 2130.3.
    const bool res_staged = EPI == RESIDUAL && N % 8 == 0 && reinterpret_cast<size_t>(res) % 16 == 0;
    const int nb = min(COLS, B - b0);  // rows of x in this block
    if constexpr (SW) {
        if (warp == KW) {  // the statistics warp: its own copies, combined as soon as they land
            copy_row_sets(sets, stats_in, b0, nb, n_sets, lane, 32);
            cp_async_commit();
            cp_async_wait<0>();
            __syncwarp();
            rows_mean_rstd(s_mean, s_rstd, sets, n_sets, nb, K, eps, 0, 1, lane);
        }
    } else if constexpr (XIN == X_LN_FOLD) {
        copy_row_sets(sets, stats_in, b0, nb, n_sets);
    }
    if constexpr (EPI == RESIDUAL) {
        if (res_staged) {
            for (int i = threadIdx.x; i < 2 * nb; i += blockDim.x) {
                const int bl = i >> 1, n = m0 + 8 * (i & 1);
                const bool in = n < N;
                cp_async_16(smem_addr(&s_res[bl][8 * (i & 1)]), res + static_cast<long long>(b0 + bl) * N + (in ? n : 0),
                            in ? 16 : 0);
            }
        }
    }
    if constexpr (EPI == QKV_CACHE) {
        for (int i = threadIdx.x; i < nb; i += blockDim.x) cp_async_4(smem_addr(s_pos + i), positions + b0 + i);
    }
    cp_async_commit();

    if constexpr (LN) {  // the wrapper takes this path only for B <= COLS: one block row
        cp_async_wait<0>();
        __syncthreads();
#pragma unroll 1
        for (int b = warp; b < B; b += KW)
            ln_row(xs + b * xs_stride, xs + b * xs_stride, x + static_cast<long long>(b) * K, lnp, lnp + K, eps, K, lane);
        __syncthreads();
    }

    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
    for (int j0 = 0; j0 < my_chunks; j0 += U) {
        uint4 xv[U][NT];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int col = 32 * (warp + (j0 + u) * KW) + 8 * t;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int b = b0 + nt * 8 + g;
                xv[u][nt] = make_uint4(0, 0, 0, 0);
                if (j0 + u < my_chunks && b < B && col < K) {
                    if constexpr (LN) {
                        xv[u][nt] = *reinterpret_cast<const uint4*>(xs + b * xs_stride + col);
                    } else {
                        xv[u][nt] = *reinterpret_cast<const uint4*>(x + static_cast<long long>(b) * K + col);
                    }
                }
            }
        }
        uint4 wa_next[MT][U], wb_next[MT][U];  // AHEAD: the next batch's W, requested before this one's mma
        if constexpr (AHEAD) {
            if (j0 + U < my_chunks) load_w(wa_next, wb_next, j0 + U);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const uint4 &ra = wa[mt][u], &rb = wb[mt][u];
                const unsigned a0[4] = {ra.x, rb.x, ra.y, rb.y};  // memory columns 8t .. 8t+3
                const unsigned a1[4] = {ra.z, rb.z, ra.w, rb.w};  // 8t+4 .. 8t+7
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    mma_m16n8k16<T>(acc[mt][nt], a0, xv[u][nt].x, xv[u][nt].y);
                    mma_m16n8k16<T>(acc[mt][nt], a1, xv[u][nt].z, xv[u][nt].w);
                }
            }
        }
        if constexpr (AHEAD) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int u = 0; u < U; ++u) wa[mt][u] = wa_next[mt][u], wb[mt][u] = wb_next[mt][u];
        } else if (j0 + U < my_chunks) {
            load_w(wa, wb, j0 + U);
        }
    }
    cp_async_wait<0>();  // the statistics, residual values and positions of this thread
    if constexpr (XIN == X_LN_FOLD && !SW) {  // the mean and rstd of the block's rows, 4 rows a warp at once
        __syncthreads();  // every thread's sets have landed
        rows_mean_rstd(s_mean, s_rstd, sets, n_sets, nb, K, eps, warp, KW, lane);
        __syncthreads();  // the sets are read: their shared memory takes the partial tiles
    }
    // partial tiles to shared memory (the KW warps that multiply): c[0], c[1] are row g, columns
    // 2t, 2t+1; c[2], c[3] row g + 8
#pragma unroll
    for (int mt = 0; mt < MT && (!SW || warp < KW); ++mt) {
        float* mine = red + (warp * MT + mt) * COLS * RED_STRIDE;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int c = nt * 8 + 2 * t;
            mine[c * RED_STRIDE + g] = acc[mt][nt][0];
            mine[(c + 1) * RED_STRIDE + g] = acc[mt][nt][1];
            mine[c * RED_STRIDE + g + 8] = acc[mt][nt][2];
            mine[(c + 1) * RED_STRIDE + g + 8] = acc[mt][nt][3];
        }
    }
    __syncthreads();
    // the epilogue: thread o -> row r = o % TM of the block's rows of W (m-tile r / 16), row
    // b0 + o / TM of x (every thread takes the same number of trips: the RESIDUAL statistics
    // shuffle in half-warps)
    for (int o0 = 0; o0 < TM * nb; o0 += blockDim.x) {
        const int o = o0 + threadIdx.x;
        const int r = o % TM, bl = o / TM, n = m0 + r, b = b0 + bl;
        const bool active = o < TM * nb, valid = active && n < N;
        float s = 0.0f;
        if (active) {
            const float* part = red + (r >> 4) * COLS * RED_STRIDE + bl * RED_STRIDE + (r & 15);
            // every warp's partial requested at once, then added in warp order (the bits of a
            // loop over KW, which waited for each read before the next: H100, the step with PDL
            // at 64 / 264 / 520 / 900 cached keys, us, two rounds of one run, benchmarks/results/
            // epilogue_sum-h100.log, with row_stats' reads four at a time: GPT-2 small float16
            // B = 1 221.2 / 230.2 / 255.0 / 288.8 against 225.1 / 235.8 / 262.5 / 290.6, XL
            // 1565.4 / 1573.1 / 1684.4 / 1809.1 against 1587.2 / 1602.8 / 1713.1 / 1835.8;
            // under 1% at B = 8)
            float pw[mma_max_threads<MT>() / 32];
#pragma unroll
            for (int w = 0; w < mma_max_threads<MT>() / 32; ++w) pw[w] = w < KW ? part[w * MT * COLS * RED_STRIDE] : 0.0f;
#pragma unroll
            for (int w = 0; w < mma_max_threads<MT>() / 32; ++w)
                if (w < KW) s += pw[w];
            if constexpr (XIN == X_LN_FOLD) s = unfold_ln(s, s_mean[bl], s_u[r], s_rstd[bl]);
        }
        if (!valid) {
            if constexpr (EPI == ARGMAX) {
                if (active) s_out[bl][r] = 0.0f;
            }
            if constexpr (EPI != RESIDUAL) continue;
        }
        const long long at = static_cast<long long>(b) * N + n;
        const float bn = s_bias[r];
        if constexpr (EPI == STORE) {
            y[at] = from_float<OutT>(s + bn);
        } else if constexpr (EPI == GELU) {
            y[at] = from_float<OutT>(gelu_tanh(s + bn));
        } else if constexpr (EPI == RESIDUAL) {
            float v = 0.0f;  // the output as stored
            if (valid) {
                const OutT yv = from_float<OutT>(to_float(res_staged ? s_res[bl][r] : res[at]) + to_float(from_float<T>(s)) + bn);
                y[at] = yv;
                v = to_float(yv);
            }
            if (stats_out != nullptr) {  // (mean, m2) of the block's 16 outputs of row b: row_stats
                float sum = v;
#pragma unroll
                for (int off = 8; off > 0; off >>= 1) sum = __fadd_rn(sum, __shfl_down_sync(0xffffffffu, sum, off, 16));
                const float mu = __fdividef(__shfl_sync(0xffffffffu, sum, 0, 16), static_cast<float>(min(16, N - m0)));
                const float d = valid ? __fsub_rn(v, mu) : 0.0f;
                float q = __fmul_rn(d, d);
#pragma unroll
                for (int off = 8; off > 0; off >>= 1) q = __fadd_rn(q, __shfl_down_sync(0xffffffffu, q, off, 16));
                if (active && r == 0) stats_out[static_cast<long long>(b) * MMA_N_TILES + MMA_TILE] = make_float2(mu, q);
            }
        } else if constexpr (EPI == QKV_CACHE) {
            const T v = from_float<T>(s + bn);
            y[at] = v;
            store_kv_column(k_cache, v_cache, v, n, N, H, S_max, b, s_pos[bl]);
        } else {  // ARGMAX
            const float v = s + bn;
            if (y != nullptr) y[at] = from_float<OutT>(v);
            s_out[bl][r] = v;
        }
    }
    if constexpr (EPI == ARGMAX) {
        __syncthreads();
        if (threadIdx.x < nb) {
            const int bl = threadIdx.x;
            float v = -INFINITY;
            int idx = -1;
            for (int r = 0; r < TM && m0 + r < N; ++r) keep_max(v, idx, s_out[bl][r], m0 + r);
            part_val[static_cast<long long>(b0 + bl) * MMA_N_TILES + MMA_TILE] = v;
            part_idx[static_cast<long long>(b0 + bl) * MMA_N_TILES + MMA_TILE] = idx;
        }
    }
    if constexpr (EPI == QKV_CACHE) {
        if (MMA_TILE == 0)
            for (int i = threadIdx.x; i < nb; i += blockDim.x) seq_lens[b0 + i] = s_pos[i] + 1;
    }
}

#undef MMA_TILE
#undef MMA_N_TILES

template <typename T, typename OutT, int NT, int U, int XIN, int EPI, int MT>
__global__ void __launch_bounds__(mma_max_threads<MT>(), mma_min_blocks<NT, U, XIN, EPI, MT>())
    linear_mma_kernel(LINEAR_MMA_PARAMS) {
    linear_mma<T, OutT, NT, U, XIN, EPI, MT, W_AHEAD<NT>()>(LINEAR_MMA_ARGS);
}

// One n-tile a block (8 rows of x) with the folded LayerNorm, and one warp more than the KW that
// multiply: it requests the rows' statistics itself after the wait and combines them
// (rows_mean_rstd) while the others multiply, into shared memory beside the partial tiles
// instead of under them, so the epilogue waits at one block barrier instead of three and the
// combine leaves the chain after the wait. The same numbers as linear_mma_kernel. Measured in
// the decode step (linear.py's stats_warp=, gpt2_cupy/model.py's DECODE_STATS_WARP,
// benchmarks/NOTES.md: "The statistics warp").
template <typename T, typename OutT, int U, int EPI>
__global__ void __launch_bounds__(mma_max_threads<1>(), mma_min_blocks<1, U, X_LN_FOLD, EPI, 1>())
    linear_mma_stats_warp_kernel(LINEAR_MMA_PARAMS) {
    linear_mma<T, OutT, 1, U, X_LN_FOLD, EPI, 1, false, false, true>(LINEAR_MMA_ARGS);
}

// One n-tile (B <= 8) with W a batch ahead, for products of no more tiles than SMs and rows of
// two or more batches a warp (the MLP down of GPT-2 medium to XL, K = 4C): a block an SM
// whatever its registers (186 at U = 8), so each warp keeps two batches of W in flight (the
// measurements are beside the wrapper's _mma_ahead).
template <typename T, typename OutT, int U, int EPI>
__global__ void __launch_bounds__(MMA_NARROW_WARPS * 32, 1) linear_mma_ahead_kernel(LINEAR_MMA_PARAMS) {
    linear_mma<T, OutT, 1, U, X_PLAIN, EPI, 1, true>(LINEAR_MMA_ARGS);
}

// The screen's order keys: a float that is not NaN as an unsigned of the same order, -inf as 0
// (the 8-bit pass's blocks leave each row's largest lower bound by atomicMax of them)
constexpr unsigned KEY_NEG_INF = 0x007fffffu;  // the order key of -inf
// The bound a screen leaves where some tile's upper bound is NaN: above every key, and
// key_bound gives it as a NaN, which no upper bound is below, so that every tile is computed
// exactly. (The argmax keeps a NaN partial only where it meets it before a larger value, an
// order the skipped tiles' (-inf, -1) would change; with every tile computed, the order is the
// exact product's.)
constexpr unsigned KEY_LIST_ALL = 0xffffffffu;
__device__ __forceinline__ unsigned bound_key(float f) {
    const unsigned u = __float_as_uint(f);
    return ((u & 0x80000000u) ? ~u : (u | 0x80000000u)) - KEY_NEG_INF;
}
__device__ __forceinline__ float key_bound(unsigned k) {
    k += KEY_NEG_INF;
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// The screened LM head's exact tiles (below: linear_q8_max_kernel, which leaves every tile's
// upper bound hi of each row, and each row's best lower bound in bounds[b]): block k takes
// tiles k per, ..., (k + 1) per - 1 (per = ceil(tiles / gridDim.x)), computes those whose hi
// reaches a row's bound (a NaN counts) with the argmax product's bits (linear_mma: each tile's
// partials where linear_mma_kernel's block of that tile puts them) and gives the others the
// partials (-inf, -1), which argmax_partials_kernel skips (and sets the bounds back to zero).
// Each block lists its own tiles: a list in a kernel of its own (screen_tiles_kernel, one block
// over all the bounds) was a launch more, and its last block choosing the tokens instead of
// the argmax kernel (a ticket: fence and atomicAdd in every block) cost more than it saved
// (benchmarks/NOTES.md, "The screened LM head"). Nor did the 8-bit pass's blocks gain by
// computing these tiles themselves, each those of its tiles whose hi reaches the bound its
// atomicMax returned (H200, us a sweep of 512 replays: GPT-2 small float16 at batch 1 166.75
// against 164.97, at batch 2 174.95 against 172.14; XL 1300.2 against 1306.3; NOTES, "The
// screened LM head's exact tiles in its 8-bit pass").
template <typename T, typename OutT, int U>
__global__ void __launch_bounds__(mma_max_threads<1>(), mma_min_blocks<1, U, X_LN_FOLD, ARGMAX, 1>())
    linear_mma_list_kernel(LINEAR_MMA_PARAMS, const float* hi, const unsigned* bounds) {
    static_assert(sizeof(OutT) == 4, "float logits (never written: the argmax)");
    constexpr int COLS = 8;
    __shared__ int s_list[mma_max_threads<1>()], s_n;
    const int tiles = (N + 15) / 16, nb = min(COLS, B);
    const int per = (tiles + gridDim.x - 1) / gridDim.x, first = blockIdx.x * per, end = min(tiles, first + per);
    griddep_launch_dependents();
    griddep_wait();  // the bounds: the kernel ahead's
    for (int i0 = first; i0 < end; i0 += blockDim.x) {
        const int i = i0 + threadIdx.x;
        __syncthreads();  // the tiles before have read s_list
        if (threadIdx.x == 0) s_n = 0;
        __syncthreads();
        if (i < end) {
            // every thread loads the bounds beside its hi: one round trip to L2 (coherent loads:
            // ptxas moves non-coherent ones past griddepcontrol.wait, common.cuh)
            bool on = false;
            for (int b = 0; b < nb; ++b)
                on |= !(__ldcg(hi + static_cast<long long>(b) * tiles + i) < key_bound(__ldcg(bounds + b)));
            if (on) {
                s_list[atomicAdd(&s_n, 1)] = i;
            } else {
                for (int b = 0; b < nb; ++b) {
                    part_val[static_cast<long long>(b) * tiles + i] = -INFINITY;
                    part_idx[static_cast<long long>(b) * tiles + i] = -1;
                }
            }
        }
        __syncthreads();
        const int n = s_n;
        for (int e = 0; e < n; ++e) {
            const int tile = s_list[e];
            __syncthreads();  // the tile before's epilogue has read the shared memory
            linear_mma<T, OutT, 1, U, X_LN_FOLD, ARGMAX, 1, false, true>(LINEAR_MMA_ARGS, tile);
        }
    }
}

// The LM head of 17 to 64 rows of x (float logits stored, or reduced to the argmax), with W
// streamed through shared memory: one block an SM walks the 16-row tiles of W blockIdx.x,
// + gridDim.x, ... Each tile (and its 16 values of c and u, or of the bias) comes in by
// cp.async into a ring of STAGES slots, STAGES - 2 tiles ahead of the one multiplied (the
// first ones before griddep_wait: W is never written), so the tile loads go on through every
// tile's reduction and epilogue. Four groups of KW warps: group i takes x's rows 16i .. 16i +
// 15, warp w of a group chunks w, w + KW, ... (at most STREAM_CHUNKS) of the rows. Each warp
// loads its fragments of x into registers once, after the wait, and multiplies them as the
// mma's A operand by W's rows from shared memory as B: the transpose of linear_mma_kernel's
// tile (W as A), with the same products in the same order of k, so W's 16-byte reads are the
// B registers as they are (as A they needed eight register moves an mma). The warps' partial
// tiles are added in warp order and the epilogue is linear_mma's (two outputs a thread): an
// output gets the bits it gets there and alone (tested on the H100: the transposed mma gives
// the same bits). One barrier a tile: after it, each warp multiplies tile i into one of two
// buffers of partial tiles while it finishes tile i - 1 from the other (sums, epilogue,
// argmax), so the two phases' latencies overlap. The argmax keeps each row's best (value,
// index) over the block's tiles and writes one partial a block. Shared memory: the two
// buffers of partial tiles (or first the rows' statistics, X_LN_FOLD), then the ring, its
// rows at a stride 64 bytes past a multiple of 128 (a quarter warp's 16-byte reads of two
// rows fall in distinct banks), zero past K in the last chunk. The measurements are beside
// the wrapper's _mma_stream.
constexpr int STREAM_CHUNKS = 6;  // chunks of 32 columns a warp takes at most (linear.py's STREAM_CHUNKS)
constexpr int STREAM_MAX_KW = 4;  // warps a group at most (linear.py's _mma_stream)
constexpr int STREAM_RED_STRIDE = 24;  // floats a row of x takes in a partial tile: a half warp's 8-byte stores
                                       // of four rows fall in distinct banks (linear.py's STREAM_RED_STRIDE)
template <typename T, typename OutT, int XIN, int EPI, int STAGES>
__global__ void __launch_bounds__(4 * STREAM_MAX_KW * 32, 1) linear_mma_stream_kernel(LINEAR_MMA_PARAMS) {
    static_assert(EPI == STORE || EPI == ARGMAX, "the LM head's epilogues");
    static_assert(XIN == X_PLAIN || XIN == X_LN_FOLD, "x as it is, or with its LayerNorm folded");
    static_assert(STAGES >= 3, "a slot for the tile multiplied, one for the tile finished, one in flight");
    constexpr int COLS = 64, GROUPS = 4, TM = 16;  // rows of x a block, warp groups, rows of W a tile
    constexpr int AHEAD = STAGES - 2;             // tiles in flight
    static_assert(GROUPS * 16 == COLS, "a group takes 16 rows of x");
    extern __shared__ float4 smem4[];
    const int KW = blockDim.x / (32 * GROUPS);  // warps a group
    const int n_sets = (K + 15) / 16;
    const int red_floats = max(2 * KW * COLS * STREAM_RED_STRIDE, XIN == X_LN_FOLD ? COLS * n_sets * 2 : 0);
    const int slot_elems = TM * xs_stride + 2 * TM * 4 / static_cast<int>(sizeof(T));  // + the tile's c and u (or bias)
    float* red = reinterpret_cast<float*>(smem4);     // [2][KW][COLS][STREAM_RED_STRIDE] partial tiles
    float2* sets = reinterpret_cast<float2*>(smem4);  // X_LN_FOLD: [COLS][n_sets], before red
    T* ring = reinterpret_cast<T*>(red + red_floats);  // [STAGES] tiles of W: [TM][xs_stride], then
                                                       // c, u [TM] float (X_LN_FOLD) or bias [TM] T
    __shared__ float s_mean[COLS], s_rstd[COLS];
    __shared__ float s_best[COLS];  // ARGMAX: each row's largest value over the block's tiles so far, its index
    __shared__ int s_best_n[COLS];
    griddep_launch_dependents();

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int grp = warp / KW, kw = warp % KW;
    const int b0 = blockIdx.y * COLS, nb = min(COLS, B - b0);
    const int n_tiles = (N + TM - 1) / TM;
    const int my_tiles = blockIdx.x < n_tiles ? (n_tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const int n_chunks = (K + 31) / 32;
    const int my_chunks = kw < n_chunks ? (n_chunks - 1 - kw) / KW + 1 : 0;  // <= STREAM_CHUNKS (the wrapper)

    // tile i of this block, with its 16 values of c and u (or of the bias), into ring slot i % STAGES
    // (rows past N: zeros). Group grp copies rows 4 grp .. 4 grp + 3, each warp the columns of its
    // own chunks: lane (g, t) row 4 grp + g % 4, columns 8t .. 8t + 7 of every other chunk (from g / 4):
    // at most STREAM_CHUNKS / 2 pieces, their offsets in the row computed once.
    static_assert(GROUPS * 4 == TM, "a group copies 4 of the tile's 16 rows");
    const int copy_row = 4 * grp + (g & 3);
    int copy_col[STREAM_CHUNKS / 2];  // -1: no piece
#pragma unroll
    for (int p = 0; p < STREAM_CHUNKS / 2; ++p) {
        const int j = (g >> 2) + 2 * p, col = 32 * (kw + j * KW) + 8 * t;
        copy_col[p] = j < my_chunks ? col : -1;  // (past K: zeros)
    }
    auto issue_tile = [&](int i) {
        if (i >= my_tiles) return;
        const int m0 = (blockIdx.x + i * gridDim.x) * TM;
        T* slot = ring + (i % STAGES) * slot_elems + copy_row * xs_stride;
        const bool in = m0 + copy_row < N;
        const T* src = W + static_cast<long long>(in ? m0 + copy_row : 0) * K;
#pragma unroll
        for (int p = 0; p < STREAM_CHUNKS / 2; ++p) {
            const int col = copy_col[p];
            if (col >= 0) cp_async_16(smem_addr(slot + col), src + (col < K ? col : 0), in && col < K ? 16 : 0);
        }
        float* vals = reinterpret_cast<float*>(ring + (i % STAGES) * slot_elems + TM * xs_stride);
        if constexpr (XIN == X_LN_FOLD) {  // c then u: 4 floats a piece
            if (threadIdx.x < 8) {
                const int p = threadIdx.x % 4, n = m0 + 4 * p;
                const float* src = (threadIdx.x < 4 ? fold_c : fold_u) + n;
                cp_async_16(smem_addr(vals + (threadIdx.x / 4) * TM + 4 * p), n < N ? src : fold_c,
                            4 * max(0, min(4, N - n)));
            }
        } else if (threadIdx.x < 2) {  // the bias as T: 8 a piece
            const int n = m0 + 8 * threadIdx.x;
            const bool in = bias != nullptr && n < N;
            cp_async_16(smem_addr(reinterpret_cast<T*>(vals) + 8 * threadIdx.x), in ? bias + n : W,
                        in ? min(8, N - n) * static_cast<int>(sizeof(T)) : 0);
        }
    };
#pragma unroll
    for (int i = 0; i < AHEAD; ++i) {  // before the wait: only W and its constants
        issue_tile(i);
        cp_async_commit();
    }
    griddep_wait();  // x and its statistics: the previous kernels' work
    if constexpr (XIN == X_LN_FOLD) copy_row_sets(sets, stats_in, b0, nb, n_sets);
    cp_async_commit();
    // this warp's fragments of x for every tile, as the mma's A operand (x's 16 rows 16 grp .. 16 grp + 15
    // by W's 8 rows, the transpose of linear_mma_kernel's tile and the same products): lane (g, t) rows
    // 16 grp + g and + 8 of x, columns 8t .. 8t + 7 of its chunks, in linear_mma_kernel's order of k
    // (zeros past the rows and columns)
    unsigned xa[STREAM_CHUNKS][2][4];
#pragma unroll
    for (int j = 0; j < STREAM_CHUNKS; ++j) {
        const int col = 32 * (kw + j * KW) + 8 * t;
        uint4 r[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int bl = 16 * grp + 8 * h + g;
            r[h] = j < my_chunks && col < K && bl < nb
                       ? *reinterpret_cast<const uint4*>(x + static_cast<long long>(b0 + bl) * K + col)
                       : make_uint4(0, 0, 0, 0);
        }
        xa[j][0][0] = r[0].x, xa[j][0][1] = r[1].x, xa[j][0][2] = r[0].y, xa[j][0][3] = r[1].y;  // columns 8t .. 8t+3
        xa[j][1][0] = r[0].z, xa[j][1][1] = r[1].z, xa[j][1][2] = r[0].w, xa[j][1][3] = r[1].w;  // 8t+4 .. 8t+7
    }
    if (threadIdx.x < COLS) s_best[threadIdx.x] = -INFINITY, s_best_n[threadIdx.x] = -1;
    cp_async_wait<0>();
    __syncthreads();
    if constexpr (XIN == X_LN_FOLD) {  // the rows' mean and rstd, once for all the block's tiles
        rows_mean_rstd(s_mean, s_rstd, sets, n_sets, nb, K, eps, warp, GROUPS * KW, lane);
        __syncthreads();  // the sets are read: their shared memory takes the partial tiles
    }

    // tile i times x: this warp's partial tile into buffer i % 2. W's rows g and g + 8 are the B
    // operands of two mma (16-byte reads: no register moves); the ring is zero past K in the last chunk.
    auto multiply = [&](int i) {
        const T* wt = ring + (i % STAGES) * slot_elems;
        float acc[2][4];  // [W's rows g | g + 8 as 2t, 2t + 1 of the n-tile][x's rows g, g + 8]
#pragma unroll
        for (int h = 0; h < 2; ++h) acc[h][0] = acc[h][1] = acc[h][2] = acc[h][3] = 0.0f;
#pragma unroll
        for (int j = 0; j < STREAM_CHUNKS; ++j) {
            if (j < my_chunks) {
                const int col = 32 * (kw + j * KW) + 8 * t;
                const uint4 ra = *reinterpret_cast<const uint4*>(wt + g * xs_stride + col);
                const uint4 rb = *reinterpret_cast<const uint4*>(wt + (g + 8) * xs_stride + col);
                mma_m16n8k16<T>(acc[0], xa[j][0], ra.x, ra.y);
                mma_m16n8k16<T>(acc[0], xa[j][1], ra.z, ra.w);
                mma_m16n8k16<T>(acc[1], xa[j][0], rb.x, rb.y);
                mma_m16n8k16<T>(acc[1], xa[j][1], rb.z, rb.w);
            }
        }
        float* mine = red + ((i & 1) * KW + kw) * COLS * STREAM_RED_STRIDE;
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // output (W row 8h + 2t (+ 1), x row 16 grp + g (+ 8))
            const int c = 16 * grp + g, r = 8 * h + 2 * t;
            *reinterpret_cast<float2*>(mine + c * STREAM_RED_STRIDE + r) = make_float2(acc[h][0], acc[h][1]);
            *reinterpret_cast<float2*>(mine + (c + 8) * STREAM_RED_STRIDE + r) = make_float2(acc[h][2], acc[h][3]);
        }
    };
    // linear_mma's epilogue of tile i from buffer i % 2, two outputs a thread (every warp takes a
    // share): thread e -> rows 2 (e % 8), + 1 of the tile, row e / 8 of x (each output the sum of
    // the warps' partial tiles in warp order, read as 8-byte vectors); the argmax over a row's
    // eight pairs by shuffles within aligned groups of 8 lanes
    auto finish = [&](int i) {
        const int m0 = (blockIdx.x + i * gridDim.x) * TM;
        const float* vals = reinterpret_cast<const float*>(ring + (i % STAGES) * slot_elems + TM * xs_stride);
        const float* buf = red + (i & 1) * KW * COLS * STREAM_RED_STRIDE;
        for (int e0 = 0; e0 < 8 * nb; e0 += blockDim.x) {  // (every thread the same trips: the shuffles)
            const int e = e0 + threadIdx.x, q = e % 8, bl = e / 8;
            const bool active = e < 8 * nb;
            int vi = -1;
            float best_v = -INFINITY;
            if (active) {
                const float2* part = reinterpret_cast<const float2*>(buf + bl * STREAM_RED_STRIDE + 2 * q);
                float2 sum = make_float2(0.0f, 0.0f);
                for (int w = 0; w < KW; ++w) {  // in warp order
                    const float2 p2 = part[w * COLS * STREAM_RED_STRIDE / 2];
                    sum.x += p2.x, sum.y += p2.y;
                }
                const float sv[2] = {sum.x, sum.y};
#pragma unroll
                for (int k = 0; k < 2; ++k) {
                    const int r = 2 * q + k, n = m0 + r;
                    float sk = sv[k], bn;
                    if constexpr (XIN == X_LN_FOLD) {
                        sk = unfold_ln(sk, s_mean[bl], vals[TM + r], s_rstd[bl]);
                        bn = vals[r];
                    } else {
                        bn = to_float(reinterpret_cast<const T*>(vals)[r]);
                    }
                    const float v = sk + bn;
                    if (n < N) {
                        if (y != nullptr) y[static_cast<long long>(b0 + bl) * N + n] = from_float<OutT>(v);
                        keep_max(best_v, vi, v, n);
                    }
                }
            }
            if constexpr (EPI == ARGMAX) {  // the row's best of this tile, then its running best
#pragma unroll
                for (int off = 4; off > 0; off >>= 1) {
                    const float ov = __shfl_xor_sync(0xffffffffu, best_v, off, 8);
                    const int oi = __shfl_xor_sync(0xffffffffu, vi, off, 8);
                    keep_max(best_v, vi, ov, oi);
                }
                if (active && q == 0) keep_max(s_best[bl], s_best_n[bl], best_v, vi);
            }
        }
    };

    // Iteration i: tile i has landed (every thread's pieces: the barrier) and the slot of tile
    // i - 2 and the buffer of tile i - 2 are read; tile i + AHEAD goes into that slot, tile i is
    // multiplied into its buffer, tile i - 1 finished from the other.
#pragma unroll 1
    for (int i = 0; i <= my_tiles; ++i) {
        cp_async_wait<AHEAD - 1>();  // this thread's pieces of tile i (groups in flight: tiles i .. i + AHEAD - 1)
        __syncthreads();
        issue_tile(i + AHEAD);
        cp_async_commit();
        if (i < my_tiles) multiply(i);
        if (i > 0) finish(i - 1);
    }
    if constexpr (EPI == ARGMAX) {
        __syncthreads();
        if (threadIdx.x < nb) {
            part_val[static_cast<long long>(b0 + threadIdx.x) * gridDim.x + blockIdx.x] = s_best[threadIdx.x];
            part_idx[static_cast<long long>(b0 + threadIdx.x) * gridDim.x + blockIdx.x] = s_best_n[threadIdx.x];
        }
    }
}

// LayerNorm of B rows into out [B, K] as T, one warp a row (ln_row: the bits of
// linear_mma_kernel's prologue), for the batches whose rows the prologue does not hold.
template <typename T>
__global__ void ln_rows_kernel(T* out, const T* x, const T* __restrict__ ln_w, const T* __restrict__ ln_b, float eps,
                               int B, int K) {
    extern __shared__ float4 smem4[];
    griddep_launch_dependents();
    griddep_wait();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b = blockIdx.x * (blockDim.x >> 5) + warp;
    T* stage = reinterpret_cast<T*>(smem4) + warp * K;
    if (b < B) ln_row(out + static_cast<long long>(b) * K, stage, x + static_cast<long long>(b) * K, ln_w, ln_b, eps, K, lane);
}

// =======================================================================================
// The screened LM head: the exact greedy tokens of 1 to 8 rows of x (LayerNorm folded),
// reading W at 8 bits a value for all but the few tiles of 16 rows that may hold a row's
// largest value (cupy_kernels/linear.py, linear_argmax's screen=).
//
//   q[n, k] = round(W[n, k] / scale[n]),  scale[n] = max_k |W[n, k]| / 127   (quantize_rows;
//             stored as q + 128 in a byte, tile by tile: each tile of 16 rows is ceil(K / 32)
//             pieces of 512 bytes, one a chunk of 32 columns, whose lane 4 g + t holds 16
//             bytes, row g's columns 8 t .. 8 t + 7 and then row g + 8's, 128 past N and K)
//   A[b, n] = rstd_b (scale[n] (x_b . q[n]) - mean_b u[n]) + c[n]           (linear_q8_max_kernel)
//
// |x_b . W[n] - scale[n] (x_b . q[n])| <= |x_b|_1 scale[n] / 2, so the exact value E[b, n]
// (linear_mma_kernel's ARGMAX epilogue, the bits it always gives) lies within e of A[b, n]:
//   e = rstd_b scale[n] (|x_b|_1 (1/2 + K 2^-14) + K 2^-17) 17/16
//       + 2^-20 (rstd_b (|s| + |mean_b u[n]|) + |c[n]| + |A|),
// the terms in K bounding the float32 rounding of both sums (products of 16-bit values are
// exact in float32; K terms of at most 127 |x| scale[n]) and bfloat16 x made float16, 1/16 the
// rounding of the quantization and of |x_b|_1, the last term the rounding of the epilogue's
// three operations on either side. linear_q8_max_kernel writes, per row b and tile of 16 rows,
// hi = max (A + e), and keeps lo = max (A - e) of its own tiles: row b's largest E is at least
// M_b = max lo over the tiles (bounds[b]: its warps' largest lo meet there by atomicMax), and
// no row of a tile exceeds its hi. linear_mma_list_kernel computes E on the tiles whose hi
// reaches M_b for some row b alone (a NaN counts, or every tile: rows of W that are not finite,
// rows of x that are not or whose bfloat16 values leave float16's range take the exact path),
// with the bits linear_mma_kernel gives them: their argmax, with its first index, is the argmax
// over all N rows.
//
// linear_q8_max_kernel: a tile a warp. Warp w of the grid walks tiles w, w + warps, ..., each
// tile's chunks of 32 columns in items of Q8_BATCH chunks, one 16-byte load a lane a chunk (a
// warp's load reads 512 contiguous bytes; the rows' layout took two 8-byte loads, 8 rows x 32
// bytes each), the next item requested before the current one is multiplied, across tiles too.
// The warp's accumulators hold its whole tile, so the epilogue (the bounds of rows g and g + 8,
// the tile's largest over its 16 rows by shuffles) needs no block barrier and no shared memory.
// x's rows (1 to 8, the 8 columns of mma.sync m16n8k16) are staged once a block in shared memory
// as float16, with |x|_1 and the rows' mean and rstd; W's bytes become float16 by a byte permute
// and one subtraction, exact. The bound e holds for the sums in any order. Against the form it
// replaced (blocks of KW warps a tile, each warp every KW-th chunk, the warps' partial tiles
// added through shared memory between two block barriers a tile): H200, us a sweep of 512
// replays from 8 cached keys (benchmarks/results/q8_warp_tiles-h200.json, 4 blocks an SM),
// GPT-2 small float16 at batch 1 164.76 against 165.44, at batch 2 171.92 against 172.48,
// bfloat16 167.90 against 167.86, XL 1298.22 against 1301.09; at 3 blocks an SM (linear.py's
// _Q8W_BLOCKS_PER_SM) 0.6% less again for GPT-2 small. Bytes: N K of W (half the product's) +
// 12 N of scale, u and c; the list kernel reads the upper bounds, 4 B N / 16 bytes. Where few
// tiles are computed (1 to 3 of GPT-2's 3,142 in a diagnostic run's 512-token calls of random
// weights), the LM head reads about half its bytes.
namespace {
constexpr int Q8_BATCH = 8;  // chunks of W an item: a warp's 8 16-byte loads a lane

// 8 bytes q + 128 as 8 float16 values q (1024 + byte, minus 1152: exact)
__device__ __forceinline__ uint4 q8_to_half8(uint2 r) {
    const __half2 off = __half2half2(__ushort_as_half(0x6480));  // 1152
    uint4 h;
    unsigned p[4] = {__byte_perm(r.x, 0x64646464u, 0x4140), __byte_perm(r.x, 0x64646464u, 0x4342),
                     __byte_perm(r.y, 0x64646464u, 0x4140), __byte_perm(r.y, 0x64646464u, 0x4342)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&p[i]), off);
        p[i] = *reinterpret_cast<const unsigned*>(&v);
    }
    h.x = p[0], h.y = p[1], h.z = p[2], h.w = p[3];
    return h;
}

// 8 values of x as float16 (bfloat16: converted, inf past float16's range)
template <typename T> __device__ __forceinline__ uint4 x_as_half8(uint4 r);
template <> __device__ __forceinline__ uint4 x_as_half8<__half>(uint4 r) { return r; }
template <> __device__ __forceinline__ uint4 x_as_half8<__nv_bfloat16>(uint4 r) {
    const __nv_bfloat162* e = reinterpret_cast<const __nv_bfloat162*>(&r);
    uint4 h;
    unsigned* o = reinterpret_cast<unsigned*>(&h);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(e[i]);
        const __half2 v = __floats2half2_rn(f.x, f.y);
        o[i] = *reinterpret_cast<const unsigned*>(&v);
    }
    return h;
}

__device__ __forceinline__ float max_nan(float a, float b) { return a != a || b != b ? __int_as_float(0x7fc00000) : fmaxf(a, b); }

}  // namespace

constexpr int Q8W_WARPS = 4;  // warps a block (linear.py's _Q8W_WARPS)

template <typename T>
__global__ void __launch_bounds__(Q8W_WARPS * 32, 4)
    linear_q8_max_kernel(float* __restrict__ hi, const T* x, const unsigned char* __restrict__ Wq,
                         const float* __restrict__ scale, const float* __restrict__ fold_u,
                         const float* __restrict__ fold_c, const float2* stats_in, float eps, int B, int N, int K,
                         unsigned* __restrict__ bounds) {
    constexpr int COLS = 8, TM = 16, CH = Q8_BATCH;
    extern __shared__ float4 smem4[];
    __shared__ float s_mean[COLS], s_rstd[COLS], s_l1[COLS];
    griddep_launch_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int tiles = (N + TM - 1) / TM, nb = min(COLS, B), n_sets = (K + 15) / 16, n_chunks = (K + 31) / 32;
    const int per_tile = (n_chunks + CH - 1) / CH;  // items a tile
    const int gw = blockIdx.x * Q8W_WARPS + warp, n_w = gridDim.x * Q8W_WARPS;
    const int items = (gw < tiles ? (tiles - 1 - gw) / n_w + 1 : 0) * per_tile;
    const int xs_stride = n_chunks * 32 + 8;  // float16 values a row of x takes (16 bytes past the chunks)
    __half* xs = reinterpret_cast<__half*>(smem4);                    // [nb][xs_stride]
    float2* sets = reinterpret_cast<float2*>(xs + nb * xs_stride);    // [nb][n_sets]
    const float kf = static_cast<float>(K);

    // item i of this warp: its chunks of W, and with a tile's last item its rows' scale, u and c
    // (rows g: 0..2, g + 8: 3..5; zero past N, where the epilogue takes no row)
    auto load_item = [&](uint4 (&w)[CH], float (&rc)[6], int i) {
        const int tile = gw + (i / per_tile) * n_w, c0 = (i % per_tile) * CH;
        const unsigned char* wp = Wq + static_cast<long long>(tile) * n_chunks * 512 + lane * 16;
#pragma unroll
        for (int u = 0; u < CH; ++u)
            w[u] = i < items && c0 + u < n_chunks ? load_stream16(wp + (c0 + u) * 512)
                                                  : make_uint4(0x80808080u, 0x80808080u, 0x80808080u, 0x80808080u);
        if (i < items && i % per_tile == per_tile - 1) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int n = tile * TM + g + 8 * h;
                rc[3 * h] = n < N ? scale[n] : 0.0f;
                rc[3 * h + 1] = n < N ? fold_u[n] : 0.0f;
                rc[3 * h + 2] = n < N ? fold_c[n] : 0.0f;
            }
        }
    };
    uint4 wa[CH], wb[CH];
    float ra[6], rb[6];
    load_item(wa, ra, 0);  // (W only: nothing the kernels before write)
    griddep_wait();        // x and its statistics: the previous kernels' work
    copy_row_sets(sets, stats_in, 0, nb, n_sets);
    cp_async_commit();
    // x's rows as float16 into shared memory (zero past K), and |x|_1: warp w rows w, w + 4
    for (int b = warp; b < nb; b += Q8W_WARPS) {
        float l1 = 0.0f;
        for (int p = lane; p < n_chunks * 4; p += 32) {
            const int col = 8 * p;
            uint4 raw = make_uint4(0, 0, 0, 0);
            if (col < K) raw = *reinterpret_cast<const uint4*>(x + static_cast<long long>(b) * K + col);
            const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int k = 0; k < 8; ++k) l1 += fabsf(to_float(e[k]));
            *reinterpret_cast<uint4*>(xs + b * xs_stride + col) = x_as_half8<T>(raw);
        }
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) l1 += __shfl_xor_sync(0xffffffffu, l1, off);
        if (lane == 0) s_l1[b] = l1;
    }
    cp_async_wait<0>();
    __syncthreads();  // the rows, their |x|_1 and every thread's sets
    rows_mean_rstd(s_mean, s_rstd, sets, n_sets, nb, K, eps, warp, Q8W_WARPS, lane);
    __syncthreads();
    float c_mean[2], c_rstd[2], c_l1[2];  // this lane's columns 2t, 2t + 1 (rows of x)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int bl = min(2 * t + k, nb - 1);
        c_mean[k] = s_mean[bl], c_rstd[k] = s_rstd[bl], c_l1[k] = s_l1[bl];
    }
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float best[2] = {-INFINITY, -INFINITY};  // the best lo of columns 2t, 2t + 1 over the warp's tiles

    auto process = [&](const uint4 (&w)[CH], const float (&rc)[6], int i) {
        const int c0 = (i % per_tile) * CH;
#pragma unroll
        for (int u = 0; u < CH; ++u) {
            if (c0 + u < n_chunks) {
                const uint4 qa = q8_to_half8(make_uint2(w[u].x, w[u].y)), qb = q8_to_half8(make_uint2(w[u].z, w[u].w));
                const unsigned a0[4] = {qa.x, qb.x, qa.y, qb.y};  // memory columns 8t .. 8t+3
                const unsigned a1[4] = {qa.z, qb.z, qa.w, qb.w};  // 8t+4 .. 8t+7
                uint4 xv = make_uint4(0, 0, 0, 0);
                if (g < nb) xv = *reinterpret_cast<const uint4*>(xs + g * xs_stride + 32 * (c0 + u) + 8 * t);
                mma_m16n8k16<__half>(acc, a0, xv.x, xv.y);
                mma_m16n8k16<__half>(acc, a1, xv.z, xv.w);
            }
        }
        if (i % per_tile != per_tile - 1) return;
        // the tile's epilogue: acc is (row g, column 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
        const int tile = gw + (i / per_tile) * n_w, m0 = tile * TM;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int bl = 2 * t + k;
            float h = -INFINITY, l = -INFINITY;
#pragma unroll
            for (int r8 = 0; r8 < 2; ++r8) {
                if (bl < nb && m0 + g + 8 * r8 < N) {
                    const float sc = rc[3 * r8], u = rc[3 * r8 + 1], c = rc[3 * r8 + 2], rstd = c_rstd[k];
                    const float s = __fmul_rn(acc[2 * r8 + k], sc);
                    const float v = __fadd_rn(unfold_ln(s, c_mean[k], u, rstd), c);
                    const float err = 0x1p-20f * (rstd * (fabsf(s) + fabsf(c_mean[k] * u)) + fabsf(c) + fabsf(v))
                                      + rstd * sc * (c_l1[k] * (0.5f + kf * 0x1p-14f) + kf * 0x1p-17f) * 1.0625f;
                    h = max_nan(h, v + err), l = fmaxf(l, v - err);
                }
            }
#pragma unroll
            for (int off = 4; off < 32; off <<= 1) {  // over g: the tile's 16 rows (NaN stays in hi)
                h = max_nan(h, __shfl_xor_sync(0xffffffffu, h, off));
                l = fmaxf(l, __shfl_xor_sync(0xffffffffu, l, off));
            }
            if (g == 0 && bl < nb) {
                hi[static_cast<long long>(bl) * tiles + tile] = h;
                best[k] = fmaxf(best[k], l);
                if (h != h) atomicMax(bounds + bl, KEY_LIST_ALL);
            }
        }
        acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
    };
    for (int i = 0; i < items; i += 2) {
        load_item(wb, rb, i + 1);
        process(wa, ra, i);
        if (i + 1 >= items) break;
        load_item(wa, ra, i + 2);
        process(wb, rb, i + 1);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k)
        if (items > 0 && g == 0 && 2 * t + k < nb) atomicMax(bounds + 2 * t + k, bound_key(best[k]));
}

// =======================================================================================
// The screened LM head of float32 models: the exact greedy token of one row of x whose
// LayerNorm runs in the product's prologue, reading W at 8 bits a value for all but the few
// blocks of 32 rows that may hold the largest value (cupy_kernels/linear.py, linear_argmax's
// screen= for float32 rows).
//
//   q[n, k] = round(W[n, k] / s[n]),  s[n] = max_k |W[n, k]| / 127   (quantize_rows; stored
//             as q + 128 in a byte, row-major [N, K], K % 8 == 0)
//   y~ = LayerNorm(x) in float32 (its own mean m~ and rstd r~, in any order)
//   A[n] = s[n] (y~ . q[n]) + bias[n]                                   (linear_q8f_max_kernel)
//
// The exact value E[n] is linear_kernel's (each block normalizes x into y^ with its own order
// of sums, then y^ . W[n] in float32, then the bias). With L = |y~|_1, u = 2^-24 and D a bound
// on |y^ - y~|_1 (below), |E[n] - A[n]| <= e[n]:
//   e = 17/16 (s (L (1/2 + 2^-16 + 1.01 K u 127) + 127.01 (D + 1.01 K u (L + D)))
//              + 2^-22 (|s S| + |A| + |bias|)),   S = y~ . q[n] as summed,
// the terms: the quantization (|W - s q| <= s (1/2 + 2^-16): q from the float32 quotient, s
// rounded), the two LayerNorms' difference (|W| <= 127.01 s), the rounding of the exact and
// the screened sums of K products (1.01 K u of their absolute sums), and of the last
// operations on either side; 17/16 covers the rounding of e itself. D: both y^ and y~ lie
// within d_k of the exact y*_k = (x_k - m*) r* g_k + b_k (m*, r* exact, g and b the
// LayerNorm's weight and bias): the mean as summed is within dm = (K + 2) u |x|_1 / K of m*;
// the sum of squares as summed, over K, plus eps, within (K + 8) u + dm^2 / (var + eps) of
// var* + eps relatively, so either rstd within er = 0.5625 ((K + 8) u + dm^2 / den) + 2^-21
// of r* (rsqrtf: 2 ulp), den a lower bound on var* + eps (eps, and var~ / 2 where dm^2 <=
// var~ / 4); with R = r~ (1 + 4 er),
//   d_k = |g_k| ((|x_k - m~| + 2 dm) R er + 2 dm R) + 4.1 u ((|x_k - m~| + 2 dm) R |g_k| + |b_k|)
// and D = 2 sum_k d_k. Where er > 2^-8 (a row of nearly equal values, say) the bounds are not
// taken: every block's hi is infinite, and every block is computed exactly; so too where the
// variance is past 2^100 or var + eps below 2^-100, or where a row's exact sum could overflow
// (127.01 s (L + D) + |bias| or |A| + e past 2^126); 2^-140 a value and 2^-120 (1 + s) a row
// cover underflow. A NaN hi leaves the bound KEY_LIST_ALL: every block is computed.
//
// linear_q8f_max_kernel: blocks of Q8F_WARPS warps walking groups of 32 rows of W (the exact
// kernel's blocks: 8 warps of 4 rows) blockIdx.x, + gridDim.x, ...; warp w takes rows 4 w ..
// 4 w + 3 of a group, lane l the 8-byte pieces l, l + 32, ... (at most P) of each row, with
// x's values of the same columns in registers (every warp normalizes x by itself, in the same
// order: no barrier). The next group's pieces are requested before this group's are used
// where P <= 4; two blocks an SM where P <= 3 (at P = 4, 128 registers spilled 72 bytes on
// sm_80). hi[g]: the largest A + e of group g (a NaN counts); bounds[0]: the largest A - e over
// all rows (atomicMax of the order keys, once a block). linear_list_kernel computes the
// groups whose hi reaches that bound with linear_kernel's code and bits and gives the others
// the partials (-inf, -1); argmax_partials_kernel then picks the token (and sets the bound
// back to zero).
namespace {
constexpr int Q8F_WARPS = 8;  // warps a block of linear_q8f_max_kernel (linear.py's _Q8F_WARPS)
constexpr int Q8F_ROWS = 4;   // rows of W a warp takes of a group of Q8F_WARPS x Q8F_ROWS

// 8 bytes of W, read once, without allocating in L1 (as load_stream16)
__device__ __forceinline__ uint2 load_stream8(const void* p) {
    uint2 r;
    asm("ld.global.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

// 4 bytes q + 128 as the floats q: the byte b as the float 2^23 + b, less 2^23 + 128 (exact)
__device__ __forceinline__ void q8_to_float4(unsigned r, float* f) {
#pragma unroll
    for (int i = 0; i < 4; ++i) f[i] = __uint_as_float(__byte_perm(r, 0x4B000000u, 0x7540 + i)) - 8388736.0f;
}
}  // namespace

template <int P>
__global__ void __launch_bounds__(Q8F_WARPS * 32, P <= 3 ? 2 : 1)
    linear_q8f_max_kernel(float* __restrict__ hi, const float* x, const unsigned char* __restrict__ Wq,
                          const float* __restrict__ scale, const float* __restrict__ bias,
                          const float* __restrict__ ln_w, const float* __restrict__ ln_b, float eps, int N, int K,
                          unsigned* __restrict__ bounds) {
    constexpr bool AHEAD = P <= 4;  // the next group's pieces requested before this one's are used
    constexpr int G = Q8F_WARPS * Q8F_ROWS;
    constexpr float U24 = 0x1p-24f;
    __shared__ float s_h[Q8F_WARPS], s_l[Q8F_WARPS];
    griddep_launch_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = (N + G - 1) / G;

    auto load_group = [&](uint2 (&w)[Q8F_ROWS][P], float (&sc)[Q8F_ROWS], float (&bi)[Q8F_ROWS], int grp) {
#pragma unroll
        for (int r = 0; r < Q8F_ROWS; ++r) {
            const int n = grp * G + warp * Q8F_ROWS + r;
            const bool row = grp < groups && n < N;
#pragma unroll
            for (int j = 0; j < P; ++j) {
                const int c = 8 * (lane + 32 * j);
                w[r][j] = row && c < K ? load_stream8(Wq + static_cast<long long>(n) * K + c)
                                       : make_uint2(0x80808080u, 0x80808080u);
            }
            sc[r] = row ? scale[n] : 0.0f;
            bi[r] = row && bias != nullptr ? bias[n] : 0.0f;
        }
    };
    uint2 wa[Q8F_ROWS][P], wb[AHEAD ? Q8F_ROWS : 1][AHEAD ? P : 1];
    float sa[Q8F_ROWS], ba[Q8F_ROWS], sb[AHEAD ? Q8F_ROWS : 1], bb[AHEAD ? Q8F_ROWS : 1];
    load_group(wa, sa, ba, blockIdx.x);  // (W, its scales and the bias: never written)
    griddep_wait();  // x: the previous kernels' work

    // y~ in registers, the columns of this lane's pieces (zeros past K), and the bound's terms
    float y[P][8];
    float sum = 0.0f, sum_abs = 0.0f;
#pragma unroll
    for (int j = 0; j < P; ++j) {
        const int c = 8 * (lane + 32 * j);
#pragma unroll
        for (int e = 0; e < 8; e += 4) {
            const float4 v = c < K ? *reinterpret_cast<const float4*>(x + c + e) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            y[j][e] = v.x, y[j][e + 1] = v.y, y[j][e + 2] = v.z, y[j][e + 3] = v.w;
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) sum += y[j][e], sum_abs += fabsf(y[j][e]);
    }
    const float kf = static_cast<float>(K);
    const float mean = warp_sum(sum) / kf;
    const float dm = (kf + 2.0f) * U24 * warp_sum(sum_abs) / kf + 0x1p-140f;  // (+ the mean's underflow)
    float sq = 0.0f;
#pragma unroll
    for (int j = 0; j < P; ++j) {
        if (8 * (lane + 32 * j) < K) {
#pragma unroll
            for (int e = 0; e < 8; ++e) sq += (y[j][e] - mean) * (y[j][e] - mean);
        }
    }
    const float var = warp_sum(sq) / kf;
    const float rstd = rsqrtf(var + eps);
    const float den = eps + (dm * dm <= 0.25f * var ? 0.5f * var : 0.0f);
    const float er = 0.5625f * ((kf + 8.0f) * U24 + dm * dm / den) + 0x1p-21f;
    const float R = rstd * (1.0f + 4.0f * er);
    float l1 = 0.0f, dk = 0.0f;
#pragma unroll
    for (int j = 0; j < P; ++j) {
        const int c = 8 * (lane + 32 * j);
        if (c < K) {
#pragma unroll
            for (int e = 0; e < 8; e += 4) {
                const float4 g4 = *reinterpret_cast<const float4*>(ln_w + c + e);
                const float4 b4 = *reinterpret_cast<const float4*>(ln_b + c + e);
                const float g[4] = {g4.x, g4.y, g4.z, g4.w}, b[4] = {b4.x, b4.y, b4.z, b4.w};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float d = fabsf(y[j][e + i] - mean) + 2.0f * dm;
                    dk += fabsf(g[i]) * (d * R * er + 2.0f * dm * R) + 4.1f * U24 * (d * R * fabsf(g[i]) + fabsf(b[i]))
                          + 0x1p-140f;  // (each value's underflow)
                    y[j][e + i] = (y[j][e + i] - mean) * rstd * g[i] + b[i];
                    l1 += fabsf(y[j][e + i]);
                }
            }
        }
    }
    const float L = warp_sum(l1), D = 2.0f * warp_sum(dk);
    const float ku = 1.01f * kf * U24;
    // e = 17/16 (s C + 2^-22 (...)): C for every row of W (infinite where the bounds are not taken)
    // (and not where the variance is near float32's ends: both sides' terms are relative)
    const bool taken = er <= 0x1p-8f && var + eps >= 0x1p-100f && var <= 0x1p100f;
    const float C = taken ? L * (0.5f + 0x1p-16f + ku * 127.0f) + 127.01f * (D + ku * (L + D)) : INFINITY;
    const float LD = 127.01f * (L + D);  // |y^| |W[n]| over s[n]: the exact sum's terms at most

    float blo = -INFINITY;  // the block's largest A - e (thread 0)
    auto process = [&](const uint2 (&w)[Q8F_ROWS][P], const float (&sc)[Q8F_ROWS], const float (&bi)[Q8F_ROWS],
                       int grp) {
        float acc[Q8F_ROWS];
#pragma unroll
        for (int r = 0; r < Q8F_ROWS; ++r) acc[r] = 0.0f;
#pragma unroll
        for (int j = 0; j < P; ++j) {
#pragma unroll
            for (int r = 0; r < Q8F_ROWS; ++r) {
                float q[8];
                q8_to_float4(w[r][j].x, q);
                q8_to_float4(w[r][j].y, q + 4);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r] = fmaf(y[j][e], q[e], acc[r]);
            }
        }
        float h = -INFINITY, l = -INFINITY;
#pragma unroll
        for (int r = 0; r < Q8F_ROWS; ++r) {
            const float S = warp_sum(acc[r]);
            const int n = grp * G + warp * Q8F_ROWS + r;
            if (n < N) {
                const float a = __fmul_rn(sc[r], S), A = __fadd_rn(a, bi[r]);
                float err = 1.0625f * (sc[r] * C + 0x1p-22f * (fabsf(a) + fabsf(A) + fabsf(bi[r])) + 0x1p-120f * (1.0f + sc[r]));
                // an exact sum that may overflow (its terms' sum past 2^126) is not bounded
                if (!(sc[r] * LD + fabsf(bi[r]) + fabsf(A) + err < 0x1p126f)) err = INFINITY;
                h = max_nan(h, A + err);
                l = fmaxf(l, A - err);
            }
        }
        __syncthreads();  // thread 0 has read the group before's
        if (lane == 0) s_h[warp] = h, s_l[warp] = l;
        __syncthreads();
        if (threadIdx.x == 0) {
            float gh = s_h[0], gl = s_l[0];
#pragma unroll
            for (int i = 1; i < Q8F_WARPS; ++i) gh = max_nan(gh, s_h[i]), gl = fmaxf(gl, s_l[i]);
            hi[grp] = gh;
            blo = fmaxf(blo, gl);
            if (grp + gridDim.x >= groups) atomicMax(bounds, bound_key(blo));  // the block's last group
            if (gh != gh) atomicMax(bounds, KEY_LIST_ALL);
        }
    };
    if constexpr (AHEAD) {
        for (int grp = blockIdx.x; grp < groups; grp += 2 * gridDim.x) {
            load_group(wb, sb, bb, grp + gridDim.x);
            process(wa, sa, ba, grp);
            if (grp + gridDim.x >= groups) break;
            load_group(wa, sa, ba, grp + 2 * gridDim.x);
            process(wb, sb, bb, grp + gridDim.x);
        }
    } else {
        for (int grp = blockIdx.x; grp < groups; grp += gridDim.x) {
            if (grp != static_cast<int>(blockIdx.x)) load_group(wa, sa, ba, grp);
            process(wa, sa, ba, grp);
        }
    }
}

// The screened float32 LM head's exact blocks: block k of this grid takes the exact kernel's
// blocks k per, ..., (k + 1) per - 1 of `grid` (per = ceil(grid / gridDim.x)), a thread each,
// lists those whose hi reaches the row's bound (a NaN counts) and runs linear_kernel's code as
// each listed block, with its bits; the others get the partials (-inf, -1), which
// argmax_partials_kernel skips. Every thread loads the bound beside its hi: one round trip to
// L2 before the list (a hi a block at a time was one round trip each, after the bound's).
template <typename T, typename OutT, int VEC, int RW, int U, int BR, bool LN, int EPI>
__global__ void __launch_bounds__(MAX_WARPS * 32, linear_min_blocks<VEC, RW, U, BR>())
    linear_list_kernel(LINEAR_ROWS_PARAMS, int grid, const float* hi, const unsigned* bounds) {
    static_assert(EPI == ARGMAX && BR == 1, "the screened LM head: the argmax of one row");
    __shared__ int s_list[MAX_WARPS * 32], s_n;
    griddep_launch_dependents();
    griddep_wait();  // hi and the bound: the kernel ahead's
    const int per = (grid + gridDim.x - 1) / gridDim.x, first = blockIdx.x * per, end = min(grid, first + per);
    for (int g0 = first; g0 < end; g0 += blockDim.x) {
        const int g = g0 + threadIdx.x;
        __syncthreads();  // the listed blocks before have read s_list and the shared memory
        if (threadIdx.x == 0) s_n = 0;
        __syncthreads();
        if (g < end) {
            if (!(__ldcg(hi + g) < key_bound(__ldcg(bounds)))) {
                s_list[atomicAdd(&s_n, 1)] = g;
            } else {
                part_val[g] = -INFINITY;
                part_idx[g] = -1;
            }
        }
        __syncthreads();
        const int n = s_n;
        for (int e = 0; e < n; ++e) {
            const int listed = s_list[e];
            __syncthreads();  // the block before is done with the shared memory
            linear_rows<T, OutT, VEC, RW, U, BR, LN, EPI, true>(y, x, W, bias, ln_w, ln_b, eps, res, part_val, part_idx,
                                                                k_cache, v_cache, positions, seq_lens, H, S_max, B, N,
                                                                K, -1, listed, grid);
        }
    }
}
