// kv_cache.cu - append new key / value rows to the KV cache.
//
//   k_cache[slot[b], h, start[b] + t, :] = k[b, t, h, :]   (same for v)
//   seq_lens[b] = start[b] + T_new                          (when seq_lens is given)
//
// k and v are strided [B, T_new, H, D] views (the fused qkv buffer's thirds); the cache is
// a contiguous [B_cache, H, S_max, D] array. One block per (b, t), VEC-wide chunks of H*D.
// Bytes: read + write 2 T_new H D elements per sequence.
//
// kv_advance: positions[b] += n, the decode step's last launch (the cache lengths live in
// device memory, so a recorded step or a CUDA graph can be replayed as is).
//
// Specializations: T in {float, __half, __nv_bfloat16} x VEC in {1, 16/sizeof(T)}.
// Wrapper: cupy_kernels/kv_cache.py   Tests: tests/test_kernels_gpu.py
#include "common.cuh"

using namespace g2c;

template <typename T, int VEC>
__global__ void kv_append_kernel(T* __restrict__ k_cache, T* __restrict__ v_cache, const T* __restrict__ k,
                                 const T* __restrict__ v, const int* __restrict__ slots,
                                 const int* __restrict__ start, int* __restrict__ seq_lens, int T_new, int H,
                                 int D, int S_max, long long k_sb, long long k_st, long long v_sb,
                                 long long v_st) {
    const int b = blockIdx.x / T_new, t = blockIdx.x % T_new;
    const int slot = slots != nullptr ? slots[b] : b;
    const long long pos = start[b] + t;
    for (int e = threadIdx.x * VEC; e < H * D; e += blockDim.x * VEC) {
        const int h = e / D, d = e % D;
        const long long dst = ((static_cast<long long>(slot) * H + h) * S_max + pos) * D + d;
        float x[VEC];
        load_vec<T, VEC>(k + b * k_sb + t * k_st + e, x);
        store_vec<T, VEC>(k_cache + dst, x);
        load_vec<T, VEC>(v + b * v_sb + t * v_st + e, x);
        store_vec<T, VEC>(v_cache + dst, x);
    }
    if (seq_lens != nullptr && t == 0 && threadIdx.x == 0) seq_lens[b] = start[b] + T_new;
}

__global__ void kv_advance_kernel(int* __restrict__ positions, int n, int B) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < B) positions[b] += n;
}
