// embedding.cu - token + position embedding.
//
//   out[n, :] = wte[ids[n], :] + wpe[positions[n], :]
//
// One block per output row, VEC-wide chunks of C per thread. Indices are trusted here:
// the model checks token ids on the host before they reach the GPU.
// Bytes: 2 reads + 1 write of C elements per row.
//
// Specializations: T in {float, __half, __nv_bfloat16} x VEC in {1, 16/sizeof(T)}.
// Wrapper: cupy_kernels/embedding.py   Tests: tests/test_kernels_gpu.py
#include "common.cuh"

using namespace g2c;

template <typename T, int VEC>
__global__ void embedding_kernel(T* __restrict__ out, const int* __restrict__ ids,
                                 const int* __restrict__ positions, const T* __restrict__ wte,
                                 const T* __restrict__ wpe, int C) {
    griddep_wait();  // programmatic dependent launch: the previous kernel's writes are visible
    griddep_launch_dependents();
    const long long n = blockIdx.x;
    const T* tok = wte + static_cast<long long>(ids[n]) * C;
    const T* pos = wpe + static_cast<long long>(positions[n]) * C;
    for (int i = threadIdx.x * VEC; i < C; i += blockDim.x * VEC) {
        float a[VEC], b[VEC];
        load_vec<T, VEC>(tok + i, a);
        load_vec<T, VEC>(pos + i, b);
#pragma unroll
        for (int k = 0; k < VEC; ++k) a[k] += b[k];
        store_vec<T, VEC>(out + n * C + i, a);
    }
}
