// decode_step.cu - the whole decode step of a float16 / bfloat16 GPT-2 for one sequence as one
// persistent kernel: embedding, every block (q|k|v with the KV-cache append, attention, its
// split merge, the attention projection, MLP up and down), the LM head and the argmax, and
// the position's advance. One block per SM; the phases meet at grid-wide barriers instead of
// kernel boundaries, and a producer warp streams the weights into shared memory ahead of them.
//
// Per block of the model (x the residual stream, row statistics as linear.cu leaves them):
//   qkv   = LN_1(x) Wqkv^T + b       keys and values into the cache at positions[0]
//   att   = attention of q over the cache, in equal chunks of at most chunk_keys keys (decode_attention.cuh)
//   x    += merge(att) Wo^T + bo      (the last split of a head to finish merges its chunks)
//   f     = gelu(LN_2(x) Wfc^T + bfc)
//   x    += f Wp^T + bp
// then tokens[0] = argmax(LN_f(x) Wte^T), positions[0] += 1.
//
// Every number is the one the multi-kernel step computes (gpt2_cupy/model.py record_step), bit
// for bit, so a sequence decoded here gets the tokens it gets in a batch: the products are
// linear.cu's tensor-core products at one row of x (the same KW warps a tile, each taking every
// KW-th chunk of 32 columns in order, mma.sync m16n8k16, the warps' partial tiles added in warp
// order; the folded LayerNorm's epilogue and row statistics from linear.cuh), attention and
// its merge are decode_attention.cuh's, the embedding and its row statistics embedding.cu's (embed_set).
//
// Mapping: a block of 8 consumer warps and one producer warp per SM. The producer streams
// every weight of the step, in the consumers' order, through a ring of 34 KiB stages in shared
// memory (as many as fit: 6 on an H100) with mbarriers for full and free slots: on sm_90 a
// bulk copy per row (cp.async.bulk), before sm_90 16-byte cp.async pieces. Weights are never
// written, so it runs ahead across the grid barriers while the consumers wait, compute
// attention or run epilogues. A product's tiles of 16 rows of W go to groups of KW warps (8 /
// KW groups a block; above 8 one group, each warp taking the chunks of one or two), dealt
// round-robin over the blocks, each product continuing where the one before stopped; x is
// staged in shared memory once a phase (with the LayerNorm statistics in the same round trip)
// and the epilogue's constants are requested before the barrier.
// Attention items (head, split) take a part of 128 threads each; an item waits only for its
// head's q|k|v tiles (counters), not for a grid barrier, and the part that finishes a head's
// last split merges them (merge_column) into the attention row. Data other SMs wrote in this
// launch is read through L2 (ld.global.cg): L1 is not coherent across SMs.
//
// Barrier: one arrival counter in global memory, monotonic within a launch (barrier k waits
// for k * grid arrivals); four a block of the model (before the projection, MLP up, MLP down
// and the next q|k|v); the last block to finish resets the counters. The blocks must all be
// resident at once: the wrapper launches one per SM, cooperatively. A wait that spins past
// ~2^26 polls traps (an error, not a hang).
//
// Measured (H100, float16, the step in a CUDA graph; benchmarks/results/fused_step-h100.json,
// with a timeline of each phase and each ring stage from the global timer,
// benchmarks/fused_step.py --trace): GPT-2 small 471.6-474.0 us a step against 216.9-242.3 for
// the kernel-by-kernel step with programmatic launch, GPT-2 XL 2691.0-2716.8 against
// 1609.6-1696.5 (an earlier form: small 417-421 against 251-255, XL 2413-2451 against
// 1894-1911; the weights in registers instead of the ring: 2804-2860). The ring is not the
// bound: on XL the consumers waited for a stage 59.2 us of the step, the producer for a free
// slot 1934.8 us, and a stage sat full 12.3 us before it was asked for. The consumers' chain
// is: each phase costs 5-13.5 us (GPT-2 small's MLP down, 48 tiles on 48 SMs, spans 7.2 us;
// the attention 13.1 us on XL), a 32 KiB stage takes 0.5 us of multiplication, and a block's
// tiles, the barrier (fences, 132 arrivals on one counter, the poll), the L2 round trips of
// x, the statistics and the epilogue run one after another.
// Without the barriers, each row handed on as 16-byte words of 4 values and the launch's flag
// twice, polled by the blocks that read it (no fences, no counters but for attention; the
// same bits), the step took 467 us against 245 kernel by kernel in the same run: in its
// timeline a product's last store reached the next product's readers about 2 us later, and a
// phase of one tile already in shared memory still took 3-4 us; not kept. Not the default
// (GPT2.fused_step).
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
constexpr int STEP_WARPS = 8;                       // consumer warps: products, attention, epilogues
constexpr int STEP_THREADS = 32 * STEP_WARPS;
constexpr int BLOCK_THREADS = STEP_THREADS + 32;    // + the producer warp (the last)
constexpr int CONSUMER_BAR = 3;                     // named barrier of the consumers (attend takes 1 + part)
constexpr int STAGE_CHUNKS = 32;                    // chunks of 32 columns (x 16 rows of W) a stage holds at most
constexpr int STAGE_PAD = 64;                       // bytes after each row of a stage: rows g and g + 1 in other banks
constexpr int STAGE_BYTES = 2 * 16 * (STAGE_CHUNKS / 2 * 64 + STAGE_PAD);  // 34 KiB: two tiles of 16 half-rows
constexpr int MAX_STAGES = 8;
constexpr int STEP_MAX_C = 1600;                    // GPT-2 XL's width: shared-memory rows are sized for it
constexpr unsigned SPIN_LIMIT = 1u << 26;
constexpr int HEAD_DIM = 64;
constexpr int STAGE_TRACE = 1536;                   // stages a block traces (trace: 4 x this after the marks)
constexpr int HEAD_TILES = 3 * HEAD_DIM / 16;         // q|k|v tiles of one head

