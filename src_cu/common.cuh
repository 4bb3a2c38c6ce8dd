// common.cuh - device helpers shared by every kernel family.
//
// Storage types are float, __half and __nv_bfloat16; arithmetic is always float32.
// Vectors are 16 bytes wide (4 floats or 8 halves), the widest load one thread can issue.
// Reductions run in float32 (or exact integers) through warp shuffles, then shared memory.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

#ifndef INFINITY  // NVRTC has no <cmath>
#define INFINITY __int_as_float(0x7f800000)
#endif

namespace g2c {

// ---------------------------------------------------------------------------------------
// dtype conversion
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// ---------------------------------------------------------------------------------------
// 16-byte vectors: N = 16 / sizeof(T) elements, loaded and stored in one instruction.
// The address must be 16-byte aligned; wrappers check this before choosing a vector path.
// ---------------------------------------------------------------------------------------
template <typename T> struct Vec {
    static constexpr int N = 16 / sizeof(T);
    float v[N];

    __device__ __forceinline__ void load(const T* p) {
        uint4 raw = *reinterpret_cast<const uint4*>(p);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int i = 0; i < N; ++i) v[i] = to_float(e[i]);
    }
    __device__ __forceinline__ void store(T* p) const {
        uint4 raw;
        T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int i = 0; i < N; ++i) e[i] = from_float<T>(v[i]);
        *reinterpret_cast<uint4*>(p) = raw;
    }
};

// Load `n` (<= VEC) consecutive elements as float: one 16-byte load when VEC > 1,
// one scalar load when VEC == 1. Lets a kernel body serve both paths.
template <typename T, int VEC>
__device__ __forceinline__ void load_vec(const T* p, float (&out)[VEC]) {
    if constexpr (VEC == 1) {
        out[0] = to_float(p[0]);
    } else {
        static_assert(VEC == Vec<T>::N, "VEC must be 1 or 16 bytes of T");
        Vec<T> t;
        t.load(p);
#pragma unroll
        for (int i = 0; i < VEC; ++i) out[i] = t.v[i];
    }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[VEC]) {
    if constexpr (VEC == 1) {
        p[0] = from_float<T>(in[0]);
    } else {
        static_assert(VEC == Vec<T>::N, "VEC must be 1 or 16 bytes of T");
        Vec<T> t;
#pragma unroll
        for (int i = 0; i < VEC; ++i) t.v[i] = in[i];
        t.store(p);
    }
}

// The GPU's global timer, in ns (one clock for every SM, unlike clock64()).
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
    return t;
}

// ---------------------------------------------------------------------------------------
// programmatic dependent launch (sm_90): a kernel launched with the programmatic-stream-
// serialization attribute may start while the kernel before it still runs. It must call
// griddep_wait() before it reads anything an earlier kernel wrote or writes anything an
// earlier kernel reads; what comes before the wait may only read data no kernel writes
// (weights). griddep_launch_dependents() lets the next kernel start as soon as every block
// of this one has called it. Both are no-ops before sm_90 and in a plain launch.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ void griddep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void griddep_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// 16 bytes of read-only data that this launch reads once (weights), without allocating in
// L1, where it would only evict what is reused.
// Not ld.global.nc: ptxas moves non-coherent loads past griddepcontrol.wait (and past
// bar.sync), so in the tensor-core products with the folded LayerNorm most of the first
// batch of W, requested before griddep_wait() for programmatic dependent launch, was issued
// after it (sm_90 SASS of linear_mma_kernel<__half, __half, 1, 4, 2, 1, 1>: 3 of its 8
// loads before ACQBULK; 9 of 16 at U = 8 with the KV-cache epilogue). A coherent load
// cannot move past the wait: in the SASS of those kernels all of them now go before it.
// Measured on the H100, same run (benchmarks/results/pdl_w_before_wait-h100.log, 512-token
// calls, us a token, float16 B = 1): GPT-2 XL 1683-1688 against 1755 with .nc, GPT-2 small
// 235-238 against 243-244; at B = 8 GPT-2 small 277.6 against 284.6, at B = 64 within 1%.
// (An L2 evict-first policy on these loads, benchmarks/results/evict_first-h100.log, with
// .nc: built before every load, which also put each load behind a branch of its own, so that
// ptxas kept it before the wait, XL went to 1676-1682 and small to 238-241, but the step at
// B = 64 and 128 lost 3% (W re-read from L2 by each block row); that layout with an
// evict-normal policy, XL 1694, small 253; built once a kernel, the loads predicated (and
// moved), nothing. With the coherent loads, evict-first once a kernel where one n-tile runs
// in one block row (B <= 8) measured XL 1680 and small 234-235 against 1683-1688 and
// 235-238 without it (pdl_w_before_wait-h100.log, v2): within run-to-run spread, not kept.
// Together with an evict-last policy on the KV cache (branch kv-l2, kv_l2-h100.log, the step
// with PDL at 64 / 264 / 520 / 900 cached keys): GPT-2 small B = 1 222.1 / 235.8 / 261.2 /
// 294.3 against 226.5 / 237.0 / 263.9 / 292.1 us, XL 1567.9 / 1606.1 / 1718.1 / 1845.0
// against 1590.2 / 1598.0 / 1710.8 / 1831.5, and B = 8 1% slower: a gain on short caches only.)
__device__ __forceinline__ uint4 load_stream16(const void* p) {
    uint4 r;
    asm("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// An int read from global memory at this point of the program, every time: a volatile load
// the compiler neither merges with an earlier one nor hoists, so that a value needed again
// at a kernel's end need not stay in a register through its main loop.
__device__ __forceinline__ int reload_int(const int* p) {
    int r;
    asm volatile("ld.global.b32 %0, [%1];\n" : "=r"(r) : "l"(p));
    return r;
}

// ---------------------------------------------------------------------------------------
// warp and block reductions (float32)
// ---------------------------------------------------------------------------------------
constexpr unsigned FULL_MASK = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL_MASK, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, o));
    return x;
}

