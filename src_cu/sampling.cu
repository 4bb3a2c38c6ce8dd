// sampling.cu - next-token choice on the GPU: greedy argmax, and seeded sampling with
// temperature, top-k and top-p, one block of 1024 threads per sequence.
//
// argmax: out[b] = the first index of the largest logit of row b.
// argmax_partials: the same, from per-block partials of linear.cu's ARGMAX epilogue;
// argmax_embed: that, then the next decode step's embedding of the token (embedding.cu's).
// publish_tokens: a decode step's tokens into a ring of slots in pinned host memory.
//
// sample: z = logits / temperature; keep the top_k largest z (ties at the k-th value are
// kept too); p ∝ exp(z - max z) over the kept set; top_p keeps the smallest set of the
// largest p whose mass reaches top_p (again with ties); then the token is the inverse CDF,
// in index order, of u ~ U[0, 1) drawn from Philox4x32-10 with key = seed and counter =
// (offsets[row], row), after which offsets[row] is incremented: the counter lives in
// device memory, so a recorded decode step (or a CUDA graph) draws fresh numbers each
// time it runs. Same seed and offsets -> same tokens, on any run.
//
// Thresholds come from a radix select over the float bits (order-preserving 32-bit keys),
// 8 bits per pass with a 256-bin shared-memory histogram: 4 passes find the exact k-th
// value (counts) or the top-p boundary (masses). Masses are fixed-point integers,
// round(exp(z - max) * 2^40), so every sum and histogram is exact and independent of
// the order atomics land in: the choice is deterministic. A token whose probability is
// below 2^-40 of the most likely one's can't be drawn.
//
// Specializations: T in {float, __half, __nv_bfloat16}; argmax_embed's T in {__half,
// __nv_bfloat16} (rows of 16-byte vectors).
// Wrappers: cupy_kernels/sampling.py, cupy_kernels/linear.py (linear_argmax)   Tests: tests/test_kernels_gpu.py
#include "common.cuh"
#include "linear.cuh"

using namespace g2c;

namespace {
constexpr int THREADS = 1024;
constexpr int ARGMAX_PARTIALS_THREADS = 256;  // partials per row: about 1,600 for GPT-2's LM head
// (1024 threads with four partials' loads in flight a thread, and the LM head's per-block argmax
// loop unrolled, measured the same: H100, the step with PDL at 64 / 264 / 520 / 900 cached keys,
// two rounds of one run, benchmarks/results/argmax_partials-h100.log: GPT-2 small float16 B = 1
// 220.9-221.0 / 230.9-232.1 us against 220.4-221.4 / 231.4-232.5, XL 1563.5-1568.1 / 1591.3-1591.5
// against 1559.0-1562.0 / 1587.2-1587.9.)
constexpr int PUBLISH_THREADS = 256;
constexpr float FIXED_ONE = 1099511627776.0f;  // 2^40
using u64 = unsigned long long;
}  // namespace

// Maps floats to unsigned keys with the same order (larger float -> larger key).
__device__ __forceinline__ unsigned order_key(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ u64 warp_inclusive_scan(u64 x) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 t = __shfl_up_sync(FULL_MASK, x, o);
        if (lane >= o) x += t;
    }
    return x;
}

struct SelectShared {
    u64 hist[256];
    u64 above;
    unsigned prefix;
};