// Pointers of one block's weights, as the wrapper lays them out (uint64 each).
enum LayerPtr : int {
    L_ATTN_W = 0, L_ATTN_B, L_ATTN_U, L_ATTN_C, L_PROJ_W, L_PROJ_B, L_FC_W, L_FC_U, L_FC_C, L_MLP_W, L_MLP_B,
    LAYER_PTRS = 16
};
enum StepEpi : int { E_QKV = 0, E_GELU = 1, E_RESIDUAL = 2, E_ARGMAX = 3 };

// Named barriers here are barrier.sync, not bar.sync (= barrier.sync.aligned, which needs
// whole converged warps): lanes leave the ring's spin loops at different polls, and with
// bar.sync compute-sanitizer's racecheck reported shared-memory hazards across this barrier.
__device__ __forceinline__ void consumers_sync() {
    asm volatile("barrier.sync %0, %1;\n" ::"n"(CONSUMER_BAR), "n"(STEP_THREADS) : "memory");
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// Spin until the phase of `parity` completes; the producer (`idle`) sleeps between polls,
// leaving the SM's issue slots to the consumers.
__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity, bool idle = false) {
    unsigned spins = 0;
    while (!mbar_done(bar, parity)) {
        if (++spins > SPIN_LIMIT) __trap();
        if (idle) __nanosleep(64);
    }
}

enum StageTime : int { STAGE_ISSUED = 0, STAGE_WANTS, STAGE_HAS, STAGE_FREES };

// Row `what` of a block's ring-stage times st ([4][STAGE_TRACE], null: none): stage k, now.
__device__ __forceinline__ void stage_time(unsigned long long* st, int what, unsigned k) {
    if (st != nullptr && k < static_cast<unsigned>(STAGE_TRACE)) st[what * STAGE_TRACE + k] = global_ns();
}

// Optional timeline (benchmarks/fused_step.py --trace): thread 0 of each block writes the
// global timer (ns) at each mark into trace[block][mark], and for each of the block's first
// STAGE_TRACE ring stages the time the producer issued it and the consumers asked for it, had
// it and freed it (the last 4 STAGE_TRACE columns); nothing when trace is null.
struct Trace {
    unsigned long long* at;
    int n;
    unsigned long long* st;  // stage times: [4][STAGE_TRACE] issue / wants / has / frees, or null
    __device__ __forceinline__ void mark() {
        if (at != nullptr && threadIdx.x == 0) at[n++] = global_ns();
    }
    // the consumers' time for stage k: STAGE_WANTS, STAGE_HAS or STAGE_FREES
    __device__ __forceinline__ void stage(int what, unsigned k) const {
        if (threadIdx.x == 0) stage_time(st, what, k);
    }
};

// Grid barrier in two halves (the consumers of every block): arrive once this block's writes
// are done, then wait for every block's arrival.
__device__ __forceinline__ void grid_arrive(unsigned* count) {
    consumers_sync();
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
    consumers_sync();
}