// Sum over the whole block; every thread gets the result. `scratch` holds 32 floats.
// Deterministic: a fixed shuffle tree, then a fixed order over warps.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = (blockDim.x + 31) >> 5;
    x = warp_sum(x);
    if (n_warps == 1) return x;  // one warp: no shared memory, no barrier
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_sum(x);
}

__device__ __forceinline__ float block_max(float x, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = (blockDim.x + 31) >> 5;
    x = warp_max(x);
    if (n_warps == 1) return x;
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < n_warps ? scratch[lane] : -INFINITY;
    return warp_max(x);
}

constexpr float LOG2E = 1.4426950408889634f;

// 2^x in one instruction (ex2.approx.ftz: ~2 ulp, 2^-inf = 0, results below 2^-126 flush to 0),
// where exp2f adds a range check and two multiplies to return subnormal results.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// GELU, tanh form (GPT-2's "gelu_new"): 0.5 v (1 + tanh(u)), u = sqrt(2/pi) (v + 0.044715 v^3),
// computed as v / (1 + exp(-2u)) (the same function: 0.5 (1 + tanh(u)) = sigmoid(2u)) with
// the hardware exponential: ~8 instructions instead of tanhf's ~25, which at half precision
// and full memory bandwidth would make the kernel instruction bound. No cancellation:
// relative error ~1e-6 for float32 storage.
__device__ __forceinline__ float gelu_tanh(float v) {
    constexpr float k0 = -2.0f * 0.7978845608028654f;  // -2 sqrt(2 / pi)
    constexpr float k1 = 0.044715f;
    return __fdividef(v, 1.0f + __expf(k0 * (v + k1 * v * v * v)));
}

// ---------------------------------------------------------------------------------------
// Philox4x32-10 counter-based generator (Salmon et al., SC'11): the same (key, counter)
// always gives the same four 32-bit words, so sampling is reproducible from a seed and
// needs no state in memory. Mirrored in cupy_kernels/reference.py.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ uint4 philox4x32_10(uint4 ctr, uint2 key) {
    constexpr unsigned M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
    constexpr unsigned W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const unsigned hi0 = __umulhi(M0, ctr.x), lo0 = M0 * ctr.x;
        const unsigned hi1 = __umulhi(M1, ctr.z), lo1 = M1 * ctr.z;
        ctr = make_uint4(hi1 ^ ctr.y ^ key.x, lo1, hi0 ^ ctr.w ^ key.y, lo0);
        key.x += W0;
        key.y += W1;
    }
    return ctr;
}

// A float in [0, 1) from the top 24 bits of a word: exact in float32.
__device__ __forceinline__ float uniform01(unsigned bits) {
    return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

}  // namespace g2c
