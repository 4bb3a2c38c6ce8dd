// decode_step.cu - the whole decode step of a float16 / bfloat16 GPT-2 for one sequence as one
// persistent kernel: embedding, every block (q|k|v with the KV-cache append, attention, its
// split merge, the attention projection, MLP up and down), the LM head and the argmax, and
// the position's advance. One block per SM; the phases meet at grid-wide barriers instead of
// kernel boundaries, and each warp requests its next weights before it waits at one, so the
// weights stream in while the other SMs finish the phase before.
//
// Per block of the model (x the residual stream, row statistics as linear.cu leaves them):
//   qkv   = LN_1(x) Wqkv^T + b       keys and values into the cache at positions[0]
//   att   = attention of q over the cache, in `splits` chunks (decode_attention.cuh)
//   x    += merge(att) Wo^T + bo      (each SM merges the chunks itself before the product)
//   f     = gelu(LN_2(x) Wfc^T + bfc)
//   x    += f Wp^T + bp
// then tokens[0] = argmax(LN_f(x) Wte^T), positions[0] += 1. Five barriers a block.
//
// Every number is the one the multi-kernel step computes (gpt2_cupy/model.py record_step), bit
// for bit, so a sequence decoded here gets the tokens it gets in a batch: the products are
// linear.cu's tensor-core products at one row of x (the same KW warps a tile, each taking every
// KW-th chunk of 32 columns in order, mma.sync m16n8k16, the warps' partial tiles added in warp
// order; the folded LayerNorm's epilogue and row statistics from linear.cuh), attention and
// its merge are decode_attention.cuh's, the first LayerNorm is ln_row.
//
// Mapping: a block of 8 warps; a product's tiles of 16 rows of W go to groups of KW warps
// (8 / KW groups a block), tile t to block t % grid, group t / grid, round-robin; an
// attention item (head, split) takes a whole block. Data other SMs wrote in this launch is
// read through L2 (ld.global.cg): L1 is not coherent across SMs.
//
// Barrier: one arrival counter in global memory, monotonic within a launch (barrier k waits
// for k * grid arrivals); the last block to finish resets it. The blocks must all be resident
// at once: the wrapper launches one per SM, cooperatively. A wait that spins past ~2^26 polls
// traps (an error, not a hang).
//
// Measured (H100, float16, the step in a CUDA graph; benchmarks/results/fused_step-h100.json):
// GPT-2 small 386-399 us a step against 251 for the kernel-by-kernel step with programmatic
// launch, GPT-2 XL 2804-2860 against 1893-1910. Blocks of 16 warps with STEP_U = 8 took 889 us
// (small): ptxas spilled ~800 bytes a thread in each product phase at 128 registers. Still
// slow, about 6 us a phase; ptxas holds 255 registers and spills ~160 bytes at STEP_U = 4. Not
// the default (GPT2.fused_step); next: a per-phase clock trace of where a phase's time goes.
//
// Bytes: every weight once (GPT-2 small float16: 248 MB) plus the cache rows; the floor is
// that at the copy bandwidth. FLOPs are those of the products at one row: 2 x params.
//
// Specializations: T in {__half, __nv_bfloat16} x attention items of 128 or 512 threads
// (decode_attention's block width, which fixes the order of its sums).
// Wrapper: cupy_kernels/decode_step.py   Tests: tests/test_decode_step_gpu.py
// Benchmark: benchmarks/decode_step.py, benchmarks/e2e.py
#include "decode_attention.cuh"
#include "linear.cuh"
#include "mma.cuh"

using namespace g2c;

namespace {
constexpr int STEP_WARPS = 8;   // 16 warps capped registers at 128: spills (see above)
constexpr int STEP_THREADS = 32 * STEP_WARPS;
constexpr int STEP_U = 4;             // chunks of 32 columns of W a warp requests at once (8 spilled more)
constexpr int STEP_MAX_C = 1600;      // GPT-2 XL's width: shared-memory rows are sized for it
constexpr unsigned SPIN_LIMIT = 1u << 26;

// Pointers of one block's weights, as the wrapper lays them out (uint64 each).
enum LayerPtr : int {
    L_ATTN_W = 0, L_ATTN_B, L_ATTN_U, L_ATTN_C, L_PROJ_W, L_PROJ_B, L_FC_W, L_FC_U, L_FC_C, L_MLP_W, L_MLP_B,
    L_LN1_W, L_LN1_B, LAYER_PTRS = 16
};
enum StepEpi : int { E_QKV = 0, E_GELU = 1, E_RESIDUAL = 2, E_ARGMAX = 3 };

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Grid barrier in two halves: arrive once this block's writes are done, do work that needs
// nothing from the phase (request weights), then wait for every block's arrival.
__device__ __forceinline__ void grid_arrive(unsigned* count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1u);
    }
}
__device__ __forceinline__ void grid_wait(const unsigned* count, unsigned target) {
    if (threadIdx.x == 0) {
        unsigned spins = 0;
        while (ld_acquire(count) < target) {
            if (++spins > SPIN_LIMIT) __trap();
        }
        __threadfence();
    }
    __syncthreads();
}