// The weight stream of one product, as the producer and the consumers walk it. Tiles of 16
// rows of W go to groups of KW consumer warps (8 / KW groups a block); round r of block b
// holds tiles vb + grid (grp + groups r) (grp: the group; vb = b - start mod grid), and a round's tiles stream through
// the stage ring in slabs of `sc` chunks of 32 columns each (a multiple of KW: every warp takes
// the same number of chunks of a slab, chunk c of the row to warp c % KW, as linear.cu).
// Stage layout: [grp][row 0..15] rows of sc * 64 bytes + STAGE_PAD.
struct Stream {
    int N, K, KW, groups, n_tiles, stride, rounds, n_chunks, sc, slabs, row_bytes, vb, start;
    // `start`: the block that takes tile 0 (each product deals on from where the one before
    // stopped, so the blocks with a tile more than others change from product to product)
    __device__ __forceinline__ Stream(int N_, int K_, int KW_, int start_) : N(N_), K(K_), KW(KW_), start(start_) {
        groups = max(1, STEP_WARPS / KW);
        n_tiles = (N + 15) / 16;
        stride = gridDim.x * groups;
        vb = (blockIdx.x + gridDim.x - start) % gridDim.x;  // this block's first tile
        rounds = vb < n_tiles ? (n_tiles - 1 - vb) / stride + 1 : 0;
        n_chunks = (K + 31) / 32;
        const int fit = min(STAGE_CHUNKS / groups, (STAGE_BYTES / (16 * groups) - STAGE_PAD) / 64);
        sc = max(1, fit / KW) * KW;
        slabs = (n_chunks + sc - 1) / sc;
        row_bytes = sc * 64 + STAGE_PAD;
    }
    __device__ __forceinline__ int tile(int r, int grp) const { return vb + gridDim.x * (grp + groups * r); }
    __device__ __forceinline__ int next_start() const { return (start + n_tiles) % gridDim.x; }
};

