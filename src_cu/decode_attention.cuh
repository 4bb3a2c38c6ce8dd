// decode_attention.cuh - the body of decoding attention for one (query-head group, sequence,
// split) and the merge of split results, shared by decode_attention.cu's kernels and the
// fused decode step (decode_step.cu), so that both compute the same bits. decode_attention.cu's
// header describes the algorithm and the measurements behind its choices.
#pragma once

#include "kv.cuh"

namespace g2c {

constexpr int MERGE_LOADS = 16;  // splits' partial results in flight per thread while merging

// Load n = VEC elements of the query starting at p (VEC a multiple of T's 16-byte vector).
// THROUGH_L2 (__ldcg) for decode_step.cu, which rewrites q in every layer of one launch (L1
// is not coherent with other SMs' stores). decode_attention.cu's kernels use plain loads:
// with ld.global.cg ptxas spilled 16-24 bytes in the 512-thread, 4-head specializations
// for sm_86-90 (128 registers), and none with plain loads.
template <typename T, int VEC, bool THROUGH_L2>
__device__ __forceinline__ void load_query(const T* p, float mul, float (&out)[VEC]) {
    constexpr int TV = Vec<T>::N;
    static_assert(VEC % TV == 0, "a lane's query slice is whole 16-byte vectors");
#pragma unroll
    for (int c = 0; c < VEC; c += TV) {
        const uint4* v = reinterpret_cast<const uint4*>(p + c);
        const uint4 raw = THROUGH_L2 ? __ldcg(v) : *v;
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < TV; ++i) out[c + i] = to_float(e[i]) * mul;
    }
}

// The splits' partial results of one (sequence, head) row are combined as
//   out[row, d] = sum_i w_i o_i[row, d],   w_i = 2^(lse_i - max lse) / sum_j 2^(lse_j - max lse)
// by one thread per column, online over the splits (a running max, as in the kernel's
// softmax): it requests MERGE_LOADS splits' log2-sum-exps and outputs at once, so that
// up to MERGE_LOADS splits cost one memory latency. Loads bypass L1 (__ldcg): the partial
// results were written by other blocks.
template <typename T, int D>
__device__ __forceinline__ void merge_column(T* __restrict__ out, const float* __restrict__ part_o,
                                             const float* __restrict__ part_lse, long long row, long long rows,
                                             int splits, int d) {
    float m = -INFINITY, l = 0.0f, o = 0.0f;
    for (int i = 0; i < splits; i += MERGE_LOADS) {
        float lse[MERGE_LOADS], x[MERGE_LOADS];
#pragma unroll
        for (int u = 0; u < MERGE_LOADS; ++u) {
            const bool in = i + u < splits;
            lse[u] = in ? __ldcg(part_lse + (i + u) * rows + row) : -INFINITY;
            x[u] = in ? __ldcg(part_o + ((i + u) * rows + row) * D + d) : 0.0f;
        }
        float mx = m;
#pragma unroll
        for (int u = 0; u < MERGE_LOADS; ++u) mx = fmaxf(mx, lse[u]);
        if (mx == -INFINITY) continue;  // no key so far
        const float alpha = exp2_approx(m - mx);
        l *= alpha;
        o *= alpha;
#pragma unroll
        for (int u = 0; u < MERGE_LOADS; ++u) {
            const float w = exp2_approx(lse[u] - mx);
            l += w;
            o = fmaf(w, x[u], o);
        }
        m = mx;
    }
    out[row * D + d] = from_float<T>(l > 0.0f ? o / l : 0.0f);  // no key at all: zeros
}

