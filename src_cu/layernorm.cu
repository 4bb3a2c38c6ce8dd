// layernorm.cu - LayerNorm over the last axis, optionally fused with the residual add.
//
//   plain:     out = (x - mean(x)) / sqrt(var(x) + eps) * w + b
//   residual:  s = x + y (+ bias);  sum_out = s;  out = layernorm(s)
//              (the GPT-2 block: residual stream + projection output + projection bias)
//
// One block per row, sized by the wrapper so that each thread owns about U = 4 16-byte
// vectors of the row, all loaded before the first is used (bytes in flight to cover the
// memory latency). The row stays on chip (row.cuh): in registers when it fits in
// blockDim * U vectors (rows up to 16384 float32 / 32768 half elements), else in shared
// memory. Mean and variance come from two block reductions over that copy (two-pass
// variance: no cancellation), then the output is written from it. Any length: the row's
// aligned middle moves as vectors, its unaligned head and tail as scalars.
// Bytes: read C (2 C for residual) + w + b, write C (2 C for residual) per row; ~10
// instructions per element -> bandwidth bound. In the residual form the sum is rounded
// to T before it is normalized, as a framework storing the residual stream in T would do.
//
// Specializations: T in {float, __half, __nv_bfloat16} x VEC in {1, 16/sizeof(T)} x
// RESIDUAL x IN_REGS, U = 4 (plain) or 2 (residual: x and y in flight, the same bytes;
// 4 of each spills at 1024 threads); benchmarks/row_tuning.py measures the alternatives.
// Wrapper: cupy_kernels/layernorm.py   Tests: tests/test_kernels_gpu.py
#include "row.cuh"

using namespace g2c;

// U: vectors per thread, loaded together (the wrapper sizes blocks for it).
template <typename T, int VEC, bool RESIDUAL, bool IN_REGS, int U>
__global__ void __launch_bounds__(IN_REGS ? 1024 : 512)  // a shared-memory row loops: 512 threads do
    layernorm_kernel(T* __restrict__ out, T* sum_out,  // sum_out may alias x
                     const T* x, const T* __restrict__ y, const T* __restrict__ bias,
                     const T* __restrict__ w, const T* __restrict__ b, int C, float eps) {
    extern __shared__ float smem[];  // C + 3 floats unless IN_REGS
    __shared__ float scratch[32];
    const long long offset = static_cast<long long>(blockIdx.x) * C;
    x += offset;
    out += offset;
    if constexpr (RESIDUAL) {
        y += offset;
        sum_out += offset;
    }
    Row<T, VEC, U, IN_REGS> row(smem);

    float sum = 0.0f;
    row.fill(x, RESIDUAL ? y : nullptr, C, [&](auto& a, auto& c, int i0) {
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
            if constexpr (N == 1) {
                sum_out[i0] = from_float<T>(a[0]);
            } else {
                store_vec<T, N>(sum_out + i0, a);  // same alignment as x (checked by the wrapper)
            }
        }
#pragma unroll
        for (int k = 0; k < N; ++k) sum += a[k];
    });
    const float mean = block_sum(sum, scratch) / C;

    float sq = 0.0f;
    row.update([&](auto& a, int) {
        constexpr int N = sizeof(a) / sizeof(float);
#pragma unroll
        for (int k = 0; k < N; ++k) {
            a[k] -= mean;
            sq += a[k] * a[k];
        }
    });
    const float rstd = rsqrtf(block_sum(sq, scratch) / C + eps);

    row.write(out, [&](auto& a, int i0, auto& o) {
        constexpr int N = sizeof(a) / sizeof(float);
        float gw[N], gb[N];
        load_any<T, N>(w + i0, gw);
        load_any<T, N>(b + i0, gb);
#pragma unroll
        for (int k = 0; k < N; ++k) o[k] = a[k] * rstd * gw[k] + gb[k];
    });
}