// The producer warp: every stage of one product's stream, in order, into the ring (slot k %
// n_stages for the block's k-th stage of the launch). It waits for the consumers to release a
// slot, then copies the slab's rows of the round's tiles: on sm_90 by the copy engine, a row
// each (cp.async.bulk, counted in bytes on the slot's `full` barrier), before sm_90 by
// 16-byte cp.async pieces. Weights are never written by the step, so the producer runs ahead
// of the consumers across grid barriers, as far as the ring allows.
template <typename T>
__device__ __forceinline__ void produce(const T* W, const Stream& s, unsigned char* ring, unsigned long long* full,
                                        unsigned long long* empty, int n_stages, unsigned& k, int lane,
                                        unsigned long long* st) {
    const unsigned ring_base = smem_addr(ring);
    for (int r = 0; r < s.rounds; ++r) {
        for (int sl = 0; sl < s.slabs; ++sl, ++k) {
            const int slot = k % n_stages;
            mbar_wait(&empty[slot], ((k / n_stages) & 1) ^ 1, true);
            if (lane == 0) stage_time(st, STAGE_ISSUED, k);
            const unsigned base = ring_base + slot * STAGE_BYTES;
            const int col0 = sl * s.sc * 32, cols = min(s.sc * 32, s.K - col0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
            if (lane == 0) {
                unsigned bytes = 0;
                for (int grp = 0; grp < s.groups; ++grp) {
                    const int n0 = 16 * s.tile(r, grp);
                    if (n0 < s.N) bytes += min(16, s.N - n0) * cols * sizeof(T);
                }
                mbar_arrive_expect(&full[slot], bytes);
            }
            __syncwarp();
            for (int i = lane; i < 16 * s.groups; i += 32) {
                const int grp = i / 16, n = 16 * s.tile(r, grp) + i % 16;
                if (n < s.N)
                    cp_bulk(base + i * s.row_bytes, W + static_cast<long long>(n) * s.K + col0, cols * sizeof(T),
                            &full[slot]);
            }
#else
            const int pieces = cols / 8;  // 16-byte pieces of a row
            for (int i = 0; i < 16 * s.groups; ++i) {
                const int grp = i / 16, n = 16 * s.tile(r, grp) + i % 16;
                if (n >= s.N) continue;
                const T* src = W + static_cast<long long>(n) * s.K + col0;
                for (int p = lane; p < pieces; p += 32) cp_async_16(base + i * s.row_bytes + p * 16, src + 8 * p, 16);
            }
            cp_async_mbar_arrive(&full[slot]);
#endif
        }
    }
}

// One product of a phase: y = x W^T (+ the epilogue) for the tiles of this block's groups.
template <typename T> struct Product {
    const T* W;
    int N, K, KW;
    const T* x;          // the row of x (global: read through L2) ...
    bool x_shared;       // ... or in shared memory (xs) already
    const float* fold_u; // X_LN_FOLD: u and c (c also replaces the bias), with s_mean / s_rstd
    const float* fold_c;
    const T* bias;
    int start;           // Stream's start
    bool sets_shared = false;  // X_LN_FOLD: x's statistics sets in sh.sets already (else from e.stats)
};

struct StepShared {
    float red[2 * STEP_WARPS][16];  // partial tiles: [warp of linear.cu's KW][row of the tile]
    float best[STEP_WARPS];      // ARGMAX: per warp group
    int best_n[STEP_WARPS];
    float mean, rstd;            // X_LN_FOLD: of x
    float2 sets[STEP_MAX_C / 16];
    unsigned last;
    int att_last[STEP_WARPS];    // per attention part: it merges its head
    int seq_len;                 // the sequence's length in this step
    unsigned long long full[MAX_STAGES], empty[MAX_STAGES];  // the ring's barriers
};

// The epilogue's outputs and what it needs besides the product.
template <typename T> struct Epilogue {
    T* y;                      // E_QKV: the q|k|v row; E_GELU: f; E_RESIDUAL: x (read, then written)
    T *k_cache, *v_cache;      // E_QKV: this layer's [1, H, S_max, D]
    int H, S_max, pos;
    float2* stats;             // E_RESIDUAL: a set per tile
    unsigned* head_ready;      // E_QKV: tiles done a head (its q, k and v columns), counted up through the launch
};

// One phase's product on the consumers. Before the barrier (arrivals `target`), the epilogue's
// constants of the first round's rows (bias or the folded LayerNorm's u and c: weights); after
// it, `prologue()`, then x into shared memory (xs) and, when `fold`, the statistics of the
// row together (one round trip), the rounds: each warp takes its chunks of every slab from
// the ring (mma.sync m16n8k16 on row g / g + 8 of the tile and column 0 = x, linear.cu's
// order), the group's first warp adds the warps' partial tiles in warp order and runs the
// epilogue. `k`: the block's stage count, as the producer's.
template <typename T, int EPI, typename Prologue>
__device__ __forceinline__ void product_phase(const Product<T>& p, const Epilogue<T>& e, StepShared& sh, T* xs,
                                              const unsigned char* ring, int n_stages, unsigned& k,
                                              const unsigned* count, unsigned target, bool fold, float eps,
                                              float& best, int& best_n, Trace& tr, Prologue prologue) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const Stream s(p.N, p.K, p.KW, p.start);
    // KW > 8 (linear.py's _mma_warps for K > 2048: 12 or 16): each of the 8 warps does the
    // work of linear.cu's warp kw and, where KW has it, kw + 8, in two sets of accumulators
    const int wpg = min(p.KW, STEP_WARPS);  // warps of a group
    const int grp = warp / wpg, kw = warp % wpg;
    const bool in_group = grp < s.groups;
    const bool epi_lane = in_group && kw == 0 && lane < 16;  // output row m0 + lane of the group's tile
    const bool second = kw + wpg < p.KW;  // this warp also does linear.cu's warp kw + 8
    float eu = 0.0f, ec = 0.0f;  // the epilogue's constants of that row
    auto constants = [&](int r) {
        const int n = 16 * s.tile(r, grp) + lane;
        if (epi_lane && s.tile(r, grp) < s.n_tiles && n < p.N) {
            eu = fold ? p.fold_u[n] : 0.0f;
            ec = fold ? p.fold_c[n] : p.bias != nullptr ? to_float(p.bias[n]) : 0.0f;
        }
    };
    if (s.rounds > 0) constants(0);
    grid_wait(count, target);
    tr.mark();
    prologue();
    const int n_sets = (p.K + 15) / 16;
    if (fold && !p.sets_shared) {  // the statistics the last RESIDUAL product left of the row
        for (int i = threadIdx.x; i < n_sets; i += STEP_THREADS) sh.sets[i] = __ldcg(e.stats + i);
    }
    if (!p.x_shared) {  // x (written by other SMs in this launch) through L2
        for (int i = 8 * threadIdx.x; i < p.K; i += 8 * STEP_THREADS)
            *reinterpret_cast<uint4*>(xs + i) = __ldcg(reinterpret_cast<const uint4*>(p.x + i));
    }
    consumers_sync();
    if (fold && warp == 0) {  // the row's mean and rstd (read after the next barrier of the consumers)
        float mean, m2;
        row_stats(sh.sets, n_sets, p.K, lane % ROW_LANES, mean, m2);
        if (lane == 0) {
            sh.mean = mean;
            sh.rstd = rsqrtf(__fadd_rn(__fdividef(m2, static_cast<float>(p.K)), eps));
        }
    }
    tr.mark();
    for (int r = 0; r < s.rounds; ++r) {
        const int tile = s.tile(r, grp), m0 = 16 * tile;
        const bool active = in_group && tile < s.n_tiles;
        const bool ra = m0 + g < p.N, rb = m0 + g + 8 < p.N;
        const int n = m0 + lane;
        const bool valid = epi_lane && active && n < p.N;
        if (r > 0) constants(r);
        float res = 0.0f;  // RESIDUAL: the residual stream's value, requested before the tile's work
        if constexpr (EPI == E_RESIDUAL) {
            if (valid) res = to_float(__ldcg(e.y + n));
        }
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f}, acc2[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // (acc2: warp kw + 8)
        for (int sl = 0; sl < s.slabs; ++sl, ++k) {
            const int slot = k % n_stages;
            tr.stage(STAGE_WANTS, k);
            mbar_wait(&sh.full[slot], (k / n_stages) & 1);
            tr.stage(STAGE_HAS, k);
            if (active) {
                const unsigned char* rows = ring + slot * STAGE_BYTES + (grp * 16 + g) * s.row_bytes;
                auto chunk_mma = [&](float (&a4)[4], int c) {  // chunk c of the slab (c < s.sc)
                    const int col = 32 * (sl * s.sc + c) + 8 * t;
                    const bool ok = col < p.K;
                    const uint4 zero = make_uint4(0, 0, 0, 0);
                    const uint4 a = ok && ra ? *reinterpret_cast<const uint4*>(rows + (4 * c + t) * 16) : zero;
                    const uint4 b = ok && rb ? *reinterpret_cast<const uint4*>(rows + 8 * s.row_bytes + (4 * c + t) * 16)
                                             : zero;
                    const uint4 xv = ok && g == 0 ? *reinterpret_cast<const uint4*>(xs + col) : zero;
                    const unsigned a0[4] = {a.x, b.x, a.y, b.y};
                    const unsigned a1[4] = {a.z, b.z, a.w, b.w};
                    mma_m16n8k16<T>(a4, a0, xv.x, xv.y);
                    mma_m16n8k16<T>(a4, a1, xv.z, xv.w);
                };
#pragma unroll 2
                for (int c = kw; c < s.sc; c += p.KW) {
                    if (sl * s.sc + c >= s.n_chunks) break;
                    chunk_mma(acc, c);
                    if (second && sl * s.sc + c + wpg < s.n_chunks) chunk_mma(acc2, c + wpg);
                }
            }
            mbar_arrive(&sh.empty[slot]);  // this thread is done with the slot
            tr.stage(STAGE_FREES, k);
        }
        if (active && t == 0) {
            sh.red[grp * p.KW + kw][g] = acc[0];
            sh.red[grp * p.KW + kw][g + 8] = acc[2];
            if (second) {
                sh.red[kw + wpg][g] = acc2[0];
                sh.red[kw + wpg][g + 8] = acc2[2];
            }
        }
        consumers_sync();
        if (active && kw == 0) {  // lanes 0-15 of the group's first warp: row m0 + lane
            float sum = 0.0f;
            if (lane < 16) {
                for (int j = 0; j < p.KW; ++j) sum += sh.red[grp * p.KW + j][lane];  // in warp order
                if (fold) sum = unfold_ln(sum, sh.mean, eu, sh.rstd);
            }
            const float bn = valid ? ec : 0.0f;
            if constexpr (EPI == E_QKV) {
                if (valid) {
                    const T v = from_float<T>(sum + bn);
                    e.y[n] = v;
                    store_kv_column(e.k_cache, e.v_cache, v, n, p.N, e.H, e.S_max, 0, e.pos);
                }
                __threadfence();  // the tile's outputs are visible to the GPU before it is counted
                __syncwarp();
                if (lane == 0) atomicAdd(&e.head_ready[(m0 % (p.N / 3)) / HEAD_DIM], 1u);
            } else if constexpr (EPI == E_GELU) {
                if (valid) e.y[n] = from_float<T>(gelu_tanh(sum + bn));
            } else if constexpr (EPI == E_RESIDUAL) {
                float v = 0.0f;  // the output as stored
                if (valid) {
                    const T yv = from_float<T>(res + to_float(from_float<T>(sum)) + bn);
                    e.y[n] = yv;
                    v = to_float(yv);
                }
                // (mean, m2) of the tile's 16 outputs: linear.cu's RESIDUAL statistics, same tree
                float su = v;
#pragma unroll
                for (int off = 8; off > 0; off >>= 1) su = __fadd_rn(su, __shfl_down_sync(0xffffffffu, su, off, 16));
                const float mu = __fdividef(__shfl_sync(0xffffffffu, su, 0, 16), static_cast<float>(min(16, p.N - m0)));
                const float d = valid ? __fsub_rn(v, mu) : 0.0f;
                float q = __fmul_rn(d, d);
#pragma unroll
                for (int off = 8; off > 0; off >>= 1) q = __fadd_rn(q, __shfl_down_sync(0xffffffffu, q, off, 16));
                if (lane == 0) e.stats[tile] = make_float2(mu, q);
            } else {  // E_ARGMAX
                if (valid) keep_max(best, best_n, sum + bn, n);
            }
        }
        consumers_sync();  // red is reused by the next round
    }
    tr.mark();
}
// One attention item, out of line: its registers are allocated apart from the step's.
// (a block runs STEP_THREADS / ATT_THREADS items at once, one per part of ATT_THREADS threads)
// The part of the block that finishes a head's last split merges the head's splits into
// att (merge_column, decode_attention.cu's last-block merge); head_done counts the splits.
template <typename T, int ATT_THREADS>
__device__ __noinline__ void attention_item(T* att, unsigned* head_done, const unsigned* head_ready,
                                            unsigned ready, int* s_last, float* part_o, float* part_lse,
                                            const T* qkv, const T* kc, const T* vc, const int* seq_lens, int H,
                                            int S_max, int C, float scale, int item, int splits,
                                            int chunk_keys) {
    constexpr int PARTS = STEP_THREADS / ATT_THREADS, D = HEAD_DIM;
    const int tid = threadIdx.x % ATT_THREADS, part = threadIdx.x / ATT_THREADS, h = item % H;
    if (tid == 0) {  // the head's q, k and v of this layer are written (its tiles counted up to `ready`)
        unsigned spins = 0;
        while (ld_acquire(head_ready + h) < ready) {
            if (++spins > SPIN_LIMIT) __trap();
        }
        __threadfence();
    }
    asm volatile("barrier.sync %0, %1;\n" ::"r"(1 + part), "n"(ATT_THREADS) : "memory");
    attend<T, T, D, 1, ATT_THREADS, PARTS, true, true>(nullptr, part_o, part_lse, qkv, kc, vc, nullptr, nullptr,
                                                       seq_lens, nullptr, H, H, S_max, 3LL * C, scale, h, 0, item / H,
                                                       splits, 1, chunk_keys, tid, part);
    __threadfence();  // this thread's partial results are visible to the GPU before the split is counted
    asm volatile("barrier.sync %0, %1;\n" ::"r"(1 + part), "n"(ATT_THREADS) : "memory");
    // atomicInc wraps to 0 after splits - 1: the counters are zero again for the next layer
    if (tid == 0) s_last[part] = atomicInc(&head_done[h], splits - 1) == splits - 1;
    asm volatile("barrier.sync %0, %1;\n" ::"r"(1 + part), "n"(ATT_THREADS) : "memory");
    if (s_last[part]) {
        __threadfence();
        for (int d = tid; d < D; d += ATT_THREADS) merge_column<T, D>(att, part_o, part_lse, h, H, splits, d);
    }
}
}  // namespace