// The key and value rows of one loop trip of a group: rows base + u GROUPS + group (u <
// UNROLL) below `end`, as raw 16-byte vectors, with their scales; zeros beyond `end` (a
// masked key must not bring NaN into 0 * v).
template <typename KT, int GROUPS, int UNROLL, bool STREAMING> struct Trip {
    KvVec<KT> k[UNROLL], v[UNROLL];
    float k_scale[UNROLL], v_scale[UNROLL];

    __device__ __forceinline__ void load(const KT* kc, const KT* vc, const float* ks, const float* vs, int D,
                                         int group, int base, int end) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int s = base + u * GROUPS + group;
            k_scale[u] = v_scale[u] = 1.0f;
            if (s < end) {
                if constexpr (STREAMING) {
                    k[u].load_streaming(kc + static_cast<long long>(s) * D);
                    v[u].load_streaming(vc + static_cast<long long>(s) * D);
                } else {
                    k[u].load(kc + static_cast<long long>(s) * D);
                    v[u].load(vc + static_cast<long long>(s) * D);
                }
                if constexpr (KvFormat<KT>::QUANTIZED) {
                    k_scale[u] = ks[s];
                    v_scale[u] = vs[s];
                }
            } else {
                k[u].zero();
                v[u].zero();
            }
        }
    }

    // Load row `row` of a trip loaded from row 0 again, from L2 (ld.global.cg: a line of it
    // that the first load brought into L1 may be stale), where this group holds it.
    __device__ __forceinline__ void reload(const KT* kc, const KT* vc, const float* ks, const float* vs, int D,
                                           int group, int row) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (u * GROUPS + group == row) {
                k[u].load_l2(kc + static_cast<long long>(row) * D);
                v[u].load_l2(vc + static_cast<long long>(row) * D);
                if constexpr (KvFormat<KT>::QUANTIZED) {
                    k_scale[u] = __ldcg(ks + row);
                    v_scale[u] = __ldcg(vs + row);
                }
            }
        }
    }

    // Put row `row` of a trip loaded from row 0, where this group holds it: the lane's slice
    // of it as the kernel ahead wrote it beside q (k_row, v_row; caches in q's dtype only).
    __device__ __forceinline__ void put(const KvVec<KT>& k_row, const KvVec<KT>& v_row, int group, int row) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (u * GROUPS + group == row) {
                k[u] = k_row;
                v[u] = v_row;
            }
        }
    }

    // Zero the rows at or past `end` of a trip loaded from row 0 before `end` was known.
    __device__ __forceinline__ void mask(int group, int end) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (u * GROUPS + group >= end) {
                k_scale[u] = v_scale[u] = 1.0f;
                k[u].zero();
                v[u].zero();
            }
        }
    }
};

// Keys a chunk of a sequence of len keys: `splits` equal parts of the length rounded up to
// whole loop trips of TILE, or, with chunk_keys > 0, as many equal parts as chunks of at most
// chunk_keys keys need (ceil(len / chunk_keys): the split count then follows the sequence's own
// length, and blocks past its last chunk are empty).
__device__ __forceinline__ int chunk_length(int len, int splits, int chunk_keys, int tile) {
    const int parts = chunk_keys > 0 ? max(1, (len + chunk_keys - 1) / chunk_keys) : splits;
    return (len + parts * tile - 1) / (parts * tile) * tile;
}