// One product of a phase: y = x W^T (+ the epilogue) for the tiles this block's warp groups
// take. Everything but the epilogue's pointers.
template <typename T> struct Product {
    const T* W;
    int N, K, KW;
    const T* x;          // the row of x (global: read through L2) ...
    bool x_shared;       // ... or in shared memory
    const float* fold_u; // X_LN_FOLD: u and c (c also replaces the bias), with s_mean / s_rstd
    const float* fold_c;
    const T* bias;
};

// A warp's chunks of its tile: W rows m0 + g and m0 + g + 8, its columns in batches of STEP_U.
template <typename T> struct WTile {
    uint4 a[STEP_U], b[STEP_U];
    const T *pa, *pb;
    bool ra, rb;
    int my;  // chunks this warp takes

    __device__ __forceinline__ void init(const Product<T>& p, int m0, int kw, int lane) {
        const int g = lane >> 2, t = lane & 3, n_chunks = (p.K + 31) / 32;
        my = kw < n_chunks ? (n_chunks - 1 - kw) / p.KW + 1 : 0;
        ra = m0 + g < p.N, rb = m0 + g + 8 < p.N;
        pa = p.W + static_cast<long long>(ra ? m0 + g : 0) * p.K + 8 * t;
        pb = p.W + static_cast<long long>(rb ? m0 + g + 8 : 0) * p.K + 8 * t;
    }
    __device__ __forceinline__ void load(const Product<T>& p, int j0, int kw, int lane) {
        const int t = lane & 3;
#pragma unroll
        for (int u = 0; u < STEP_U; ++u) {
            const int j = j0 + u, col = 32 * (kw + j * p.KW);
            const bool ok = j < my && col + 8 * t < p.K;
            a[u] = ok && ra ? load_stream16(pa + col) : make_uint4(0, 0, 0, 0);
            b[u] = ok && rb ? load_stream16(pb + col) : make_uint4(0, 0, 0, 0);
        }
    }
};

struct StepShared {
    float red[STEP_WARPS][16];   // partial tiles: [warp][row of the tile]
    float best[STEP_WARPS];      // ARGMAX: per warp group
    int best_n[STEP_WARPS];
    float mean, rstd;            // X_LN_FOLD: of x
    float2 sets[STEP_MAX_C / 16];
    unsigned last;
};

// The mma of one tile by warp kw of its group: acc (row g: c[0], row g + 8: c[2]) for column 0.
// The first batch of W is in w already.
template <typename T>
__device__ __forceinline__ void tile_mma(float (&acc)[4], WTile<T>& w, const Product<T>& p, int kw, int lane) {
    const int g = lane >> 2, t = lane & 3;
    acc[0] = acc[1] = acc[2] = acc[3] = 0.0f;
    for (int j0 = 0; j0 < w.my; j0 += STEP_U) {
        if (j0 > 0) w.load(p, j0, kw, lane);
        uint4 xv[STEP_U];
#pragma unroll
        for (int u = 0; u < STEP_U; ++u) {
            const int col = 32 * (kw + (j0 + u) * p.KW) + 8 * t;
            xv[u] = make_uint4(0, 0, 0, 0);
            if (g == 0 && j0 + u < w.my && col < p.K) {
                xv[u] = p.x_shared ? *reinterpret_cast<const uint4*>(p.x + col)
                                   : __ldcg(reinterpret_cast<const uint4*>(p.x + col));
            }
        }
#pragma unroll
        for (int u = 0; u < STEP_U; ++u) {
            const unsigned a0[4] = {w.a[u].x, w.b[u].x, w.a[u].y, w.b[u].y};
            const unsigned a1[4] = {w.a[u].z, w.b[u].z, w.a[u].w, w.b[u].w};
            mma_m16n8k16<T>(acc, a0, xv[u].x, xv[u].y);
            mma_m16n8k16<T>(acc, a1, xv[u].z, xv[u].w);
        }
    }
}

