// gelu.cu - bias add fused with GELU (tanh form), or a plain bias add.
//
//   out = gelu(x + bias[col]),  gelu(v) = 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))
//
// transformers' NewGELUActivation computes this in 8 element-wise kernels (pow, mul, add,
// mul, tanh, add, mul, mul) plus the bias add inside the matmul; here it is one pass:
// read x and bias, write out, all arithmetic in float32 registers.
// Threads map to VEC-wide chunks of the flattened [rows, cols] array with a grid-stride
// loop; VEC = 16 bytes when cols and the pointers are aligned, else 1.
// Bytes: read + write rows*cols*sizeof(T) (bias stays in L1/L2); ~20 FLOPs per element.
//
// Specializations: T in {float, __half, __nv_bfloat16} x VEC in {1, 16/sizeof(T)} x GELU.
// Wrapper: cupy_kernels/gelu.py   Tests: tests/test_kernels_gpu.py
#include "common.cuh"

using namespace g2c;

template <typename T, int VEC, bool GELU>
__global__ void bias_act_kernel(T* out, const T* x,  // out may alias x
                                const T* __restrict__ bias, long long n, int cols) {
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x * VEC;
    for (long long e = (static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x) * VEC; e < n;
         e += stride) {
        float v[VEC], c[VEC];
        load_vec<T, VEC>(x + e, v);
        load_vec<T, VEC>(bias + e % cols, c);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            v[k] += c[k];
            if constexpr (GELU) v[k] = gelu_tanh(v[k]);
        }
        store_vec<T, VEC>(out + e, v);
    }
}