// One block of THREADS threads: query heads h0 .. h0 + QPB of KV-head group `bx`, sequence b,
// chunk `split` of `splits` (chunk_length). It writes out[b, h, :] when the sequence is one
// chunk (one split, or a sequence of at most chunk_keys keys) unless PARTIALS; otherwise the
// chunk's normalized output and log2-sum-exp into part_o [splits, batch, H, D] / part_lse
// (merge_column of one split gives the bits of the direct write). The caller syncs the block
// before it calls this again (shared memory is reused).
// PARTS > 1: a block of PARTS x THREADS threads runs PARTS items at once; thread tid of part
// `part` (tid = threadIdx.x % THREADS), each part with shared arrays and a named barrier of its
// own. The arithmetic is the same for every PARTS. Q_THROUGH_L2: see load_query.
// PRE_WAIT: the first trip's rows are requested before griddep_wait(), which attend calls
// (programmatic dependent launch: they stream in while the kernel before finishes). Only the
// row the kernel before appended, len - 1, may be new: it is loaded again once the length is
// known. Every other row below the length must have been written before that kernel started
// (the decode step appends one row a step, each in a launch of its own). k_new / v_new
// (PRE_WAIT, caches in q's dtype, or nullptr): that appended row of every (sequence, KV head)
// as the kernel before also wrote it, at k_new + b q_sb + g D: read at once after the wait,
// with q and the length, instead of from the cache once the length is known (one L2 round
// trip less after the wait). H100, the decode step in a CUDA graph with PDL, float16, us a step
// at 64 / 264 / 520 / 900 cached keys, without / with (two rounds of one run,
// benchmarks/results/attention_appended-h100.log): GPT-2 small B = 1 227.2 / 237.5 / 264.8 /
// 296.2 against 225.3 / 234.8 / 260.8 / 294.6, B = 8 243.6 / 272.7 / 318.5 / 366.2 against
// 243.2 / 268.7 / 317.7 / 364.3; GPT-2 XL B = 1 1607.3 / 1637.6 / 1766.1 / 1869.8 against
// 1606.5 / 1624.7 / 1738.6 / 1859.5.
// prefetch (PRE_WAIT, or nullptr): the cache positions of the step (the row this step appends
// for each sequence; only the step's last kernel moves them on). Before the wait, the block's
// threads request its chunk's rows past the first trip and below that row into L2
// (prefetch.global.L2: no registers, no number changes), so that the loop's loads find them
// there. H100, float16, us a sweep of 512 replays from 8 cached keys on one session's buffers
// (benchmarks/results/kv_prefetch-h100.json, kv_prefetch_batches-h100.json, kv_prefetch_sizes-
// h100.json), without / with:
// GPT-2 small B = 2 220.2 / 217.5, B = 4 232.4 / 227.8, B = 8 254.3 / 247.4, B = 16 329.6 /
// 324.0, but B = 1 213.5 / 213.5, B = 32 427.6 / 434.0 and B = 64 615.0 / 643.6; medium B = 2
// 529.3 / 524.6, B = 4 553.1 / 544.0, B = 8 587.5 / 591.0; large B = 2 983.1 / 978.6; XL B = 1
// 1608.9 / 1613.8 and B = 8 1983.7 / 2026.3; GPT-2 small float32 B = 8 1184.6 / 1183.9. The decode
// step takes it where it won (gpt2_cupy/model.py, DECODE_PREFETCH_BATCHES).
// Every chunk's rows requested before the wait, the length taken from the positions (which only
// the step's last kernel advances) instead of seq_lens, did not pay (same bits; branch
// attention-known-lengths, benchmarks/results/attention_known_lengths-h100.log, us a step at 264
// cached keys): GPT-2 small B = 1 239.3 / 240.8 against 233.6 / 231.8, XL 1559.1 / 1562.2
// against 1551.4 / 1556.5; B = 8 won 1-2% past 520 keys only.
template <typename T, typename KT, int D, int QPB, int THREADS, int PARTS = 1, bool Q_THROUGH_L2 = false,
          bool PARTIALS = false, bool PRE_WAIT = false, int AHEAD = 1>