// The largest key t with  sum_{i : key(i) >= t} weight(i) >= target  (1 <= target <= total).
template <typename KeyFn, typename WeightFn>
__device__ unsigned select_threshold(int V, u64 target, KeyFn key_of, WeightFn weight_of, SelectShared& sh) {
    unsigned prefix = 0, mask = 0;
    u64 above = 0;  // weight of keys above the current prefix's range
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int j = threadIdx.x; j < 256; j += THREADS) sh.hist[j] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < V; i += THREADS) {
            const unsigned key = key_of(i);
            if ((key & mask) == prefix) {
                const u64 w = weight_of(i);
                if (w) atomicAdd(&sh.hist[(key >> shift) & 255u], w);
            }
        }
        __syncthreads();
        if (threadIdx.x < 32) {  // warp 0 walks the bins from the top, 8 per lane
            const int lane = threadIdx.x;
            u64 h[8], sum = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                h[j] = sh.hist[255 - (lane * 8 + j)];
                sum += h[j];
            }
            const u64 incl = warp_inclusive_scan(sum), excl = incl - sum;
            const unsigned hit = __ballot_sync(FULL_MASK, above + incl >= target && above + excl < target);
            const int src = hit ? __ffs(hit) - 1 : 31;
            if (lane == src) {
                u64 acc = above + excl;
                int j = 0;
                for (; j < 7; ++j) {
                    if (acc + h[j] >= target) break;
                    acc += h[j];
                }
                sh.prefix = prefix | (static_cast<unsigned>(255 - (lane * 8 + j)) << shift);
                sh.above = acc;
            }
        }
        __syncthreads();
        prefix = sh.prefix;
        above = sh.above;
        mask |= 255u << shift;
    }
    return prefix;
}

// Warp-wide (value, index) argmax: the larger value wins, then the smaller index;
// index -1 marks "no element".
__device__ __forceinline__ void warp_argmax(float& best, int& idx) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(FULL_MASK, best, o);
        const int i = __shfl_xor_sync(FULL_MASK, idx, o);
        if (i >= 0 && (idx < 0 || v > best || (v == best && i < idx))) {
            best = v;
            idx = i;
        }
    }
}

template <typename T>
__global__ void __launch_bounds__(THREADS) argmax_kernel(int* __restrict__ out, const T* __restrict__ logits, int V) {
    __shared__ float s_val[32];
    __shared__ int s_idx[32];
    const T* x = logits + static_cast<long long>(blockIdx.x) * V;
    float best = -INFINITY;
    int idx = -1;
    for (int i = threadIdx.x; i < V; i += THREADS) {  // increasing i: ties keep the first
        const float v = to_float(x[i]);
        if (idx < 0 || v > best) {
            best = v;
            idx = i;
        }
    }
    warp_argmax(best, idx);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) {
        s_val[warp] = best;
        s_idx[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        best = s_val[lane];
        idx = s_idx[lane];
        warp_argmax(best, idx);
        if (lane == 0) out[blockIdx.x] = idx;
    }
}

// The last step of a fused argmax: row b's G per-block partials (largest value, its first
// index; index -1 = none), written by linear_kernel's ARGMAX epilogue, reduced by the block of
// row b; the token is returned to every thread. Equal values keep the smaller index, as
// argmax_kernel. positions (optional): positions[b] += 1, the decode step's move to the next
// token (kv_advance) without a launch of its own.
__device__ __forceinline__ int reduce_partials(int* __restrict__ out, const float* __restrict__ val,
                                               const int* __restrict__ idx, int G, int* __restrict__ positions,
                                               int& position) {
    __shared__ float s_val[32];
    __shared__ int s_idx[32];
    __shared__ int s_token, s_position;
    const long long row = static_cast<long long>(blockIdx.x) * G;
    // the position requested beside the partials, not after their reduction (one L2 round trip
    // less); every partial of a round requested before the first is compared (coherent loads:
    // the kernel ahead wrote them), in the order of the loop's iterations: GPT-2's 3,142 tiles
    // in one round. H100, the screened head's argmax kernel in the plain graph: 2.8-3.0 us
    // against 3.3-3.5 with loads in batches of 4 iterations, each waiting for its indices
    // before its values (benchmarks/NOTES.md, "The screened LM head")
    const int pos0 = threadIdx.x == 0 && positions != nullptr ? __ldcg(positions + blockIdx.x) : 0;
    constexpr int ROUND = 16;
    float best = -INFINITY;
    int bi = -1;
    for (int g0 = threadIdx.x; g0 < G; g0 += ROUND * ARGMAX_PARTIALS_THREADS) {
        int ri[ROUND];
        float rv[ROUND];
#pragma unroll
        for (int u = 0; u < ROUND; ++u) {
            const int g = g0 + u * ARGMAX_PARTIALS_THREADS;
            ri[u] = g < G ? __ldcg(idx + row + g) : -1;
            rv[u] = g < G ? __ldcg(val + row + g) : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < ROUND; ++u)
            if (ri[u] >= 0 && (bi < 0 || rv[u] > best || (rv[u] == best && ri[u] < bi))) best = rv[u], bi = ri[u];
    }
    warp_argmax(best, bi);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) s_val[warp] = best, s_idx[warp] = bi;
    __syncthreads();
    if (warp == 0) {
        best = lane < ARGMAX_PARTIALS_THREADS / 32 ? s_val[lane] : -INFINITY;
        bi = lane < ARGMAX_PARTIALS_THREADS / 32 ? s_idx[lane] : -1;
        warp_argmax(best, bi);
        if (lane == 0) {
            out[blockIdx.x] = bi;
            s_token = bi;
            s_position = positions != nullptr ? pos0 + 1 : 0;
            if (positions != nullptr) positions[blockIdx.x] = s_position;
        }
    }
    __syncthreads();
    position = s_position;
    return s_token;
}

