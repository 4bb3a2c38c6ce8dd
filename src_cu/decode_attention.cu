// decode_attention.cu - one new query per sequence and head against the KV cache (q_len = 1),
// with GQA / MQA, optional ALiBi, quantized caches and a split over the cache (Flash-Decoding).
//
//   out[b, h, :] = sum_{s < len_b} softmax_s(q[b,h,:] . K[b,g,s,:] * scale + alibi[h] (s - len_b + 1)) V[b,g,s,:]
//
// with g = h / (H / H_kv) the key/value head of query head h (MHA: H_kv = H; MQA: H_kv = 1).
// Cache layout [B, H_kv, S_max, D] in the model's dtype, int8 or fp8 e4m3 (kv.cuh; quantized
// rows carry a float scale each, [B, H_kv, S_max]). Sequence b uses its first len_b rows.
//
// Mapping: a block of THREADS (128; 512 for few blocks, or big batches of long caches) per
// (QPB query heads of one KV head, sequence, split). A group of G = D / N lanes holds one
// key row as 16-byte vectors (N elements each: G = 8 for fp16 hd64, 16 for fp16 hd128, 8
// for int8 hd128), so the block's THREADS / G groups work on different keys; each loads
// UNROLL key and value rows before using any, then computes QPB dot products per key (the
// KV row is read once for the QPB heads that share it: GQA), reduces them over the G lanes
// with xor-shuffles and updates an online softmax (one rescale per UNROLL keys). The groups
// of a warp combine their results with shuffles, the warps theirs through shared memory.
// The first chunk's first trip of rows is requested before the sequence length arrives
// (it starts at row 0 whatever the length), so an unsplit short cache waits for memory once,
// and, under programmatic dependent launch, before the kernel ahead (the q|k|v product that
// appends the step's row) has finished: those rows stream in during its last blocks. The
// appended row, len - 1, is read again (from L2) once the length is known, or, where the
// caller passes it (k_new, v_new: the decode step's q|k|v row, which holds it beside q), from
// there at once with q and the length; the rows before it must be older than the kernel ahead
// (attend's PRE_WAIT).
// Split: blockIdx.z takes one chunk of the sequence: one of gridDim.z equal chunks (multiples
// of the block's key tile), or, with chunk_keys > 0, one of ceil(len / chunk_keys) equal chunks
// of at most about chunk_keys keys (a sequence of len keys uses that many of the gridDim.z
// blocks, so its split count, and its numbers, follow its own length alone). A sequence of one
// chunk (one split, or at most chunk_keys keys) is written to out by its block; otherwise each
// block writes its output,
// normalized, and its log2-sum-exp to float32 scratch, and the chunks are combined either
// by the last block of the heads to finish (given counters) or by decode_attention_merge_kernel,
// both with merge_column (a thread per output column, 16 splits in flight).
// L2 warm-up (warm_blocks > 0): the last warm_blocks blocks along x of the grid's first (y, z)
// do no attention; once the kernel before has finished they read warm_words 16-byte words of
// `warm` (a weight a later kernel of the decode step reads) into L2, with a bounded number of
// bytes in flight (warm_l2), and exit (their copies along y and z return at once). They let the
// next kernel start at once; the next kernel's wait covers them, as it covers the attention.
// prefetch (the decode step's cache positions, or nullptr): each block requests its chunk's
// older rows into L2 before its wait (attend, decode_attention.cuh).
// Bytes: the K and V rows of each sequence once (2 len D sizeof(KT) per KV head, + scales),
// and 16 warm_words; FLOPs 4 len D per query head.
//
// Specializations: T in {float, __half, __nv_bfloat16} x KT in {T, signed char, __nv_fp8_e4m3}
// x D in {64, 128} x QPB in {1, 2, 4}, THREADS 128; and THREADS 512 for KT = T; AHEAD (sets of
// trips in flight ahead, attend) 1, and 4 for one query head per block of 128 threads on 16-bit
// rows in q's dtype.
// Wrapper: cupy_kernels/decode_attention.py   Tests: tests/test_decode_attention_gpu.py
// Benchmark: benchmarks/decode_attention.py
#include "decode_attention.cuh"

using namespace g2c;

namespace {
constexpr int WARM_LOADS = 8;  // 16-byte words in flight a thread in warm_l2

// Reads words [w0, w1) of `warm` (a weight of a later kernel) into L2, WARM_LOADS a thread at a
// time: each batch's words are used (the next batch's first word depends on them) before the
// next batch is requested, so a block has THREADS x WARM_LOADS x 16 bytes in flight at most.
// ld.global.cg: L2 only.
template <int THREADS>
__device__ __noinline__ void warm_l2(const uint4* __restrict__ warm, long long w0, long long w1) {
    unsigned acc = 0;
    for (long long w = w0 + threadIdx.x; w < w1;) {
        uint4 v[WARM_LOADS];
#pragma unroll
        for (int u = 0; u < WARM_LOADS; ++u) v[u] = __ldcg(warm + min(w + static_cast<long long>(u) * THREADS, w1 - 1));
#pragma unroll
        for (int u = 0; u < WARM_LOADS; ++u) acc ^= v[u].x;
        w += WARM_LOADS * THREADS + (acc == 0x9e3779b9u);  // (+1 only for that value: the words are waited for)
    }
}
}  // namespace

