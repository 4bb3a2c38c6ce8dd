// softmax.cu - row softmax with a scale and an optional causal mask.
//
//   out[r, c] = exp(scale x[r, c] - max) / sum,  over the visible columns c of row r
//
// Causal: row r is query q = r mod q_len of a [q_len, cols] score matrix, aligned
// bottom-right: it sees columns c <= q + (cols - q_len); hidden columns are written as 0,
// and a row with no visible column is all 0.
// One block per row, sized by the wrapper so that each thread owns about U = 4 16-byte
// vectors, all loaded before the first is used. One read of the row from memory: the row
// stays on chip (row.cuh), in registers when it fits in blockDim * U vectors, else in
// shared memory (the vocabulary-wide rows): scaled values, the block's max, exp2(x - max)
// in place with the block's sum (one exponential per element), then the output.
// Any length: aligned middle as vectors, head and tail as scalars.
// Bytes: 1 read + 1 write of the row.
//
// Specializations: T in {float, __half, __nv_bfloat16} x VEC in {1, 16/sizeof(T)} x IN_REGS,
// U = 4 (benchmarks/row_tuning.py measures the alternatives).
// Wrapper: cupy_kernels/softmax.py   Tests: tests/test_kernels_gpu.py
#include "row.cuh"

using namespace g2c;

// U: vectors per thread, loaded together (the wrapper sizes blocks for it).
template <typename T, int VEC, bool IN_REGS, int U>
__global__ void __launch_bounds__(IN_REGS ? 1024 : 512)  // a shared-memory row loops: 512 threads do
    softmax_kernel(T* __restrict__ out, const T* __restrict__ x, int cols, int q_len, int causal, float scale) {
    extern __shared__ float smem[];  // cols + 3 floats unless IN_REGS
    __shared__ float scratch[32];
    const long long offset = static_cast<long long>(blockIdx.x) * cols;
    x += offset;
    out += offset;
    int visible = cols;
    if (causal) visible = min(cols, max(0, static_cast<int>(blockIdx.x % q_len) + cols - q_len + 1));
    const float s2 = scale * LOG2E;  // work in the log2 domain: exp(a) = exp2(a log2 e)
    Row<T, VEC, U, IN_REGS> row(smem);

    float mx = -INFINITY;
    row.fill(x, nullptr, visible, [&](auto& a, auto&, int) {
        constexpr int N = sizeof(a) / sizeof(float);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            a[k] *= s2;
            mx = fmaxf(mx, a[k]);
        }
    });
    mx = block_max(mx, scratch);
    float sum = 0.0f;
    row.update([&](auto& a, int) {
        constexpr int N = sizeof(a) / sizeof(float);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            a[k] = exp2f(a[k] - mx);  // one exponential per element
            sum += a[k];
        }
    });
    const float inv = 1.0f / block_sum(sum, scratch);  // sum >= 1 when a column is visible

    row.write(out, [&](auto& a, int, auto& o) {
        constexpr int N = sizeof(a) / sizeof(float);
#pragma unroll
        for (int k = 0; k < N; ++k) o[k] = a[k] * inv;
    });
    for (int i = visible + threadIdx.x; i < cols; i += blockDim.x) out[i] = from_float<T>(0.0f);  // masked
}