// The epilogue's outputs and what it needs besides the product.
template <typename T> struct Epilogue {
    T* y;                      // E_QKV: the q|k|v row; E_GELU: f; E_RESIDUAL: x (read, then written)
    T *k_cache, *v_cache;      // E_QKV: this layer's [1, H, S_max, D]
    int H, S_max, pos;
    float2* stats;             // E_RESIDUAL: a set per tile
};

// One phase's product: the tiles of this block's warp groups, round by round. The first batch
// of W of the first round is requested before the wait for the barrier (arrivals `target`);
// after the wait, `prologue()` runs (the attention merge), then the folded LayerNorm's
// statistics are combined when `fold`.
template <typename T, int EPI, typename Prologue>
__device__ __forceinline__ void product_phase(const Product<T>& p, const Epilogue<T>& e, StepShared& sh, const unsigned* count,
                              unsigned target, bool fold, float eps, float& best, int& best_n, Prologue prologue) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int groups = STEP_WARPS / p.KW, grp = warp / p.KW, kw = warp % p.KW;
    const int n_tiles = (p.N + 15) / 16, stride = gridDim.x * groups;
    const int rounds = (n_tiles + stride - 1) / stride;
    const bool in_group = grp < groups;
    int tile = blockIdx.x + gridDim.x * grp;
    WTile<T> w;
    if (in_group && tile < n_tiles) {
        w.init(p, 16 * tile, kw, lane);
        w.load(p, 0, kw, lane);
    }
    grid_wait(count, target);
    prologue();
    if (fold) {  // the row's mean and rstd from the statistics the last RESIDUAL product left
        const int n_sets = (p.K + 15) / 16;
        for (int i = threadIdx.x; i < n_sets; i += STEP_THREADS) sh.sets[i] = __ldcg(e.stats + i);
        __syncthreads();
        if (warp == 0) {
            float mean, m2;
            row_stats(sh.sets, n_sets, p.K, lane % ROW_LANES, mean, m2);
            if (lane == 0) {
                sh.mean = mean;
                sh.rstd = rsqrtf(__fadd_rn(__fdividef(m2, static_cast<float>(p.K)), eps));
            }
        }
        __syncthreads();
    }
    for (int r = 0; r < rounds; ++r, tile += stride) {
        const bool active = in_group && tile < n_tiles;
        const int m0 = 16 * tile;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (active) {
            if (r > 0) {
                w.init(p, m0, kw, lane);
                w.load(p, 0, kw, lane);
            }
            tile_mma(acc, w, p, kw, lane);
            if ((lane & 3) == 0) {
                sh.red[warp][lane >> 2] = acc[0];
                sh.red[warp][(lane >> 2) + 8] = acc[2];
            }
        }
        __syncthreads();
        if (active && kw == 0) {  // lanes 0-15 of the group's first warp: row m0 + lane
            const int n = m0 + lane;
            const bool valid = lane < 16 && n < p.N;
            float s = 0.0f;
            if (lane < 16) {
                for (int k = 0; k < p.KW; ++k) s += sh.red[grp * p.KW + k][lane];  // in warp order
                if (fold) s = __fmul_rn(__fmaf_rn(-sh.mean, p.fold_u[valid ? n : 0], s), sh.rstd);
            }
            const float bn = !valid ? 0.0f : fold ? p.fold_c[n] : p.bias != nullptr ? to_float(p.bias[n]) : 0.0f;
            if constexpr (EPI == E_QKV) {
                if (valid) {
                    const T v = from_float<T>(s + bn);
                    e.y[n] = v;
                    store_kv_column(e.k_cache, e.v_cache, v, n, p.N, e.H, e.S_max, 0, e.pos);
                }
            } else if constexpr (EPI == E_GELU) {
                if (valid) e.y[n] = from_float<T>(gelu_tanh(s + bn));
            } else if constexpr (EPI == E_RESIDUAL) {
                float v = 0.0f;  // the output as stored
                if (valid) {
                    const T yv = from_float<T>(to_float(__ldcg(e.y + n)) + to_float(from_float<T>(s)) + bn);
                    e.y[n] = yv;
                    v = to_float(yv);
                }
                // (mean, m2) of the tile's 16 outputs: linear.cu's RESIDUAL statistics, same tree
                float sum = v;
#pragma unroll
                for (int off = 8; off > 0; off >>= 1) sum = __fadd_rn(sum, __shfl_down_sync(0xffffffffu, sum, off, 16));
                const float mu = __fdividef(__shfl_sync(0xffffffffu, sum, 0, 16), static_cast<float>(min(16, p.N - m0)));
                const float d = valid ? __fsub_rn(v, mu) : 0.0f;
                float q = __fmul_rn(d, d);
#pragma unroll
                for (int off = 8; off > 0; off >>= 1) q = __fadd_rn(q, __shfl_down_sync(0xffffffffu, q, off, 16));
                if (lane == 0) e.stats[tile] = make_float2(mu, q);
            } else {  // E_ARGMAX
                if (valid) keep_max(best, best_n, s + bn, n);
            }
        }
        __syncthreads();  // red is reused by the next round
    }
}
// One attention item, out of line: its registers are allocated apart from the step's.
// (a block runs STEP_THREADS / ATT_THREADS items at once, one per part of ATT_THREADS threads)
template <typename T, int ATT_THREADS>
__device__ __noinline__ void attention_item(float* part_o, float* part_lse, const T* qkv, const T* kc, const T* vc,
                                            const int* seq_lens, int H, int S_max, int C, float scale, int item,
                                            int splits) {
    constexpr int PARTS = STEP_THREADS / ATT_THREADS;
    attend<T, T, 64, 1, ATT_THREADS, PARTS>(nullptr, part_o, part_lse, qkv, kc, vc, nullptr, nullptr, seq_lens, nullptr,
                                            H, H, S_max, 3LL * C, scale, item % H, 0, item / H, splits, 1,
                                            threadIdx.x % ATT_THREADS, threadIdx.x / ATT_THREADS);
}
}  // namespace