// bounds (optional): bounds[b] = 0 (a screened LM head's row bounds, linear.cu's
// linear_q8_max_kernel, made ready for its next launch; every kernel that reads them has ended).
__global__ void __launch_bounds__(ARGMAX_PARTIALS_THREADS)
    argmax_partials_kernel(int* __restrict__ out, const float* __restrict__ val, const int* __restrict__ idx, int G,
                           int* __restrict__ positions, unsigned* __restrict__ bounds) {
    griddep_launch_dependents();  // (the publish and the next step's embedding read nothing before their waits)
    griddep_wait();
    if (bounds != nullptr && threadIdx.x == 0) bounds[blockIdx.x] = 0u;
    int position;
    reduce_partials(out, val, idx, G, positions, position);
}

// argmax_partials_kernel, then the next decode step's embedding of row b from the token and
// the moved position, as embedding_kernel's STATS variant writes it (x [B, C] and its row
// statistics [B, C / 16] from linear.cuh's embed_set: the same bits), so that the next step
// starts with its first product. The embedding's token and position rows are clamped into
// wte's V and wpe's P rows (a graph's last step embeds for a step that may never run, at the
// cache's end).
template <typename T>
__global__ void __launch_bounds__(ARGMAX_PARTIALS_THREADS)
    argmax_embed_kernel(int* __restrict__ out, const float* __restrict__ val, const int* __restrict__ idx, int G,
                        int* __restrict__ positions, unsigned* __restrict__ bounds, T* __restrict__ x,
                        float2* __restrict__ stats, const T* __restrict__ wte, const T* __restrict__ wpe, int C, int V,
                        int P) {
    griddep_launch_dependents();  // (the next step's first product reads only its weights before its wait)
    griddep_wait();
    if (bounds != nullptr && threadIdx.x == 0) bounds[blockIdx.x] = 0u;
    int position;
    const int token = reduce_partials(out, val, idx, G, positions, position);
    const T* tok = wte + static_cast<long long>(min(max(token, 0), V - 1)) * C;
    const T* pos = wpe + static_cast<long long>(min(position, P - 1)) * C;
    const long long b = blockIdx.x;
    const int n_sets = (C + 15) / 16;
    for (int j = threadIdx.x; j < n_sets; j += ARGMAX_PARTIALS_THREADS)
        stats[b * n_sets + j] = embed_set<T>(tok, pos, j, C, x + b * C, static_cast<T*>(nullptr));
}

// A decode step's B tokens into slot *slot of ring ([slots][B] int32, pinned host memory that
// the GPU writes directly), then *slot = (*slot + 1) % slots: the host reads a step's tokens
// there once an event after the step has fired, with no copy of its own in the stream (a
// device-to-host copy of the tokens after each step cost 9-10 us of the step's wall time at
// batch 1 and 64 on the H100, a copy node inside the graph as much; gpt2_cupy/engine.py).
__global__ void __launch_bounds__(PUBLISH_THREADS)
    publish_tokens_kernel(int* ring, int* __restrict__ slot, const int* __restrict__ tokens, int B, int slots) {
    griddep_launch_dependents();  // (the next step's embedding reads nothing before its wait)
    griddep_wait();
    const int s = *slot;
    for (int b = threadIdx.x; b < B; b += PUBLISH_THREADS) ring[static_cast<long long>(s) * B + b] = tokens[b];
    __syncthreads();  // every thread has read *slot
    if (threadIdx.x == 0) *slot = (s + 1) % slots;
}

