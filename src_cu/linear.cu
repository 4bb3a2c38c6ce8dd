// linear.cu - y = x W^T + bias for a few rows of x: the decode step's matrix-vector
// products and the LM head, with the neighbouring element-wise work fused in.
//
//   xn        = LN ? layernorm(x; ln_w, ln_b, eps) rounded to T : x          (prologue)
//   s[b, n]   = sum_k xn[b, k] W[n, k]                                        W: (out, in)
//   STORE     y = s + bias                       GELU      y = gelu_tanh(s + bias)
//   RESIDUAL  y = T(res + T(s) + bias)  (res may be y: the residual stream, updated in place)
//   QKV_CACHE y = s + bias (the fused q|k|v row), and the k and v columns also into the KV
//             cache [B, H, S_max, D] at positions[b]; seq_lens[b] = positions[b] + 1
//   ARGMAX    y = s + bias (float logits, optional) and, per block and row of x, the largest
//             value and its first index (argmax_partials_kernel in sampling.cu finishes)
//
// Mapping: a warp owns RW consecutive rows of W at a time (blocks of 4 or 8 warps; a warp
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
// output are touched only after it.
//
// Bytes: N K sizeof(T) of W once per pass (+ B K of x from L2 per block); 2 B N K FLOPs:
// bandwidth bound for a few rows. Used inside the decode step instead of cuBLAS, which cannot
// run in a captured CUDA graph.
//
// Specializations: T in {float, __half, __nv_bfloat16} x OutT in {T, float} x VEC in
// {1, 16/sizeof(T)} x (RW, U) tiles x BR in {1, 4} x LN x EPI (cupy_kernels/linear.py,
// where the tile each weight shape gets is chosen, with the measurements behind it).
// Wrapper: cupy_kernels/linear.py   Tests: tests/test_kernels_gpu.py
// Benchmark: benchmarks/decode_step.py (every GPT-2 weight shape, each tile)
#include "common.cuh"

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
            if (n0 + r < N && k < K) {
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

// (value, index) a strictly larger value, or an equal one at a smaller index, replaces.
__device__ __forceinline__ void keep_max(float& best, int& best_n, float v, int n) {
    if (n >= 0 && (best_n < 0 || v > best || (v == best && n < best_n))) best = v, best_n = n;
}
}  // namespace

template <typename T, typename OutT, int VEC, int RW, int U, int BR, bool LN, int EPI>
__global__ void __launch_bounds__(MAX_WARPS * 32, 1)  // (without the 1, ptxas capped some tiles at 128 registers and spilled)
    linear_kernel(OutT* y, const T* x, const T* __restrict__ W, const T* __restrict__ bias,
                  const T* __restrict__ ln_w, const T* __restrict__ ln_b, float eps, const T* res,
                  float* __restrict__ part_val, int* __restrict__ part_idx, T* __restrict__ k_cache,
                  T* __restrict__ v_cache, const int* __restrict__ positions, int* __restrict__ seq_lens, int H,
                  int S_max, int B, int N, int K) {
    extern __shared__ float4 smem4[];
    float* xs = reinterpret_cast<float*>(smem4);  // [BR][K]: this pass's rows of x, as float
    __shared__ float s_sum[MAX_WARPS][BR], s_sq[MAX_WARPS][BR];  // LayerNorm partial sums
    __shared__ float s_best[MAX_WARPS][BR];
    __shared__ int s_idx[MAX_WARPS][BR];
    griddep_launch_dependents();

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    constexpr int STEP = 32 * VEC * U;  // columns covered by one batch of loads
    // The warp's work: row groups g0, g0 + g_stride, ... (RW rows each), each in n_batches
    // steps of STEP columns.
    const int n_batches = (K + STEP - 1) / STEP;
    const int n_groups = (N + RW - 1) / RW;
    const int g0 = blockIdx.x * n_warps + warp, g_stride = gridDim.x * n_warps;
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
    griddep_wait();  // x, res, positions: the previous kernels' work

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
                            const int C = N / 3;
                            if (n >= C) {  // a key or value column: into the cache at the position
                                const int c = n < 2 * C ? n - C : n - 2 * C;
                                const int D = C / H, h = c / D, d = c - h * D;
                                T* cache = n < 2 * C ? k_cache : v_cache;
                                cache[((static_cast<long long>(b0 + b) * H + h) * S_max + pos[b]) * D + d] = v;
                            }
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
            if (blockIdx.x == 0 && threadIdx.x < nb) seq_lens[b0 + threadIdx.x] = positions[b0 + threadIdx.x] + 1;
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
                part_val[static_cast<long long>(b0 + b) * gridDim.x + blockIdx.x] = v;
                part_idx[static_cast<long long>(b0 + b) * gridDim.x + blockIdx.x] = idx;
            }
        }
    }
}
