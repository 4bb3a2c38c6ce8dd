// layernorm.cu - LayerNorm over the last axis, optionally fused with the residual add.
//
//   plain:     out = (x - mean(x)) / sqrt(var(x) + eps) * w + b
//   residual:  s = x + y (+ bias);  sum_out = s;  out = layernorm(s)
//              (the GPT-2 block: residual stream + projection output + projection bias)
//
// One block per row, its size chosen by the wrapper so that each thread has about U
// 16-byte vectors of the row: all U loads are issued before the first is used (enough
// bytes in flight to cover memory latency). The row is kept in shared memory as float32
// (float4 accesses, conflict-free); mean and variance come from two block reductions over
// that copy (two-pass variance: no cancellation), then the output is written from it.
// Any length: the row's aligned middle moves as vectors, its unaligned head and tail as
// scalars (common.cuh).
// Bytes: read C (x2 for residual) + w + b, write C (x2 for residual) per row; FLOPs
// negligible -> bandwidth bound. In the residual form the sum is rounded to T before it
// is normalized, as a framework that stores the residual stream in T would do.
//
// Specializations: T in {float, __half, __nv_bfloat16} x VEC in {1, 16/sizeof(T)} x RESIDUAL.
// Wrapper: cupy_kernels/layernorm.py   Tests: tests/test_kernels_gpu.py
#include "common.cuh"

using namespace g2c;

namespace {
constexpr int U = 4;  // vectors in flight per thread (the wrapper sizes blocks for it)
}

template <typename T, int VEC, bool RESIDUAL>
__global__ void __launch_bounds__(1024)
    layernorm_kernel(T* __restrict__ out, T* sum_out,  // sum_out may alias x
                     const T* x, const T* __restrict__ y, const T* __restrict__ bias,
                     const T* __restrict__ w, const T* __restrict__ b, int C, float eps) {
    extern __shared__ float smem[];  // C + 3 floats
    __shared__ float scratch[32];
    const long long offset = static_cast<long long>(blockIdx.x) * C;
    x += offset;
    out += offset;
    if constexpr (RESIDUAL) {
        y += offset;
        sum_out += offset;
    }
    SmemRow row(smem, split_row<T, VEC>(x, C).head);

    float sum = 0.0f;
    for_each_in_rows<T, VEC, U>(x, RESIDUAL ? y : nullptr, C, [&](auto& a, auto& c, int i0) {
        constexpr int N = sizeof(a) / sizeof(float);
        if constexpr (RESIDUAL) {
            float pb[N];
            if (bias) {
                load_any<T, N>(bias + i0, pb);
            } else {
#pragma unroll
                for (int k = 0; k < N; ++k) pb[k] = 0.0f;
            }
#pragma unroll
            for (int k = 0; k < N; ++k) a[k] = to_float(from_float<T>(a[k] + c[k] + pb[k]));
        }
#pragma unroll
        for (int k = 0; k < N; ++k) sum += a[k];
        row.put(i0, a);
    });
    const float mean = block_sum(sum, scratch) / C;  // its barrier also publishes the row

    float sq = 0.0f;
    for (int i = threadIdx.x; i < C; i += blockDim.x) {
        const float d = row[i] - mean;
        sq += d * d;
    }
    const float rstd = rsqrtf(block_sum(sq, scratch) / C + eps);

    if constexpr (RESIDUAL) write_row<T, VEC>(sum_out, C, [&](int i0, auto& v) { row.get(i0, v); });
    write_row<T, VEC>(out, C, [&](int i0, auto& v) {
        constexpr int N = sizeof(v) / sizeof(float);
        float gw[N], gb[N];
        row.get(i0, v);
        load_any<T, N>(w + i0, gw);
        load_any<T, N>(b + i0, gb);
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = (v[k] - mean) * rstd * gw[k] + gb[k];
    });
}
