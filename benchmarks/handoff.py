"""What handing a row from one phase of work to the next costs, idle and under a memory load:
a kernel boundary (the decode step's way) against a thread block cluster's barrier, with the
row passed through distributed shared memory instead of L2.

    python -m benchmarks.handoff

``row``: 63 dependent kernels of one 256-thread block an SM in a CUDA graph with programmatic
dependent launch (benchmarks/decode_step.py's ``--chain`` row kernel: every block reads the
row of 768 floats the kernel before wrote, through L2, folds it and writes its slice of the
next). ``cluster``: one launch of clusters of 8 such blocks (16 clusters), each cluster making
the same 63 hand-offs as phases: a block keeps its slice of the row in shared memory, reads
the other seven slices from their blocks' shared memory (``mapa``, ``ld.shared::cluster``)
and meets them at a cluster barrier between phases. ``loaded``: the same while another
stream runs a kernel that streams a 1 GiB buffer from DRAM with 16 16-byte loads in flight a
thread (one 256-thread block an SM), as the decode step's products keep the memory busy with
weights requested ahead. ``empty`` and ``cluster_barrier``: the boundaries and the barriers
alone, with no row. ``flag``: the ``row`` kernels, still launched early by programmatic launch,
each waiting for an arrival counter of the kernel before it (one thread's ld.acquire.gpu poll,
then the block barrier; red.release.gpu after its slice is written) instead of for that
kernel's end: what a hand-off from block to block costs without the kernel boundary's wait
(checked to give the ``row`` chain's bits). ``row_25`` and ``flag_25``: the same in grids of
25 blocks, as many as GPT-2 XL's attention has at batch 1. Time a hand-off = the graph's
replay / 63. Writes benchmarks/results/handoff-<device>.json.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from benchmarks.common import banner, write_results
from benchmarks.decode_step import _CHAIN_SRC
from cupy_kernels import _build

PHASES = 63
C = 768
CLUSTER = 8
HOG_LOADS = 16

_SRC = _CHAIN_SRC + r"""
#define CLUSTER 8
#define C_MAX 1024

__device__ __forceinline__ float load_cluster(const float* p, unsigned rank) {
    unsigned local = static_cast<unsigned>(__cvta_generic_to_shared(p)), remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
    float v;  // (ordered by the cluster barriers; no memory clobber, so that a thread's loads overlap)
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote));
    return v;
}

__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// phases hand-offs of a row of C floats (C a multiple of CLUSTER, at most C_MAX) inside each
// cluster: block `rank` owns slice rank of the row in shared memory (two buffers, one a phase)
extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1)
    chain_cluster_kernel(float* __restrict__ out, const float* __restrict__ in, int C, int phases, int hand_off) {
    __shared__ float slice[2][C_MAX / CLUSTER];
    __shared__ float part[32];
    unsigned rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    const int per = C / CLUSTER;
    for (int i = threadIdx.x; i < per; i += blockDim.x) slice[0][i] = in[rank * per + i];
    cluster_sync();
    for (int p = 0; p < phases; ++p) {
        if (!hand_off) {  // the barrier alone
            cluster_sync();
            continue;
        }
        const float* src = slice[p % 2];
        float* dst = slice[(p + 1) % 2];
        float v = 0.f, got[C_MAX / 256];  // every load requested before any is used (blocks of 256)
#pragma unroll
        for (int k = 0; k < C_MAX / 256; ++k) {
            const int i = threadIdx.x + k * 256;
            got[k] = i < C ? load_cluster(src + i % per, i / per) : 0.f;
        }
#pragma unroll
        for (int k = 0; k < C_MAX / 256; ++k) v += got[k];
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
        __syncthreads();
        float total = 0.f;
        for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) total += part[w];
        for (int i = threadIdx.x; i < per; i += blockDim.x) dst[i] = src[i] + 1e-6f * total;
        __syncthreads();  // part is rewritten next phase
        cluster_sync();   // every block's dst written, every block done reading src
    }
    if (blockIdx.x < CLUSTER)  // the first cluster writes the row
        for (int i = threadIdx.x; i < per; i += blockDim.x) out[rank * per + i] = slice[phases % 2][i];
}

// The row hand-off of chain_row_kernel with the kernel boundary's wait replaced by an arrival
// counter: kernel i of the chain (launched early by programmatic launch, as every kernel is)
// polls counters[i - 1] until every block of kernel i - 1 has arrived (ld.acquire.gpu by one
// thread, then the block barrier), hands the row on (through L2) and arrives on counters[i]
// (red.release.gpu by one thread after the block barrier). Kernel i's first block sets
// counters[i - 2] back to zero once counters[i - 1] is full (every block of kernel i - 1 has
// read it by then); the first kernel of a replay, after griddepcontrol.wait (the graph's
// boundary), sets the last two back.
extern "C" __global__ void chain_flag_kernel(float* __restrict__ out, const float* __restrict__ in, int C,
                                             unsigned* counters, int i, int phases) {
    __shared__ float part[32];
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    if (i == 0) {
        asm volatile("griddepcontrol.wait;\n" ::: "memory");
        if (blockIdx.x == 0 && threadIdx.x == 0) counters[phases - 2] = counters[phases - 1] = 0;
    } else if (threadIdx.x == 0) {
        unsigned seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(counters + i - 1) : "memory");
        } while (seen < gridDim.x);
        if (blockIdx.x == 0 && i >= 2) counters[i - 2] = 0;
    }
    __syncthreads();
    hand_off<true>(out, in, C, part);
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(counters + i) : "memory");
}

