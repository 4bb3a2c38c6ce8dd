// embedding.cu - token + position embedding.
//
//   out[n, :] = wte[ids[n], :] + wpe[positions[n], :]
//
// One block per output row, VEC-wide chunks of C per thread. Indices are trusted here:
// the model checks token ids on the host before they reach the GPU.
// Bytes: 2 reads + 1 write of C elements per row.
//
// STATS: the row's statistics too, as a product with a residual epilogue leaves them for the
// next product's folded LayerNorm (linear.cu, X_LN_FOLD): stats[n, j] = (mean, sum of squared
// deviations) of columns 16 j .. 16 j + 15 as stored (linear.cuh's embed_set, which the fused
// step's layer 0 runs too). A thread takes a set at a time. With them the decode step's first
// q|k|v product folds its LayerNorm as every other product does, instead of normalizing in its
// prologue (gpt2_cupy/model.py, DECODE_EMBED_STATS has the measurements).
//
// Specializations: T in {float, __half, __nv_bfloat16} x VEC in {1, 16/sizeof(T)}; STATS for
// the 16-bit types at VEC = 8.
// Wrapper: cupy_kernels/embedding.py   Tests: tests/test_kernels_gpu.py
#include "common.cuh"
#include "linear.cuh"

using namespace g2c;

template <typename T, int VEC, bool STATS = false>
__global__ void embedding_kernel(T* __restrict__ out, const int* __restrict__ ids,
                                 const int* __restrict__ positions, const T* __restrict__ wte,
                                 const T* __restrict__ wpe, int C, float2* __restrict__ stats) {
    // programmatic dependent launch: the next kernel (a product, which reads only its weights
    // before its wait) may start at once; the previous kernel's writes are visible after the wait
    griddep_launch_dependents();
    griddep_wait();
    const long long n = blockIdx.x;
    const T* tok = wte + static_cast<long long>(ids[n]) * C;
    const T* pos = wpe + static_cast<long long>(positions[n]) * C;
    if constexpr (!STATS) {
        for (int i = threadIdx.x * VEC; i < C; i += blockDim.x * VEC) {
            float a[VEC], b[VEC];
            load_vec<T, VEC>(tok + i, a);
            load_vec<T, VEC>(pos + i, b);
#pragma unroll
            for (int k = 0; k < VEC; ++k) a[k] += b[k];
            store_vec<T, VEC>(out + n * C + i, a);
        }
    } else {
        static_assert(VEC == 8 && sizeof(T) == 2, "row statistics of 16-bit rows in 16-byte vectors");
        const int n_sets = (C + 15) / 16;
        for (int j = threadIdx.x; j < n_sets; j += blockDim.x)
            stats[n * n_sets + j] = embed_set<T>(tok, pos, j, C, out + n * C, static_cast<T*>(nullptr));
    }
}