template <typename T, int ATT_THREADS>
__global__ void __launch_bounds__(STEP_THREADS, 1)
    decode_step_kernel(int* __restrict__ tokens, int* __restrict__ positions, int* __restrict__ seq_lens,
                       T* __restrict__ x, T* __restrict__ qkv, T* __restrict__ f, float2* __restrict__ stats,
                       float* __restrict__ part_o, float* __restrict__ part_lse, float* __restrict__ best_val,
                       int* __restrict__ best_idx, unsigned* __restrict__ sync, T* __restrict__ k_cache,
                       T* __restrict__ v_cache, const unsigned long long* __restrict__ layers,
                       const T* __restrict__ wte, const T* __restrict__ wpe, const T* __restrict__ lm_head,
                       const float* __restrict__ head_u, const float* __restrict__ head_c, int n_layer, int C, int H,
                       int S_max, int V, int splits, int kw_c, int kw_4c, float eps, float scale) {
    static_assert(STEP_THREADS % ATT_THREADS == 0, "attention items in whole parts of the block");
    constexpr int PARTS = STEP_THREADS / ATT_THREADS;
    constexpr int D = 64;
    __shared__ StepShared sh;
    __shared__ __align__(16) T xs[STEP_MAX_C];  // layer 0's normalized x, then the merged attention row
    unsigned* count = sync;
    unsigned target = 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int tok = tokens[0], pos = positions[0];
    const long long layer_kv = static_cast<long long>(H) * S_max * D;
    float best = -INFINITY;
    int best_n = -1;

    // embedding, and layer 0's LayerNorm, in every block (embedding.cu's and ln_row's bits)
    for (int i = threadIdx.x * 8; i < C; i += STEP_THREADS * 8) {
        float a[8], b[8];
        load_vec<T, 8>(wte + static_cast<long long>(tok) * C + i, a);
        load_vec<T, 8>(wpe + static_cast<long long>(pos) * C + i, b);
#pragma unroll
        for (int k = 0; k < 8; ++k) a[k] += b[k];
        store_vec<T, 8>(xs + i, a);
        if (blockIdx.x == 0) store_vec<T, 8>(x + i, a);  // the residual stream
    }
    __syncthreads();
    if (warp == 0) {
        const T* lw = reinterpret_cast<const T*>(layers[L_LN1_W]);
        const T* lb = reinterpret_cast<const T*>(layers[L_LN1_B]);
        ln_row(xs, xs, xs, lw, lb, eps, C, lane);
    }
    __syncthreads();

    for (int l = 0; l < n_layer; ++l) {
        const unsigned long long* P = layers + static_cast<long long>(l) * LAYER_PTRS;
        T* kc = k_cache + l * layer_kv;
        T* vc = v_cache + l * layer_kv;
        // q|k|v (+ the cache append); layer 0 on the normalized row in shared memory
        {
            Product<T> p{reinterpret_cast<const T*>(P[L_ATTN_W]), 3 * C, C, kw_c, l == 0 ? xs : x, l == 0,
                         reinterpret_cast<const float*>(P[L_ATTN_U]), reinterpret_cast<const float*>(P[L_ATTN_C]),
                         reinterpret_cast<const T*>(P[L_ATTN_B])};
            Epilogue<T> e{qkv, kc, vc, H, S_max, pos, stats};
            product_phase<T, E_QKV>(p, e, sh, count, target, l > 0, eps, best, best_n, [] {});
            if (blockIdx.x == 0 && threadIdx.x == 0) seq_lens[0] = pos + 1;
            grid_arrive(count);
            target += gridDim.x;
        }
        // attention: (head, split) items, a block each
        grid_wait(count, target);
        const int part = threadIdx.x / ATT_THREADS;  // item i: block i % grid, part i / grid (across SMs first)
        for (int i0 = 0; i0 < H * splits; i0 += PARTS * gridDim.x) {
            const int item = i0 + part * gridDim.x + blockIdx.x;
            if (item < H * splits)
                attention_item<T, ATT_THREADS>(part_o, part_lse, qkv, kc, vc, seq_lens, H, S_max, C, scale, item,
                                               splits);
            __syncthreads();
        }
        grid_arrive(count);
        target += gridDim.x;
        // attention projection (+ residual): each block first merges the splits into xs
        {
            Product<T> p{reinterpret_cast<const T*>(P[L_PROJ_W]), C, C, kw_c, xs, true, nullptr, nullptr,
                         reinterpret_cast<const T*>(P[L_PROJ_B])};
            Epilogue<T> e{x, nullptr, nullptr, H, S_max, pos, stats};
            product_phase<T, E_RESIDUAL>(p, e, sh, count, target, false, eps, best, best_n, [&] {
                for (int i = threadIdx.x; i < C; i += STEP_THREADS)
                    merge_column<T, D>(xs, part_o, part_lse, i / D, H, splits, i % D);
                __syncthreads();
            });
            grid_arrive(count);
            target += gridDim.x;
        }
        // MLP up (+ GELU), folded LayerNorm
        {
            Product<T> p{reinterpret_cast<const T*>(P[L_FC_W]), 4 * C, C, kw_c, x, false,
                         reinterpret_cast<const float*>(P[L_FC_U]), reinterpret_cast<const float*>(P[L_FC_C]),
                         nullptr};
            Epilogue<T> e{f, nullptr, nullptr, H, S_max, pos, stats};
            product_phase<T, E_GELU>(p, e, sh, count, target, true, eps, best, best_n, [] {});
            grid_arrive(count);
            target += gridDim.x;
        }
        // MLP down (+ residual)
        {
            Product<T> p{reinterpret_cast<const T*>(P[L_MLP_W]), C, 4 * C, kw_4c, f, false, nullptr, nullptr,
                         reinterpret_cast<const T*>(P[L_MLP_B])};
            Epilogue<T> e{x, nullptr, nullptr, H, S_max, pos, stats};
            product_phase<T, E_RESIDUAL>(p, e, sh, count, target, false, eps, best, best_n, [] {});
            grid_arrive(count);
            target += gridDim.x;
        }
    }
    // LM head with the folded final LayerNorm; each group keeps its best (value, index)
    {
        Product<T> p{lm_head, V, C, kw_c, x, false, head_u, head_c, nullptr};
        Epilogue<T> e{nullptr, nullptr, nullptr, H, S_max, pos, stats};
        product_phase<T, E_ARGMAX>(p, e, sh, count, target, true, eps, best, best_n, [] {});
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {  // the warp's best (order-free: larger value, then smaller index)
        const float v = __shfl_xor_sync(FULL_MASK, best, off);
        const int n = __shfl_xor_sync(FULL_MASK, best_n, off);
        keep_max(best, best_n, v, n);
    }
    if (lane == 0) sh.best[warp] = best, sh.best_n[warp] = best_n;
    __syncthreads();
    if (threadIdx.x == 0) {
        float v = -INFINITY;
        int idx = -1;
        for (int k = 0; k < STEP_WARPS; ++k) keep_max(v, idx, sh.best[k], sh.best_n[k]);
        best_val[blockIdx.x] = v;
        best_idx[blockIdx.x] = idx;
        __threadfence();
        sh.last = atomicAdd(sync + 1, 1u) == gridDim.x - 1;
    }
    __syncthreads();
    if (!sh.last) return;
    // the last block: the token, the next position, the counters back to zero for the next launch
    if (threadIdx.x == 0) {
        __threadfence();
        float v = -INFINITY;
        int idx = -1;
        for (int k = 0; k < static_cast<int>(gridDim.x); ++k) keep_max(v, idx, __ldcg(best_val + k), __ldcg(best_idx + k));
        tokens[0] = idx;
        positions[0] = pos + 1;
        sync[0] = 0;
        sync[1] = 0;
    }
}
