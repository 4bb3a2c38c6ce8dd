// layernorm.cu - LayerNorm over the last axis, optionally fused with the residual add.
//
//   plain:     out = (x - mean(x)) / sqrt(var(x) + eps) * w + b
//   residual:  s = x + y (+ bias);  sum_out = s;  out = layernorm(s)
//              (the GPT-2 block: residual stream + projection output + projection bias)
//
// One block per row. Each thread walks the row in VEC-wide steps (16-byte vectors when
// the row is aligned, VEC = 1 otherwise), keeps the row in shared memory as float32, and
// the mean and the variance come from two block reductions over that copy (two-pass
// variance: no cancellation). Bytes: read C (x2 and bias for residual) + w + b, write C
// (x2 for residual) per row; FLOPs negligible -> bandwidth bound.
// In the residual form the sum is rounded to T before it is normalized, as a framework
// that stores the residual stream in T would do.
//
// Specializations: T in {float, __half, __nv_bfloat16} x VEC in {1, 16/sizeof(T)} x RESIDUAL.
// Wrapper: cupy_kernels/layernorm.py   Tests: tests/test_kernels_gpu.py
#include "common.cuh"

using namespace g2c;

template <typename T, int VEC, bool RESIDUAL>
__global__ void layernorm_kernel(T* __restrict__ out, T* sum_out,  // sum_out may alias x
                                 const T* x, const T* __restrict__ y,
                                 const T* __restrict__ bias, const T* __restrict__ w,
                                 const T* __restrict__ b, int C, float eps) {
    extern __shared__ float row[];
    __shared__ float scratch[32];
    const long long offset = static_cast<long long>(blockIdx.x) * C;
    x += offset;
    out += offset;
    if constexpr (RESIDUAL) {
        y += offset;
        sum_out += offset;
    }

    float sum = 0.0f;
    for (int i = threadIdx.x * VEC; i < C; i += blockDim.x * VEC) {
        float v[VEC];
        load_vec<T, VEC>(x + i, v);
        if constexpr (RESIDUAL) {
            float u[VEC], c[VEC];
            load_vec<T, VEC>(y + i, u);
            if (bias != nullptr) {
                load_vec<T, VEC>(bias + i, c);
            } else {
#pragma unroll
                for (int k = 0; k < VEC; ++k) c[k] = 0.0f;
            }
#pragma unroll
            for (int k = 0; k < VEC; ++k) v[k] = to_float(from_float<T>(v[k] + u[k] + c[k]));
            store_vec<T, VEC>(sum_out + i, v);
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            row[i + k] = v[k];
            sum += v[k];
        }
    }
    const float mean = block_sum(sum, scratch) / C;

    // each thread reads back only the elements it wrote: no barrier needed
    float sq = 0.0f;
    for (int i = threadIdx.x * VEC; i < C; i += blockDim.x * VEC) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            const float d = row[i + k] - mean;
            sq += d * d;
        }
    }
    const float rstd = rsqrtf(block_sum(sq, scratch) / C + eps);

    for (int i = threadIdx.x * VEC; i < C; i += blockDim.x * VEC) {
        float gw[VEC], gb[VEC], o[VEC];
        load_vec<T, VEC>(w + i, gw);
        load_vec<T, VEC>(b + i, gb);
#pragma unroll
        for (int k = 0; k < VEC; ++k) o[k] = (row[i + k] - mean) * rstd * gw[k] + gb[k];
        store_vec<T, VEC>(out + i, o);
    }
}