template <typename T>
__global__ void __launch_bounds__(THREADS, 1)  // (without the 1, ptxas used 32 registers and spilled on sm_80)
    sample_kernel(int* __restrict__ out, const T* __restrict__ logits, int V, float inv_temp, int top_k,
                  float top_p, unsigned seed_lo, unsigned seed_hi, unsigned long long* __restrict__ offsets) {
    __shared__ float scratch[32];
    __shared__ SelectShared sh;
    __shared__ u64 s_warp[32];
    const T* x = logits + static_cast<long long>(blockIdx.x) * V;
    const u64 offset = offsets[blockIdx.x];  // read before thread 0 increments it, at the end
    auto z_of = [&](int i) { return to_float(x[i]) * inv_temp; };
    auto key_of = [&](int i) { return order_key(z_of(i)); };

    float mx = -INFINITY;
    for (int i = threadIdx.x; i < V; i += THREADS) mx = fmaxf(mx, z_of(i));
    mx = block_max(mx, scratch);

    unsigned keep = 0;  // kept: key >= keep
    if (top_k > 0 && top_k < V) {
        keep = select_threshold(V, static_cast<u64>(top_k), key_of, [](int) { return u64{1}; }, sh);
    }
    auto mass_of = [&](int i) -> u64 {
        const float z = z_of(i);
        return order_key(z) >= keep ? __float2ull_rn(exp2f((z - mx) * LOG2E) * FIXED_ONE) : u64{0};
    };

    if (top_p < 1.0f) {
        u64 total = 0;
        for (int i = threadIdx.x; i < V; i += THREADS) total += mass_of(i);
        total = warp_inclusive_scan(total);  // lane 31 holds the warp's sum
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        __syncthreads();
        if (lane == 31) s_warp[warp] = total;
        __syncthreads();
        total = 0;
        for (int w = 0; w < THREADS / 32; ++w) total += s_warp[w];
        u64 target = static_cast<u64>(ceil(static_cast<double>(top_p) * static_cast<double>(total)));
        target = max(target, u64{1});
        keep = select_threshold(V, target, key_of, mass_of, sh);
    }

    // inverse CDF in index order: each thread owns a contiguous chunk of the vocabulary
    const int chunk = (V + THREADS - 1) / THREADS;
    const int lo = min(V, threadIdx.x * chunk), hi = min(V, lo + chunk);
    u64 local = 0;
    for (int i = lo; i < hi; ++i) local += mass_of(i);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 incl = warp_inclusive_scan(local);
    __syncthreads();
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    u64 before = 0, total = 0;
    for (int w = 0; w < THREADS / 32; ++w) {
        if (w < warp) before += s_warp[w];
        total += s_warp[w];
    }
    const u64 excl = before + incl - local;

    const uint4 r = philox4x32_10(make_uint4(static_cast<unsigned>(offset), static_cast<unsigned>(offset >> 32),
                                             blockIdx.x, 0u),
                                  make_uint2(seed_lo, seed_hi));
    const u64 u24 = r.x >> 8;  // u = u24 / 2^24, target = floor(total * u) exactly
    const u64 goal = (total >> 24) * u24 + (((total & 0xFFFFFFull) * u24) >> 24);
    if (local > 0 && excl <= goal && goal < excl + local) {
        u64 acc = excl;
        for (int i = lo; i < hi; ++i) {
            acc += mass_of(i);
            if (acc > goal) {
                out[blockIdx.x] = i;
                break;
            }
        }
    }
    if (threadIdx.x == 0) offsets[blockIdx.x] = offset + 1;  // every thread read it before the scans' barriers
}
