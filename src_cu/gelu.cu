// gelu.cu - bias add fused with GELU (tanh form), or a plain bias add.
//
//   out[r, c] = gelu(x[r, c] + bias[c]),  gelu(v) = 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))
//
// transformers' NewGELUActivation computes this in 8 element-wise kernels (pow, mul, add,
// mul, tanh, add, mul, mul) after the bias add inside the matmul; here it is one pass:
// read x, write out, all arithmetic in float32 registers.
// Mapping: threadIdx.x + blockIdx.x * blockDim.x picks a VEC-wide column chunk (its bias
// is loaded once, into registers); blockIdx.y strides over the rows, R rows' loads in
// flight per thread. No division or modulo per element. VEC = 16 bytes when cols and the pointers are aligned, else 1.
// Bytes: read + write rows * cols * sizeof(T); ~20 FLOPs per element.
//
// Specializations: T in {float, __half, __nv_bfloat16} x VEC in {1, 16/sizeof(T)} x GELU.
// Wrapper: cupy_kernels/gelu.py   Tests: tests/test_kernels_gpu.py
#include "common.cuh"

using namespace g2c;

namespace {
constexpr int R = 4;  // rows in flight per thread, loaded before any store (not tuned yet)
}

template <typename T, int VEC, bool GELU>
__global__ void bias_act_kernel(T* out, const T* x,  // out may alias x
                                const T* __restrict__ bias, int rows, int cols) {
    const int c = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (c >= cols) return;
    float b[VEC];
    load_vec<T, VEC>(bias + c, b);
    for (int r0 = blockIdx.y; r0 < rows; r0 += R * gridDim.y) {
        float v[R][VEC];
#pragma unroll
        for (int u = 0; u < R; ++u) {
            const int r = r0 + u * gridDim.y;
            if (r < rows) load_vec<T, VEC>(x + static_cast<long long>(r) * cols + c, v[u]);
        }
#pragma unroll
        for (int u = 0; u < R; ++u) {
            const int r = r0 + u * gridDim.y;
            if (r >= rows) break;
#pragma unroll
            for (int k = 0; k < VEC; ++k) {
                v[u][k] += b[k];
                if constexpr (GELU) v[u][k] = gelu_tanh(v[u][k]);
            }
            store_vec<T, VEC>(out + static_cast<long long>(r) * cols + c, v[u]);
        }
    }
}