__device__ __forceinline__ void attend(T* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_lse,
                                       const T* __restrict__ q, const KT* __restrict__ k_cache,
                                       const KT* __restrict__ v_cache, const float* __restrict__ k_scale,
                                       const float* __restrict__ v_scale, const int* __restrict__ seq_lens,
                                       const float* __restrict__ alibi, int H, int H_kv, int S_max, long long q_sb,
                                       float scale, int bx, int b, int split, int splits, int batch,
                                       int chunk_keys, int tid = threadIdx.x, int part = 0,
                                       const KT* __restrict__ k_new = nullptr, const KT* __restrict__ v_new = nullptr,
                                       const int* __restrict__ prefetch = nullptr) {
    using Fmt = KvFormat<KT>;
    constexpr int VEC = KvVec<KT>::N;
    constexpr int G = D / VEC;  // lanes per key row
    static_assert(G <= 32 && 32 % G == 0, "a key row must fit in one warp");
    constexpr int GROUPS = THREADS / G, WARPS = THREADS / 32;
    // Rows in flight per group: UNROLL key and value rows per loop trip, and with PIPELINE
    // the next trip's rows requested before this trip's are used (two sets of row
    // registers). Pipelining one query head per block of 128 threads with 16-bit or float32
    // rows, measured on an H100 (fp16, cold L2), cut 32 heads x hd128 at B=1 from 8.91 to
    // 7.79 us at S=128 (one split) and from 878.7 to 584.3 us at S=32768 with one split, and
    // GPT-2 at S=256 from 8.19 to 7.39 us. With grouped heads (QPB > 1: 2 QPB VEC registers
    // of query and output per thread) and 1-byte rows it raised registers to 140-205 and was
    // not faster (32 / 8 heads, S=4096: 18.2 us without, 20.2 with, each at its best split).
    // Blocks of 512 threads already have four times the rows in flight, and were as fast or
    // faster without it (32 x hd128, fp16: B=1 S=128 6.88 -> 6.72 us, S=256 8.03 / 8.05,
    // B=32 S=4096 703.3 -> 696.5, B=128 S=4096 2751.6 -> 2737.4; GPT-2 B=1 S=256 6.30 ->
    // 6.22, S=512 7.26 / 7.36 cold and 4.13 -> 3.96 in a replayed graph). float32 rows
    // keep it (their speed is not measured): without it ptxas spilled 12 bytes for sm_80
    // with 2 heads per block.
    // AHEAD > 1 (PIPELINE, PRE_WAIT, one part): AHEAD sets of row registers besides the first
    // trip's, instead of one. The AHEAD trips past the first are requested at once, and each set
    // is refilled with the trip AHEAD further on once it has been used (AHEAD - 1 trips in flight
    // while one is used; with one set, the next trip is requested before the current is used).
    // The same trips in the same order, so the same bits; a cache of up to AHEAD trips past the
    // first waits for memory about once after the length arrives. Measured for one query head
    // per block of 128 threads on 16-bit rows (H100, the decode step with PDL at 64 / 264 / 520 / 900 cached keys, us;
    // README, "The decode step"): 4 ahead (218 registers against 118) took GPT-2 XL at B = 1
    // from 1564.3 / 1576.4 / 1688.1 / 1813.7 to 1552.8 / 1554.8 / 1605.9 / 1686.3, medium and
    // large won at every length too, but GPT-2 small went from 220.6 / 231.5 / 257.0 / 288.9
    // to 226.0 / 241.3 / 264.3 / 282.4 (even at 64 keys, where it has no more rows in flight)
    // and B = 8 lost on short caches (attention_ahead-h100.log, attention_depth_sizes-h100.log):
    // the decode step picks it per model and batch (gpt2_cupy/model.py, DECODE_AHEAD_WIDTH).
    // UNROLL 8 (other bits; attention_unroll-h100.log) did much the same. Trips in shared memory
    // by cp.async (attention_ring-h100.log) lost everywhere: the kernel asks for a larger split
    // of shared memory than the products.
    constexpr bool PIPELINE = QPB * VEC <= 8 && (THREADS == 128 || sizeof(KT) == 4);
    static_assert(AHEAD == 1 || (PIPELINE && PRE_WAIT && PARTS == 1),
                  "trips ahead beyond one: a pipelined PRE_WAIT kernel of one part");
    constexpr int UNROLL = 4;
    // Grouped heads read rows with the evict-first hint (ld.global.cs): measured on an H100
    // (fp16, 32 / 8 heads x hd128, 4 per block of 512 threads, cold L2) it cut B=1 S=32768
    // from 63.8 to 60.5 us, B=4 S=4096 from 39.6 to 35.3 and B=8 S=4096 from 63.6 to 60.3;
    // with one query head per block it cost 32 x hd128 B=8 S=4096 4% (186.8 -> 195.2 us)
    // and B=1 S=32768 (16 splits) 4% (191.2 -> 198.7). float32 rows keep plain loads: with
    // the hint ptxas spilled 8 bytes for sm_80-89 at hd128 (their speed is not measured).
    constexpr bool STREAMING = QPB > 1 && sizeof(KT) < 4;
    using Rows = Trip<KT, GROUPS, UNROLL, STREAMING>;
    constexpr int TILE = GROUPS * UNROLL;  // keys per loop trip; split chunks are multiples
    __shared__ float s_m_all[PARTS][QPB][WARPS], s_l_all[PARTS][QPB][WARPS];
    __shared__ float s_o_all[PARTS][QPB][WARPS][D];
    auto& s_m = s_m_all[part];
    auto& s_l = s_l_all[part];
    auto& s_o = s_o_all[part];

    const int heads_per_kv = H / H_kv, head_groups = heads_per_kv / QPB;
    const int g = bx / head_groups;                          // KV head
    const int h0 = g * heads_per_kv + (bx % head_groups) * QPB;  // first query head
    const int group = tid / G, sub = tid % G;
    const long long row0 = (static_cast<long long>(b) * H_kv + g) * S_max;  // cache row of position 0
    const KT* kc = k_cache + row0 * D + sub * VEC;
    const KT* vc = v_cache + row0 * D + sub * VEC;

    const float* ks = Fmt::QUANTIZED ? k_scale + row0 : nullptr;
    const float* vs = Fmt::QUANTIZED ? v_scale + row0 : nullptr;
    // The first chunk starts at row 0 whatever the length: its first trip's rows (inside
    // the cache's S_max rows) are requested before the length arrives, which takes one
    // memory latency off a short cache's critical path. Rows past the length are zeroed
    // once it is known. The load is predicated, not branched over (other splits request no
    // rows here): behind a branch the compiler hoisted the length's load and its use above
    // it, so the rows were requested only once the length had arrived. Measured on an H100
    // (fp16, cold L2) together with exp2_approx for exp2f: GPT-2 B=1 S=128 6.02 -> 5.70 us,
    // S=512 7.62 -> 7.20, 32 x hd128 S=128 6.98 -> 6.65; in a replayed graph GPT-2 S=128
    // 2.93 -> 2.75, S=256 3.28 -> 3.09.
    Rows cur, next;
    const bool early = split == 0;
    cur.load(kc, vc, ks, vs, D, group, 0, early ? min(TILE, S_max) : 0);
    KvVec<KT> k_fresh, v_fresh;  // k_new / v_new: this lane's slice of the appended row
    const bool fresh = PRE_WAIT && k_new != nullptr && early;
    if constexpr (PRE_WAIT) {
        if (prefetch != nullptr) {  // rows [first, last): written in earlier steps, so readable before the wait
            const int len_now = prefetch[b] + 1, chunk_now = chunk_length(len_now, splits, chunk_keys, TILE);
            const int first = split * chunk_now + (early ? TILE : 0);
            const int last = min(min(len_now - 1, (split + 1) * chunk_now), S_max);
            constexpr int ROW_BYTES = D * static_cast<int>(sizeof(KT)), LINES = (ROW_BYTES + 127) / 128;
            const char* kb = reinterpret_cast<const char*>(k_cache + row0 * D);
            const char* vb = reinterpret_cast<const char*>(v_cache + row0 * D);
            for (int i = tid; i < (last - first) * LINES; i += THREADS) {  // a 128-byte line each
                const long long at = static_cast<long long>(first + i / LINES) * ROW_BYTES + (i % LINES) * 128;
                asm volatile("prefetch.global.L2 [%0];" ::"l"(kb + at));
                asm volatile("prefetch.global.L2 [%0];" ::"l"(vb + at));
            }
        }
        griddep_wait();  // q, seq_lens and the appended row: the previous kernel's work
        // The next kernel may start now: its weights stream in during the attention. They slow
        // the attention's row loads (the attention projection's blocks held back until the
        // attention's blocks end: its loop over 264 keys 2.4 against 4.5 us, GPT-2 small
        // float16 at B = 1, in a timeline of every block; branch step-timeline), but letting
        // the next kernel go only once every row is here lost (H100, the step with PDL at
        // 64 / 264 / 520 / 900 cached keys, us, two rounds of one run, benchmarks/results/
        // attention_trigger-h100.log): GPT-2 small B = 1 226.3 / 237.1 / 261.0 / 292.8
        // against 228.4 / 243.4 / 269.2 / 297.5, XL 1581.1 / 1601.2 / 1711.0 / 1830.2 against
        // 1628.8 / 1701.4 / 1733.2 / 1819.3, XL B = 8 1955.7 against 2098.0 at 264 (it won
        // only on long caches at B = 8: GPT-2 small 355.2 against 368.1 us at 900 keys). Letting
        // it go at the attention's start, as the products do, won on one-trip and two-chunk
        // caches and lost between (attention_trigger_start-h100.log, same keys, us: GPT-2 small
        // B = 1 215.2 / 229.8 / 257.3 / 285.3 against 221.3 / 232.8 / 257.9 / 292.3, B = 8 281.7
        // against 267.1 at 264; XL B = 1 1553.6 / 1615.0 / 1722.2 / 1805.0 against 1565.2 /
        // 1579.1 / 1689.5 / 1816.1). Letting it go once the second trip's rows are requested, on
        // caches of more than two trips (the length from the positions, read before the wait),
        // sped up replayed steps of GPT-2 small at B = 1 by 3.3-3.5% at 264 and 520 cached keys but
        // not a 512-token call (branch attention-late-trigger; README, "The decode step").
        griddep_launch_dependents();
        if (fresh) {
            k_fresh.load_l2(k_new + b * q_sb + g * D + sub * VEC);
            v_fresh.load_l2(v_new + b * q_sb + g * D + sub * VEC);
        }
    }

    // q before the length: neither waits for the other
    float qv[QPB][VEC], slope[QPB], m[QPB], l[QPB], acc[QPB][VEC];
#pragma unroll
    for (int j = 0; j < QPB; ++j) {
        load_query<T, VEC, Q_THROUGH_L2>(q + b * q_sb + (h0 + j) * D + sub * VEC, scale * LOG2E, qv[j]);
        slope[j] = alibi != nullptr ? alibi[h0 + j] * LOG2E : 0.0f;
        m[j] = -INFINITY;
        l[j] = 0.0f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[j][i] = 0.0f;
    }
    const int len = seq_lens[b];  // (written once a step, before any block of the step reads it)
    const int chunk = chunk_length(len, splits, chunk_keys, TILE);
    const int s_begin = split * chunk, s_end = min(len, s_begin + chunk);
    // the sequence is this one chunk: its output goes straight to out
    const bool one_chunk = !PARTIALS && (splits == 1 || (chunk_keys > 0 && s_begin == 0 && s_end == len));
    if (!PARTIALS && chunk_keys > 0 && split > 0 && s_begin >= len) return;  // past the last key: nothing to do

    // One loop trip over the rows of t: scores, online softmax, O += P V.
    auto use_trip = [&](const Rows& t, int base) {
        float dot[QPB][UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float kf[VEC];
            t.k[u].unpack(kf);
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
                dot[j][u] = s < s_end ? fmaf(slope[j], static_cast<float>(s - len + 1), dot[j][u] * t.k_scale[u]) : -INFINITY;
                tile_max = fmaxf(tile_max, dot[j][u]);
            }
            const float m_new = fmaxf(m[j], tile_max);
            const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // nothing seen yet: keep exp2 finite
            const float alpha = exp2_approx(m[j] - m_use);
            l[j] *= alpha;
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[j][i] *= alpha;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                p[j][u] = exp2_approx(dot[j][u] - m_use);
                l[j] += p[j][u];
                p[j][u] *= t.v_scale[u];
            }
            m[j] = m_new;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            float vf[VEC];
            t.v[u].unpack(vf);
#pragma unroll
            for (int j = 0; j < QPB; ++j) {
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[j][i] = fmaf(p[j][u], vf[i], acc[j][i]);
            }
        }
    };
    // The trip count is uniform across the block, so every lane reaches the shuffles.
    // With PIPELINE, trip i + 1's rows are requested before trip i is used (two sets of
    // row registers), so a block streams instead of waiting for memory once per trip.
    int base = s_begin;
    if (early) {  // the first trip's rows are here
        if constexpr (PRE_WAIT) {
            if (len - 1 < min(TILE, S_max)) {
                if (fresh) {
                    cur.put(k_fresh, v_fresh, group, len - 1);
                } else {
                    cur.reload(kc, vc, ks, vs, D, group, len - 1);
                }
            }
        }
        cur.mask(group, s_end);
    } else if (base < s_end) {
        cur.load(kc, vc, ks, vs, D, group, base, s_end);
    }
    if constexpr (AHEAD > 1) {
        Rows ahead[AHEAD];  // trips base + TILE, base + 2 TILE, ...: ahead[i] holds every AHEAD-th
#pragma unroll
        for (int i = 0; i < AHEAD; ++i) {
            if (base + (i + 1) * TILE < s_end) ahead[i].load(kc, vc, ks, vs, D, group, base + (i + 1) * TILE, s_end);
        }
        if (base < s_end) use_trip(cur, base);
        base += TILE;
        while (base < s_end) {
#pragma unroll
            for (int i = 0; i < AHEAD; ++i) {
                if (base < s_end) {
                    use_trip(ahead[i], base);
                    const int next_base = base + AHEAD * TILE;  // the trip this set holds next
                    if (next_base < s_end) ahead[i].load(kc, vc, ks, vs, D, group, next_base, s_end);
                    base += TILE;
                }
            }
        }
    } else if constexpr (PIPELINE) {
        while (base < s_end) {
            if (base + TILE < s_end) next.load(kc, vc, ks, vs, D, group, base + TILE, s_end);
            use_trip(cur, base);
            base += TILE;
            if (base >= s_end) break;
            if (base + TILE < s_end) cur.load(kc, vc, ks, vs, D, group, base + TILE, s_end);
            use_trip(next, base);
            base += TILE;
        }
    } else {
        if (base < s_end) {
            use_trip(cur, base);
            base += TILE;
        }
        for (; base < s_end; base += TILE) {
            cur.load(kc, vc, ks, vs, D, group, base, s_end);
            use_trip(cur, base);
        }
    }

    // The groups of a warp combine their (m, l, acc) by xor-shuffles over the lane bits
    // above the group's own, then the warps theirs through shared memory.