// Streams words [0, words) of buf `rounds` times, HOG_LOADS 16-byte loads in flight a thread.
extern "C" __global__ void hog_kernel(const uint4* __restrict__ buf, long long words, int rounds,
                                      unsigned* __restrict__ sink) {
    constexpr int LOADS = 16;
    unsigned acc = 0;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (int r = 0; r < rounds; ++r) {
        for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < words;
             i += LOADS * stride) {
            uint4 v[LOADS];
#pragma unroll
            for (int u = 0; u < LOADS; ++u) v[u] = __ldcs(buf + min(i + u * stride, words - 1));
#pragma unroll
            for (int u = 0; u < LOADS; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;  // (keeps the loads)
}
"""


def main():
    print(banner(), flush=True)
    mod = cp.RawModule(code=_SRC, options=("-std=c++17",))
    row, cluster, hog, empty, flag = (mod.get_function(n) for n in ("chain_row_kernel", "chain_cluster_kernel",
                                                                    "hog_kernel", "chain_empty_kernel",
                                                                    "chain_flag_kernel"))
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    bufs = [cp.random.standard_normal(C, dtype=cp.float32) for _ in range(2)]
    out = cp.empty(C, dtype=cp.float32)
    counters = cp.zeros(PHASES, dtype=cp.uint32)
    plans = {
        "row": _build.Plan(_build.Launch(row, (sms,), (256,), (bufs[(i + 1) % 2], bufs[i % 2], np.int32(C)), 0, True)
                           for i in range(PHASES)),
        "cluster": _build.Plan([_build.Launch(cluster, (16 * CLUSTER,), (256,),
                                              (out, bufs[0], np.int32(C), np.int32(PHASES), np.int32(1)), 0, False)]),
        "flag": _build.Plan(_build.Launch(flag, (sms,), (256,), (bufs[(i + 1) % 2], bufs[i % 2], np.int32(C), counters,
                                                                np.int32(i), np.int32(PHASES)), 0, True)
                            for i in range(PHASES)),
        "row_25": _build.Plan(_build.Launch(row, (25,), (256,), (bufs[(i + 1) % 2], bufs[i % 2], np.int32(C)), 0, True)
                              for i in range(PHASES)),
        "flag_25": _build.Plan(_build.Launch(flag, (25,), (256,), (bufs[(i + 1) % 2], bufs[i % 2], np.int32(C),
                                                                   counters, np.int32(i), np.int32(PHASES)), 0, True)
                               for i in range(PHASES)),
        "empty": _build.Plan(_build.Launch(empty, (sms,), (256,), (), 0, True) for _ in range(PHASES)),
        "cluster_barrier": _build.Plan([_build.Launch(cluster, (16 * CLUSTER,), (256,),
                                                      (out, bufs[0], np.int32(C), np.int32(PHASES), np.int32(0)), 0,
                                                      False)]),
    }
    hog_buf = cp.ones((1 << 30) // 4, dtype=cp.uint32)  # 1 GiB
    words = hog_buf.size // 4
    sink = cp.zeros(1, dtype=cp.uint32)
    main_stream, hog_stream = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    start_row = bufs[0].copy()
    ends = {}
    for name in ("row", "flag", "row_25", "flag_25"):  # the same arithmetic: the same row after a replay
        with main_stream:
            bufs[0][:] = start_row
            plans[name].replay(pdl=True)
        main_stream.synchronize()
        ends[name] = bufs[PHASES % 2].copy()
    same = bool((ends["row"] == ends["flag"]).all()) and bool((ends["row_25"] == ends["flag_25"]).all())
    print(f"flag hand-offs give the row kernels' bits: {same}", flush=True)
    graphs = {}
    for name, plan in plans.items():
        with main_stream:
            plan.replay()
        main_stream.synchronize()
        graphs[name] = _build.capture(main_stream, plan, pdl=True)

    def hog_us(rounds: int) -> float:
        with hog_stream:
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(hog_stream)
            hog((sms,), (256,), (hog_buf, np.int64(words), np.int32(rounds), sink))
            stop.record(hog_stream)
            stop.synchronize()
        return cp.cuda.get_elapsed_time(start, stop) * 1e3

    one = hog_us(1)
    gbps = (1 << 30) / one / 1e3
    print(f"hog alone: {one:.1f} us a pass over 1 GiB ({gbps:.0f} GB/s)", flush=True)
    rows = [{"bench": "handoff", "impl": "flag_check", "same_bits_as_row": same},
            {"bench": "handoff", "impl": "hog", "us_per_pass": round(one, 1), "GBps": round(gbps, 1),
             "loads_in_flight": HOG_LOADS, "blocks": sms, "threads": 256}]
    reps = 5
    for name, graph in graphs.items():
        for loaded in (False, True):
            times = []
            for _ in range(3):
                main_stream.synchronize()
                if loaded:  # long enough to cover the replays below
                    with hog_stream:
                        hog((sms,), (256,), (hog_buf, np.int64(words), np.int32(12), sink))
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                start.record(main_stream)
                for _ in range(reps):
                    graph.launch(main_stream)
                stop.record(main_stream)
                stop.synchronize()
                times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / reps)
                hog_stream.synchronize()
            us = float(np.median(times))
            rows.append({"bench": "handoff", "impl": name, "loaded": loaded, "phases": PHASES, "C": C,
                         "us": round(us, 2), "us_per_handoff": round(us / PHASES, 3),
                         "blocks": 16 * CLUSTER if name.startswith("cluster") else 25 if name.endswith("_25") else sms,
                         "cluster": CLUSTER if name.startswith("cluster") else 1})
            print(f"{name:8s} {'loaded' if loaded else 'idle  '}: {us:8.2f} us, {us / PHASES:.3f} us a hand-off",
                  flush=True)
    print(f"wrote {write_results('handoff', rows, {})}")


if __name__ == "__main__":
    main()
