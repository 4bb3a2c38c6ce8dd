// l2_prefetch.cu - requests byte ranges of global memory into L2, and returns at once: the
// decode step's weights a product or two ahead, issued from a branch of the step's CUDA graph
// beside the chain of kernels, so that DRAM streams weights while that chain waits on its
// own latencies (attention, kernel boundaries) and the products find them in L2.
//
//   for each piece i < n: the bytes [pieces[2i], pieces[2i] + pieces[2i + 1]) into L2
//
// Mapping: a warp a piece (the wrapper cuts ranges into pieces of at most 64 KiB, 16-byte
// aligned, whole 16-byte words). On sm_90 lane 0 hands its piece to the copy engine in one
// bulk prefetch (cp.async.bulk.prefetch.L2); before sm_90 the lanes request its 128-byte
// lines (prefetch.global.L2). Nothing is read into registers or written, nothing waits:
// the kernel ends while the data is on its way. Bytes: the pieces' from DRAM into L2.
// Specialization: one (no template). Wrapper: cupy_kernels/l2_prefetch.py
// Test: tests/test_kernels_gpu.py   Benchmark: benchmarks/decode_step.py (the step with and
// without it); its use: gpt2_cupy/engine.py (Session.capture).
#include "common.cuh"

using namespace g2c;

__global__ void __launch_bounds__(128)
    l2_prefetch_kernel(const long long* __restrict__ pieces, int n) {
    const int piece = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (piece >= n) return;
    const char* p = reinterpret_cast<const char*>(pieces[2 * piece]);
    const long long bytes = pieces[2 * piece + 1];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (lane == 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(static_cast<unsigned>(bytes))
                     : "memory");
#else
    const char* line = reinterpret_cast<const char*>(reinterpret_cast<size_t>(p) & ~size_t{127});  // the first line's start
    for (const char* q = line + 128 * lane; q < p + bytes; q += 128 * 32)
        asm volatile("prefetch.global.L2 [%0];\n" ::"l"(q) : "memory");
#endif
}
