// softmax.cu - row softmax with a scale and an optional causal mask.
//
//   out[r, c] = exp(scale x[r, c] - max) / sum,  over the visible columns c of row r
//
// Causal: row r is query q = r mod q_len of a [q_len, cols] score matrix, aligned
// bottom-right: it sees columns c <= q + (cols - q_len); hidden columns are written as 0,
// and a row with no visible column is all 0.
// One block per row, sized by the wrapper so that each thread has about U 16-byte vectors
// in flight. One read of the row from memory: the scaled values go to shared memory (as
// float32), then the block's max, then exp2(x - max) in place and the block's sum (one
// exponential per element), then the output is written from shared memory. Any length: aligned middle as vectors, head and tail as
// scalars (common.cuh). Bytes: 1 read + 1 write of the row.
//
// Specializations: T in {float, __half, __nv_bfloat16} x VEC in {1, 16/sizeof(T)}.
// Wrapper: cupy_kernels/softmax.py   Tests: tests/test_kernels_gpu.py
#include "common.cuh"

using namespace g2c;

namespace {
constexpr int U = 4;  // vectors in flight per thread (the wrapper sizes blocks for it)
}

template <typename T, int VEC>
__global__ void __launch_bounds__(1024)
    softmax_kernel(T* __restrict__ out, const T* __restrict__ x, int cols, int q_len, int causal, float scale) {
    extern __shared__ float smem[];  // cols + 3 floats
    __shared__ float scratch[32];
    const long long offset = static_cast<long long>(blockIdx.x) * cols;
    x += offset;
    out += offset;
    int visible = cols;
    if (causal) visible = min(cols, max(0, static_cast<int>(blockIdx.x % q_len) + cols - q_len + 1));
    const float s2 = scale * LOG2E;  // work in the log2 domain: exp(a) = exp2(a log2 e)
    SmemRow row(smem, split_row<T, VEC>(x, cols).head);

    float mx = -INFINITY;
    for_each_in_rows<T, VEC, U>(x, nullptr, visible, [&](auto& v, auto&, int i0) {
        constexpr int N = sizeof(v) / sizeof(float);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            v[k] *= s2;
            mx = fmaxf(mx, v[k]);
        }
        row.put(i0, v);
    });
    mx = block_max(mx, scratch);  // its barrier also publishes the row
    float sum = 0.0f;
    for (int i = threadIdx.x; i < visible; i += blockDim.x) {
        const float e = exp2f(row[i] - mx);  // one exponential per element
        row[i] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;

    write_row<T, VEC>(out, cols, [&](int i0, auto& v) {
        constexpr int N = sizeof(v) / sizeof(float);
        row.get(i0, v);
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = i0 + k < visible ? v[k] * inv : 0.0f;
    });
}
