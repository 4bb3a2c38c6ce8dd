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
// Specialization: one (no template). Wrapper: cupy_kernels/read_floor.py
// Test: tests/test_kernels_gpu.py   Benchmark: benchmarks/decode_attention.py
#include "common.cuh"

using namespace g2c;

namespace {
constexpr int LOADS = 4;  // 16-byte loads in flight per thread

__device__ __forceinline__ unsigned fold(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

__device__ __forceinline__ uint4 word(const uint4* __restrict__ a, long long n_a, const uint4* __restrict__ b,
                                      long long i) {
    return i < n_a ? a[i] : b[i - n_a];
}
}  // namespace

__global__ void __launch_bounds__(1024)
    read_floor_kernel(unsigned* __restrict__ out, const uint4* __restrict__ a, long long n_a,
                      const uint4* __restrict__ b, long long n_b) {
    __shared__ unsigned s_warp[32];
    const long long n = n_a + n_b, stride = static_cast<long long>(gridDim.x) * blockDim.x;
    long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    unsigned acc = 0;
    for (; i + (LOADS - 1) * stride < n; i += LOADS * stride) {
        uint4 v[LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; ++u) v[u] = word(a, n_a, b, i + u * stride);
#pragma unroll
        for (int u = 0; u < LOADS; ++u) acc ^= fold(v[u]);
    }
    for (; i < n; i += stride) acc ^= fold(word(a, n_a, b, i));
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
