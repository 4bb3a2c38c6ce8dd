// read_floor.cu - the time floor of a memory-bound kernel: read two buffers once, compute
// nothing. Benchmarks time it on the bytes an operation must read (decode attention: its K
// and V rows) to show how much of an implementation's time the reading alone takes.
//
//   out[block] = XOR of the 32-bit words this block read (so that no load can be dropped,
//   and a test can check that every word was read exactly once)
//
// Mapping: a grid-stride loop over the 16-byte words of a then b (one index space), four
// independent loads in flight per thread before any is used; the block folds its words
// with xor-shuffles and shared memory. Bytes: 16 (n_a + n_b) read; no FLOPs.
//
// read_under_load_kernel<IN_FLIGHT>: what one dependent load waits while the others stream. Blocks
// 0 .. gridDim.x - 2 read `a` as above with IN_FLIGHT loads in flight a thread (blocks x threads x
// IN_FLIGHT x 16 bytes requested at once); the last block's thread 0 waits `delay` ns (the stream at
// its pace), then follows `chase` (i = chase[i], ld.global.cg: through L2) `hops` times and
// writes the mean ns a hop and the index it ended on into lat[0], lat[1].
// Specializations: read_floor_kernel; read_under_load_kernel<4>, <8>.
// Wrapper: cupy_kernels/read_floor.py   Test: tests/test_kernels_gpu.py
// Benchmarks: benchmarks/decode_attention.py, benchmarks/memory_queue.py
#include "common.cuh"

using namespace g2c;

namespace {
constexpr int LOADS = 4;  // 16-byte loads in flight per thread

__device__ __forceinline__ unsigned fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

__device__ __forceinline__ uint4 word(const uint4* __restrict__ a, long long n_a, const uint4* __restrict__ b,
                                      long long i) {
    return i < n_a ? a[i] : b[i - n_a];
}

// The XOR of the 32-bit words of words [0, n) of a then b (one index space, n_a of them in a;
// B_TOO false: all n in a) that this thread reads in a grid-stride loop over `blocks` blocks,
// IN_FLIGHT independent loads in flight before any is used. (Without B_TOO's select, ptxas
// keeps IN_FLIGHT = 8 in registers on sm_90: with it, it spilled 4 bytes.)
template <int IN_FLIGHT, bool B_TOO>
__device__ __forceinline__ unsigned stream_xor(const uint4* __restrict__ a, long long n_a,
                                               const uint4* __restrict__ b, long long n, int blocks) {
    const long long stride = static_cast<long long>(blocks) * blockDim.x;
    long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    unsigned acc = 0;
    for (; i + (IN_FLIGHT - 1) * stride < n; i += IN_FLIGHT * stride) {
        uint4 v[IN_FLIGHT];
#pragma unroll
        for (int u = 0; u < IN_FLIGHT; ++u) v[u] = B_TOO ? word(a, n_a, b, i + u * stride) : a[i + u * stride];
#pragma unroll
        for (int u = 0; u < IN_FLIGHT; ++u) acc ^= fold(v[u]);
    }
    for (; i < n; i += stride) acc ^= fold(B_TOO ? word(a, n_a, b, i) : a[i]);
    return acc;
}

// The block's XOR of acc into out[blockIdx.x] (blockDim.x a multiple of 32).
__device__ __forceinline__ void block_xor(unsigned acc, unsigned* __restrict__ out) {
    __shared__ unsigned s_warp[32];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc ^= __shfl_xor_sync(FULL_MASK, acc, off);
    if (threadIdx.x % 32 == 0) s_warp[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned total = 0;
        for (int w = 0; w < static_cast<int>(blockDim.x) / 32; ++w) total ^= s_warp[w];
        out[blockIdx.x] = total;
    }
}
}  // namespace

__global__ void __launch_bounds__(1024)
    read_floor_kernel(unsigned* __restrict__ out, const uint4* __restrict__ a, long long n_a,
                      const uint4* __restrict__ b, long long n_b) {
    block_xor(stream_xor<LOADS, true>(a, n_a, b, n_a + n_b, gridDim.x), out);
}

template <int IN_FLIGHT>
__global__ void __launch_bounds__(1024)
    read_under_load_kernel(unsigned* __restrict__ out, const uint4* __restrict__ a, long long n,
                           const unsigned* __restrict__ chase, int hops, long long delay,
                           unsigned long long* __restrict__ lat) {
    const int streams = gridDim.x - 1;
    if (static_cast<int>(blockIdx.x) == streams) {  // the probe
        if (threadIdx.x == 0) {
            const unsigned long long t0 = global_ns();
            while (global_ns() - t0 < static_cast<unsigned long long>(delay)) {}
            unsigned j = 0;
            const unsigned long long t1 = global_ns();
            for (int h = 0; h < hops; ++h) j = __ldcg(chase + j);
            const unsigned long long t2 = global_ns();
            lat[0] = hops > 0 ? (t2 - t1) / hops : 0;
            lat[1] = j;
        }
        return;
    }
    block_xor(stream_xor<IN_FLIGHT, false>(a, n, a, n, streams), out);
}