#pragma unroll
    for (int off = G; off < 32; off <<= 1) {
#pragma unroll
        for (int j = 0; j < QPB; ++j) {
            const float m_o = __shfl_xor_sync(FULL_MASK, m[j], off), l_o = __shfl_xor_sync(FULL_MASK, l[j], off);
            const float mx = fmaxf(m[j], m_o), m_use = mx == -INFINITY ? 0.0f : mx;
            const float a = exp2_approx(m[j] - m_use), c = exp2_approx(m_o - m_use);
            l[j] = l[j] * a + l_o * c;
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[j][i] = acc[j][i] * a + __shfl_xor_sync(FULL_MASK, acc[j][i], off) * c;
            m[j] = mx;
        }
    }
    const int warp = tid / 32;
    if (tid % 32 < G) {
#pragma unroll
        for (int j = 0; j < QPB; ++j) {
            if (sub == 0) {
                s_m[j][warp] = m[j];
                s_l[j][warp] = l[j];
            }
#pragma unroll
            for (int i = 0; i < VEC; ++i) s_o[j][warp][sub * VEC + i] = acc[j][i];
        }
    }
    if constexpr (PARTS == 1) {
        __syncthreads();
    } else {  // this part's threads only: named barrier 1 + part (barrier.sync: warps may arrive diverged)
        asm volatile("barrier.sync %0, %1;\n" ::"r"(1 + part), "n"(THREADS) : "memory");
    }

    for (int e = tid; e < QPB * D; e += THREADS) {
        const int j = e / D, d = e % D;
        float mx = -INFINITY;
#pragma unroll
        for (int k = 0; k < WARPS; ++k) mx = fmaxf(mx, s_m[j][k]);
        float sum = 0.0f, o = 0.0f;
        if (mx != -INFINITY) {
#pragma unroll
            for (int k = 0; k < WARPS; ++k) {
                const float w = exp2_approx(s_m[j][k] - mx);
                sum += s_l[j][k] * w;
                o += s_o[j][k][d] * w;
            }
        }
        const long long row = static_cast<long long>(b) * H + h0 + j;  // (b, h)
        const float o_norm = sum > 0.0f ? o / sum : 0.0f;
        if (one_chunk) {
            out[row * D + d] = from_float<T>(o_norm);
        } else {
            const long long part = static_cast<long long>(split) * batch * H + row;
            part_o[part * D + d] = o_norm;
            if (d == 0) part_lse[part] = sum > 0.0f ? mx + __log2f(sum) : -INFINITY;
        }
    }
}

// Keys per loop trip of attend (split chunks are multiples of it).
template <typename KT, int D, int THREADS> constexpr int attention_tile() {
    return THREADS / (D / KvVec<KT>::N) * 4;
}

}  // namespace g2c