template <typename T, typename KT, int D, int QPB, int THREADS, int AHEAD>
__global__ void __launch_bounds__(THREADS)
    decode_attention_kernel(T* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_lse,
                            unsigned* __restrict__ counters, const T* __restrict__ q, const KT* __restrict__ k_new,
                            const KT* __restrict__ v_new, const KT* __restrict__ k_cache,
                            const KT* __restrict__ v_cache, const float* __restrict__ k_scale,
                            const float* __restrict__ v_scale, const int* __restrict__ seq_lens,
                            const float* __restrict__ alibi, int H, int H_kv, int S_max, long long q_sb,
                            float scale, int chunk_keys, const uint4* __restrict__ warm, long long warm_words,
                            int warm_blocks, const int* __restrict__ prefetch) {
    const int groups = gridDim.x - warm_blocks;  // the attention's blocks along x
    if (static_cast<int>(blockIdx.x) >= groups) {  // an L2 warm-up block (the wrapper's warm=)
        griddep_launch_dependents();  // it holds nothing the next kernel reads
        if (blockIdx.y != 0 || blockIdx.z != 0) return;  // one set of warm_blocks does the reading
        griddep_wait();  // after the kernel before: the words stream in beside the attention's rows
        const long long per = (warm_words + warm_blocks - 1) / warm_blocks, w0 = (blockIdx.x - groups) * per;
        warm_l2<THREADS>(warm, w0, min(warm_words, w0 + per));
        return;
    }
    const int b = blockIdx.y, splits = gridDim.z;
    // (attend waits for the previous kernel once the first trip's rows are requested)
    attend<T, KT, D, QPB, THREADS, 1, false, false, true, AHEAD>(out, part_o, part_lse, q, k_cache, v_cache,
                                                                 k_scale, v_scale, seq_lens, alibi, H, H_kv, S_max,
                                                                 q_sb, scale, blockIdx.x, b, blockIdx.z, splits,
                                                                 gridDim.y, chunk_keys, threadIdx.x, 0, k_new, v_new,
                                                                 prefetch);
    if (splits == 1 || counters == nullptr) return;
    constexpr int TILE = attention_tile<KT, D, THREADS>();
    const int len = seq_lens[b];
    const int chunk = chunk_length(len, splits, chunk_keys, TILE);
    // splits past the last key hold nothing: leave them out
    const int used = chunk > 0 ? min(splits, (len + chunk - 1) / chunk) : 0;  // len 0: zeros
    // chunk_keys > 0: a sequence of one chunk was written to out by attend; a chunk past the
    // sequence's last key did nothing and is not counted
    if (chunk_keys > 0 && (used <= 1 || static_cast<int>(blockIdx.z) >= used)) return;
    // chunk_keys > 0: the `used` blocks that ran count; equal parts: every split
    const int arrivals = chunk_keys > 0 ? used : splits;
    const int h0 = blockIdx.x / (H / H_kv / QPB) * (H / H_kv) + (blockIdx.x % (H / H_kv / QPB)) * QPB;

    // The last of the splits of these heads to finish merges them all (no second launch).
    // atomicInc wraps to 0 after arrivals - 1, so the counters are zero again for the next call.
    __shared__ bool s_last;
    __threadfence();  // this thread's partial results are visible to the GPU before it is counted
    __syncthreads();
    if (threadIdx.x == 0)
        s_last = atomicInc(&counters[b * groups + blockIdx.x], arrivals - 1) == static_cast<unsigned>(arrivals - 1);
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    const long long row_h0 = static_cast<long long>(b) * H + h0, rows = static_cast<long long>(gridDim.y) * H;
    for (int e = threadIdx.x; e < QPB * D; e += THREADS)
        merge_column<T, D>(out, part_o, part_lse, row_h0 + e / D, rows, used, e % D);
}

// The merge as a kernel of its own, for launches without counters: one block of D
// threads per (sequence, head) row. It lets the next kernel start before it waits, so that
// the product after it requests its weights while the attention still runs (H100, float16
// decode step with PDL: GPT-2 large 1040 against 1085 us, small 251 / 256 at batch 1, 888 /
// 895 at 64; the attention kernel itself waits first: letting it go too took small's batch
// 1 from 286 to 300 us, the chain of kernels started early crowding the attention's loads).
template <typename T, int D>
__global__ void __launch_bounds__(D)
    decode_attention_merge_kernel(T* __restrict__ out, const float* __restrict__ part_o,
                                  const float* __restrict__ part_lse, int rows, int splits) {
    griddep_launch_dependents();  // programmatic dependent launch: the next kernel may start
    griddep_wait();               // the previous kernel's writes are visible
    merge_column<T, D>(out, part_o, part_lse, blockIdx.x, rows, splits, threadIdx.x);
}
