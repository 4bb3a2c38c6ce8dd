// softmax.cu - row softmax with a scale and an optional causal mask.
//
//   out[r, c] = exp(scale x[r, c] - max) / sum,  over the visible columns c of row r
//
// Causal: row r is query q = r mod q_len of a [q_len, cols] score matrix, aligned
// bottom-right: it sees columns c <= q + (cols - q_len); hidden columns are written as 0,
// and a row with no visible column is all 0.
// One block per row (its size chosen from the row length by the wrapper). One read of the
// row from memory: each thread keeps the values it loaded in shared memory (as float32)
// and an online (max, sum) in registers; one block merge; then it writes its own values
// back from shared memory. Bytes: 1 read + 1 write of the row.
//
// Specializations: T in {float, __half, __nv_bfloat16} x VEC in {1, 16/sizeof(T)}.
// Wrapper: cupy_kernels/softmax.py   Tests: tests/test_kernels_gpu.py
#include "common.cuh"

using namespace g2c;

template <typename T, int VEC>
__global__ void softmax_kernel(T* __restrict__ out, const T* __restrict__ x, int cols, int q_len,
                               int causal, float scale) {
    extern __shared__ float row[];  // cols floats
    __shared__ float scratch[64];
    const long long offset = static_cast<long long>(blockIdx.x) * cols;
    x += offset;
    out += offset;
    int visible = cols;
    if (causal) visible = min(cols, max(0, static_cast<int>(blockIdx.x % q_len) + cols - q_len + 1));
    const float s2 = scale * LOG2E;  // work in the log2 domain: exp(a) = exp2(a log2 e)

    MaxSum acc{-INFINITY, 0.0f};
    for (int i = threadIdx.x * VEC; i < visible; i += blockDim.x * VEC) {
        float v[VEC];
        load_vec<T, VEC>(x + i, v);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            v[k] *= s2;
            row[i + k] = v[k];
            if (i + k < visible) acc = merge(acc, MaxSum{v[k], 1.0f});
        }
    }
    acc = block_merge(acc, scratch);
    const float inv = acc.s > 0.0f ? 1.0f / acc.s : 0.0f;

    // each thread reads back only what it wrote: no barrier needed
    for (int i = threadIdx.x * VEC; i < cols; i += blockDim.x * VEC) {
        float v[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[k] = i + k < visible ? exp2f(row[i + k] - acc.m) * inv : 0.0f;
        store_vec<T, VEC>(out + i, v);
    }
}