template <typename T, int ATT_THREADS>
__global__ void __launch_bounds__(BLOCK_THREADS, 1)
    decode_step_kernel(int* __restrict__ tokens, int* __restrict__ positions, int* __restrict__ seq_lens,
                       T* __restrict__ x, T* __restrict__ qkv, T* __restrict__ f, float2* __restrict__ stats,
                       float* __restrict__ part_o, float* __restrict__ part_lse, float* __restrict__ best_val,
                       int* __restrict__ best_idx, unsigned* __restrict__ sync, T* __restrict__ k_cache,
                       T* __restrict__ v_cache, const unsigned long long* __restrict__ layers,
                       const T* __restrict__ wte, const T* __restrict__ wpe, const T* __restrict__ lm_head,
                       const float* __restrict__ head_u, const float* __restrict__ head_c, int n_layer, int C, int H,
                       int S_max, int V, int splits, int chunk_keys, int kw_c, int kw_4c, int n_stages, float eps,
                       float scale,
                       unsigned long long* __restrict__ trace, int trace_marks) {
    static_assert(STEP_THREADS % ATT_THREADS == 0, "attention items in whole parts of the block");
    constexpr int PARTS = STEP_THREADS / ATT_THREADS;
    static_assert(PARTS + 1 <= CONSUMER_BAR, "attend's named barriers are 1 .. PARTS");
    constexpr int D = 64;
    extern __shared__ __align__(128) unsigned char ring[];  // n_stages slots of STAGE_BYTES
    __shared__ StepShared sh;
    __shared__ __align__(16) T xs[4 * STEP_MAX_C];  // x of the product: layer 0's normalized row, the merged attention, ...
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (threadIdx.x < n_stages) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        mbar_init(&sh.full[threadIdx.x], 1);  // the producer's arrival with the bytes to expect
#else
        mbar_init(&sh.full[threadIdx.x], 32);  // each producer lane's cp.async arrival
#endif
        mbar_init(&sh.empty[threadIdx.x], STEP_THREADS);
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
    __syncthreads();  // (the only barrier of all the block's threads)
    unsigned long long* st =  // the block's ring-stage times: its last 4 STAGE_TRACE columns
        trace != nullptr ? trace + static_cast<long long>(blockIdx.x + 1) * trace_marks - 4 * STAGE_TRACE : nullptr;

    if (warp == STEP_WARPS) {  // the producer: every weight of the step, in the consumers' order
        unsigned k = 0;
        int start = 0;
        auto stream = [&](const T* W, int N, int K, int KW) {
            const Stream s(N, K, KW, start);
            produce(W, s, ring, sh.full, sh.empty, n_stages, k, lane, st);
            start = s.next_start();
        };
        for (int l = 0; l < n_layer; ++l) {
            const unsigned long long* P = layers + static_cast<long long>(l) * LAYER_PTRS;
            stream(reinterpret_cast<const T*>(P[L_ATTN_W]), 3 * C, C, kw_c);
            stream(reinterpret_cast<const T*>(P[L_PROJ_W]), C, C, kw_c);
            stream(reinterpret_cast<const T*>(P[L_FC_W]), 4 * C, C, kw_c);
            stream(reinterpret_cast<const T*>(P[L_MLP_W]), C, 4 * C, kw_4c);
        }
        stream(lm_head, V, C, kw_c);
        for (int i = 0; i < n_stages; ++i, ++k)  // every slot released: no copy outlives the block
            mbar_wait(&sh.empty[k % n_stages], ((k / n_stages) & 1) ^ 1);
        return;
    }

    unsigned* count = sync;
    unsigned* head_done = sync + 2;      // [H]: splits done a head (wraps to 0)
    unsigned* head_ready = sync + 2 + H; // [H]: q|k|v tiles done a head
    unsigned target = 0, k = 0;
    int start = 0;  // the block that takes the next product's first tile
    Trace tr{trace != nullptr ? trace + static_cast<long long>(blockIdx.x) * trace_marks : nullptr, 0, st};
    tr.mark();
    const int tok = tokens[0], pos = positions[0];
    if (threadIdx.x == 0) {
        sh.seq_len = pos + 1;  // attention's length, for this block's items
        if (blockIdx.x == 0) seq_lens[0] = pos + 1;
    }
    const long long layer_kv = static_cast<long long>(H) * S_max * D;
    float best = -INFINITY;
    int best_n = -1;

    // embedding and its statistics sets, in every block (embedding.cu's STATS bits): layer 0's
    // q|k|v folds its LayerNorm from them, as every later product does
    for (int j = threadIdx.x; j < C / 16; j += STEP_THREADS)  // (x: the residual stream, by the first block)
        sh.sets[j] = embed_set<T>(wte + static_cast<long long>(tok) * C, wpe + static_cast<long long>(pos) * C, j, C, xs,
                                  blockIdx.x == 0 ? x : static_cast<T*>(nullptr));
    consumers_sync();

    for (int l = 0; l < n_layer; ++l) {
        const unsigned long long* P = layers + static_cast<long long>(l) * LAYER_PTRS;
        T* kc = k_cache + l * layer_kv;
        T* vc = v_cache + l * layer_kv;
        // q|k|v (+ the cache append); layer 0 on the embedding's row and sets in shared memory
        {
            Product<T> p{reinterpret_cast<const T*>(P[L_ATTN_W]), 3 * C, C, kw_c, x, l == 0,
                         reinterpret_cast<const float*>(P[L_ATTN_U]), reinterpret_cast<const float*>(P[L_ATTN_C]),
                         reinterpret_cast<const T*>(P[L_ATTN_B]), start, l == 0};
            start = Stream(3 * C, C, kw_c, start).next_start();
            Epilogue<T> e{qkv, kc, vc, H, S_max, pos, stats, head_ready};
            product_phase<T, E_QKV>(p, e, sh, xs, ring, n_stages, k, count, target, true, eps, best, best_n, tr, [] {});
        }
        // attention: (head, split) items, a part of the block each, once the head's tiles are
        // done (no grid barrier)
        tr.mark();
        const int part = threadIdx.x / ATT_THREADS;  // item i: block i % grid, part i / grid (across SMs first)
        for (int i0 = 0; i0 < H * splits; i0 += PARTS * gridDim.x) {
            const int item = i0 + part * gridDim.x + blockIdx.x;
            if (item < H * splits)
                attention_item<T, ATT_THREADS>(f, head_done, head_ready, (l + 1) * HEAD_TILES, sh.att_last, part_o,
                                               part_lse, qkv, kc, vc, &sh.seq_len, H, S_max, C, scale, item, splits,
                                               chunk_keys);
            consumers_sync();
        }
        tr.mark();
        grid_arrive(count);
        target += gridDim.x;
        // attention projection (+ residual) of the merged attention row (in f)
        {
            Product<T> p{reinterpret_cast<const T*>(P[L_PROJ_W]), C, C, kw_c, f, false, nullptr, nullptr,
                         reinterpret_cast<const T*>(P[L_PROJ_B]), start};
            start = Stream(C, C, kw_c, start).next_start();
            Epilogue<T> e{x, nullptr, nullptr, H, S_max, pos, stats, nullptr};
            product_phase<T, E_RESIDUAL>(p, e, sh, xs, ring, n_stages, k, count, target, false, eps, best, best_n, tr,
                                         [] {});
            grid_arrive(count);
            target += gridDim.x;
        }
        // MLP up (+ GELU), folded LayerNorm
        {
            Product<T> p{reinterpret_cast<const T*>(P[L_FC_W]), 4 * C, C, kw_c, x, false,
                         reinterpret_cast<const float*>(P[L_FC_U]), reinterpret_cast<const float*>(P[L_FC_C]),
                         nullptr, start};
            start = Stream(4 * C, C, kw_c, start).next_start();
            Epilogue<T> e{f, nullptr, nullptr, H, S_max, pos, stats, nullptr};
            product_phase<T, E_GELU>(p, e, sh, xs, ring, n_stages, k, count, target, true, eps, best, best_n, tr, [] {});
            grid_arrive(count);
            target += gridDim.x;
        }
        // MLP down (+ residual)
        {
            Product<T> p{reinterpret_cast<const T*>(P[L_MLP_W]), C, 4 * C, kw_4c, f, false, nullptr, nullptr,
                         reinterpret_cast<const T*>(P[L_MLP_B]), start};
            start = Stream(C, 4 * C, kw_4c, start).next_start();
            Epilogue<T> e{x, nullptr, nullptr, H, S_max, pos, stats, nullptr};
            product_phase<T, E_RESIDUAL>(p, e, sh, xs, ring, n_stages, k, count, target, false, eps, best, best_n, tr,
                                         [] {});
            grid_arrive(count);
            target += gridDim.x;
        }
    }
    // LM head with the folded final LayerNorm; each group keeps its best (value, index)
    {
        Product<T> p{lm_head, V, C, kw_c, x, false, head_u, head_c, nullptr, start};
        Epilogue<T> e{nullptr, nullptr, nullptr, H, S_max, pos, stats, nullptr};
        product_phase<T, E_ARGMAX>(p, e, sh, xs, ring, n_stages, k, count, target, true, eps, best, best_n, tr, [] {});
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {  // the warp's best (order-free: larger value, then smaller index)
        const float v = __shfl_xor_sync(FULL_MASK, best, off);
        const int n = __shfl_xor_sync(FULL_MASK, best_n, off);
        keep_max(best, best_n, v, n);
    }
    if (lane == 0) sh.best[warp] = best, sh.best_n[warp] = best_n;
    consumers_sync();
    if (threadIdx.x == 0) {
        float v = -INFINITY;
        int idx = -1;
        for (int j = 0; j < STEP_WARPS; ++j) keep_max(v, idx, sh.best[j], sh.best_n[j]);
        best_val[blockIdx.x] = v;
        best_idx[blockIdx.x] = idx;
        __threadfence();
        sh.last = atomicAdd(sync + 1, 1u) == gridDim.x - 1;
    }
    consumers_sync();
    tr.mark();
    if (!sh.last) return;
    // the last block: the token, the next position, the counters back to zero for the next launch
    if (threadIdx.x == 0) {
        __threadfence();
        float v = -INFINITY;
        int idx = -1;
        for (int j = 0; j < static_cast<int>(gridDim.x); ++j) keep_max(v, idx, __ldcg(best_val + j), __ldcg(best_idx + j));
        tokens[0] = idx;
        positions[0] = pos + 1;
        sync[0] = 0;
        sync[1] = 0;
        for (int h = 0; h < H; ++h) head_ready[h] = 0;
    }
}
