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

// ---------------------------------------------------------------------------------------
// rows of one-block-per-row kernels: the 16-byte-aligned middle of a row is read as
// VEC-wide vectors, the unaligned head and tail (< VEC elements each) as scalars, so any
// row length works at full width (a [rows, 781] array's rows alternate alignments).
// All arrays walked together must have the same alignment: the wrappers check this.
// ---------------------------------------------------------------------------------------
struct RowSplit {
    int head;   // scalars before the first aligned vector
    int n_vec;  // aligned vectors
    int tail;   // index of the first scalar after them
};

template <typename T, int VEC>
__device__ __forceinline__ RowSplit split_row(const T* row, int C) {
    const int mis = VEC == 1 ? 0 : static_cast<int>((reinterpret_cast<unsigned long long>(row) / sizeof(T)) % VEC);
    const int head = min(C, mis ? VEC - mis : 0);
    const int n_vec = (C - head) / VEC;
    return {head, n_vec, head + n_vec * VEC};
}

// One VEC-wide chunk as loaded, kept packed (4 registers for 16 bytes of any T) until used.
template <typename T, int VEC> struct Packed {
    uint4 raw;
    __device__ __forceinline__ void load(const T* p) { raw = *reinterpret_cast<const uint4*>(p); }
    __device__ __forceinline__ void unpack(float (&v)[VEC]) const {
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < VEC; ++k) v[k] = to_float(e[k]);
    }
};
template <typename T> struct Packed<T, 1> {
    T raw;
    __device__ __forceinline__ void load(const T* p) { raw = *p; }
    __device__ __forceinline__ void unpack(float (&v)[1]) const { v[0] = to_float(raw); }
};

// Calls f(a, b, i0) for every chunk of two rows with the same alignment: a and b are
// float[VEC] for an aligned vector starting at element i0, float[1] for a head or tail
// scalar (y may be null: then b is 0). Each thread has U chunks' loads in flight before
// it uses the first.
template <typename T, int VEC, int U, typename F>
__device__ __forceinline__ void for_each_in_rows(const T* x, const T* y, int C, F&& f) {
    const RowSplit rs = split_row<T, VEC>(x, C);
    auto scalar = [&](int i) {
        float a[1] = {to_float(x[i])}, b[1] = {y ? to_float(y[i]) : 0.0f};
        f(a, b, i);
    };
    for (int i = threadIdx.x; i < rs.head; i += blockDim.x) scalar(i);
    for (int i = rs.tail + threadIdx.x; i < C; i += blockDim.x) scalar(i);
    for (int base = 0; base < rs.n_vec; base += blockDim.x * U) {
        Packed<T, VEC> pa[U], pb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = base + u * blockDim.x + threadIdx.x;
            if (j < rs.n_vec) {
                pa[u].load(x + rs.head + j * VEC);
                if (y) pb[u].load(y + rs.head + j * VEC);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = base + u * blockDim.x + threadIdx.x;
            if (j < rs.n_vec) {
                float a[VEC], b[VEC];
                pa[u].unpack(a);
                if (y) {
                    pb[u].unpack(b);
                } else {
#pragma unroll
                    for (int k = 0; k < VEC; ++k) b[k] = 0.0f;
                }
                f(a, b, rs.head + j * VEC);
            }
        }
    }
}

// A float32 copy of a row in shared memory, shifted by 0-3 floats so that the row's
// aligned vectors land on 16-byte boundaries and move as float4 (no bank conflicts).
struct SmemRow {
    float* base;
    __device__ __forceinline__ SmemRow(float* smem, int head) : base(smem + (4 - head % 4) % 4) {}
    template <int N> __device__ __forceinline__ void put(int i0, const float (&v)[N]) {
        if constexpr (N % 4 == 0) {
#pragma unroll
            for (int q = 0; q < N / 4; ++q)
                reinterpret_cast<float4*>(base + i0)[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
        } else {
#pragma unroll
            for (int k = 0; k < N; ++k) base[i0 + k] = v[k];
        }
    }
    template <int N> __device__ __forceinline__ void get(int i0, float (&v)[N]) const {
        if constexpr (N % 4 == 0) {
#pragma unroll
            for (int q = 0; q < N / 4; ++q) {
                const float4 f = reinterpret_cast<const float4*>(base + i0)[q];
                v[4 * q] = f.x, v[4 * q + 1] = f.y, v[4 * q + 2] = f.z, v[4 * q + 3] = f.w;
            }
        } else {
#pragma unroll
            for (int k = 0; k < N; ++k) v[k] = base[i0 + k];
        }
    }
    __device__ __forceinline__ float& operator[](int i) { return base[i]; }
};

// Writes a row: g(i0, v) fills v (float[VEC] for an aligned vector, float[1] for a head or
// tail scalar) with the values of elements i0, i0 + 1, ...
template <typename T, int VEC, typename G>
__device__ __forceinline__ void write_row(T* out, int C, G&& g) {
    const RowSplit rs = split_row<T, VEC>(out, C);
    auto scalar = [&](int i) {
        float v[1];
        g(i, v);
        out[i] = from_float<T>(v[0]);
    };
    for (int i = threadIdx.x; i < rs.head; i += blockDim.x) scalar(i);
    for (int i = rs.tail + threadIdx.x; i < C; i += blockDim.x) scalar(i);
    for (int j = threadIdx.x; j < rs.n_vec; j += blockDim.x) {
        float v[VEC];
        const int i0 = rs.head + j * VEC;
        g(i0, v);
        store_vec<T, VEC>(out + i0, v);
    }
}

// VEC elements from p: one 16-byte load when p is aligned, scalars otherwise (parameters
// such as LayerNorm's weight, whose alignment need not match the row's).
template <typename T, int VEC>
__device__ __forceinline__ void load_any(const T* p, float (&out)[VEC]) {
    if (VEC > 1 && reinterpret_cast<unsigned long long>(p) % 16 == 0) {
        load_vec<T, VEC>(p, out);
    } else {
#pragma unroll
        for (int k = 0; k < VEC; ++k) out[k] = to_float(p[k]);
    }
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
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < n_warps ? scratch[lane] : -INFINITY;
    return warp_max(x);
}

constexpr float LOG2E = 1.4426950408889634f;

// GELU, tanh form (GPT-2's "gelu_new"): 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))
__device__ __forceinline__ float gelu_tanh(float v) {
    constexpr float k0 = 0.7978845608028654f;  // sqrt(2 / pi)
    constexpr float k1 = 0.044715f;
    return 0.5f * v * (1.0f + tanhf(k0 * (v + k1 * v * v * v)));
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
