// kv_cache.cu - append new key / value rows to the KV cache.
//
//   k_cache[slot[b], h, start[b] + t, :] = k[b, t, h, :]   (same for v)
//   seq_lens[b] = start[b] + T_new                          (when seq_lens is given)
//
// k and v are strided [B, T_new, H, D] views (the fused qkv buffer's thirds); the cache is
// a contiguous [B_cache, H, S_max, D] array. One block per (b, t), VEC-wide chunks of H*D.
// Bytes: read + write 2 T_new H D elements per sequence. A negative slot writes nothing: the
// padding rows of a recorded prefill (gpt2_cupy/model.py, _forward), which no sequence holds.
//
// kv_append_quant_kernel: the same rows into an int8 or fp8 cache (kv.cuh): one warp per
// (b, t, head) row finds max|x| with xor-shuffles, stores scale = max|x| / QMAX and the
// row encoded as x * (QMAX / max|x|). Reads 2 T_new H D elements, writes a quarter or half.
//
// kv_advance: positions[b] += n, the decode step's last launch (the cache lengths live in
// device memory, so a recorded step or a CUDA graph can be replayed as is).
//
// Specializations: T in {float, __half, __nv_bfloat16} x VEC in {1, 16/sizeof(T)};
// quantized: T x KT in {signed char, __nv_fp8_e4m3} x D in {64, 128}.
// Wrapper: cupy_kernels/kv_cache.py   Tests: tests/test_kernels_gpu.py (quantized: tests/test_decode_attention_gpu.py)
#include "kv.cuh"

using namespace g2c;

template <typename T, int VEC>
__global__ void kv_append_kernel(T* __restrict__ k_cache, T* __restrict__ v_cache, const T* __restrict__ k,
                                 const T* __restrict__ v, const int* __restrict__ slots,
                                 const int* __restrict__ start, int* __restrict__ seq_lens, int T_new, int H,
                                 int D, int S_max, long long k_sb, long long k_st, long long v_sb,
                                 long long v_st) {
    griddep_wait();  // programmatic dependent launch: the previous kernel's writes are visible
    griddep_launch_dependents();
    const int b = blockIdx.x / T_new, t = blockIdx.x % T_new;
    const int slot = slots != nullptr ? slots[b] : b;
    if (slot < 0) return;  // a padding row
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

template <typename T, typename KT, int D>
__global__ void kv_append_quant_kernel(KT* __restrict__ k_cache, KT* __restrict__ v_cache,
                                       float* __restrict__ k_scale, float* __restrict__ v_scale,
                                       const T* __restrict__ k, const T* __restrict__ v,
                                       const int* __restrict__ slots, const int* __restrict__ start,
                                       int* __restrict__ seq_lens, int T_new, int H, int S_max, long long k_sb,
                                       long long k_st, long long v_sb, long long v_st) {
    griddep_wait();  // programmatic dependent launch: the previous kernel's writes are visible
    griddep_launch_dependents();
    using Fmt = KvFormat<KT>;
    constexpr int PER = D / 32;  // elements per lane
    const int b = blockIdx.x / T_new, t = blockIdx.x % T_new;
    const int slot = slots != nullptr ? slots[b] : b;
    if (slot < 0) return;  // a padding row
    const long long pos = start[b] + t;
    const int lane = threadIdx.x % 32;
    for (int h = threadIdx.x / 32; h < H; h += blockDim.x / 32) {
        const long long row = (static_cast<long long>(slot) * H + h) * S_max + pos;
#pragma unroll
        for (int which = 0; which < 2; ++which) {
            const T* src = (which == 0 ? k + b * k_sb + t * k_st : v + b * v_sb + t * v_st) + h * D + lane * PER;
            float x[PER], amax = 0.0f;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                x[i] = to_float(src[i]);
                amax = fmaxf(amax, fabsf(x[i]));
            }
            amax = warp_max(amax);
            const float inv = amax > 0.0f ? Fmt::QMAX / amax : 0.0f;
            KT* dst = (which == 0 ? k_cache : v_cache) + row * D + lane * PER;
#pragma unroll
            for (int i = 0; i < PER; ++i) dst[i] = Fmt::encode(x[i] * inv);
            if (lane == 0) (which == 0 ? k_scale : v_scale)[row] = amax / Fmt::QMAX;
        }
    }
    if (seq_lens != nullptr && t == 0 && threadIdx.x == 0) seq_lens[b] = start[b] + T_new;
}

__global__ void kv_advance_kernel(int* __restrict__ positions, int n, int B) {
    griddep_wait();  // programmatic dependent launch: the previous kernel's writes are visible
    griddep_launch_dependents();
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < B) positions[b] += n;
}
