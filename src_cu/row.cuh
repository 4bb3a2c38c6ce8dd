// row.cuh - a row of a [rows, C] array held by one thread block, for the one-block-per-row
// kernels (layernorm, softmax).
//
// Any row length moves at full width: the 16-byte-aligned middle of a row as VEC-wide
// vectors, the unaligned head and tail (< VEC elements each) as scalars, so the rows of a
// [rows, 781] array, whose alignment alternates, still move as vectors. Arrays walked
// together must share their alignment (the wrappers check this; otherwise VEC = 1).
//
// Thread t owns the head scalar t, the tail scalar t, and the vectors t, t + blockDim, ...
// Every pass over the row visits the same elements from the same thread, so passes need
// no barrier between them. Two places to keep what a thread owns:
//   RegRow     registers: U vectors per thread (rows up to blockDim * U * VEC elements);
//   SharedRow  shared memory, as float32 at a 0-3 float shift that puts the vectors on
//              16-byte boundaries (float4 accesses, no bank conflicts): any row that fits.
// Both load U vectors per thread before using the first, to keep bytes in flight.
#pragma once

#include "common.cuh"

namespace g2c {

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

// One chunk as loaded, kept packed (4 registers for 16 bytes of any T) until used.
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

// N elements from p: one 16-byte load when p is aligned, scalars otherwise (for
// parameters such as LayerNorm's weight, whose alignment need not match the row's).
template <typename T, int N>
__device__ __forceinline__ void load_any(const T* p, float (&out)[N]) {
    if (N > 1 && reinterpret_cast<unsigned long long>(p) % 16 == 0) {
        load_vec<T, N>(p, out);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = to_float(p[k]);
    }
}

// Walks the chunks thread t owns: f(i0, slot) with slot = -1 (head), -2 (tail) or the
// vector's position u < U; the vector loop stops at n_vec.
template <int VEC, int U, typename F>
__device__ __forceinline__ void owned_chunks(const RowSplit& rs, int C, F&& f) {
    if (threadIdx.x < rs.head) f(static_cast<int>(threadIdx.x), -1);
    if (rs.tail + threadIdx.x < C) f(rs.tail + static_cast<int>(threadIdx.x), -2);
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int j = u * blockDim.x + threadIdx.x;
        if (j < rs.n_vec) f(rs.head + j * VEC, u);
    }
}

// Row in registers. fill(x, y, C, f): f(a, b, i0) turns the loaded chunk a (and b from
// y, or zeros) into the value kept; update(g): g(a, i0) may change the kept chunk;
// write(out, g): g(a, i0, o) computes the chunk o written to out. a, b, o are float[VEC]
// for vectors and float[1] for scalars.
template <typename T, int VEC, int U>
struct RegRow {
    RowSplit rs;
    int C;
    float v[U][VEC];
    float head_val, tail_val;

    __device__ __forceinline__ explicit RegRow(float*) {}  // (same constructor as SharedRow)

    template <typename F>
    __device__ __forceinline__ void fill(const T* x, const T* y, int n, F&& f) {
        C = n;
        rs = split_row<T, VEC>(x, C);
        Packed<T, VEC> pa[U], pb[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = u * blockDim.x + threadIdx.x;
            if (j < rs.n_vec) {
                pa[u].load(x + rs.head + j * VEC);
                if (y) pb[u].load(y + rs.head + j * VEC);
            }
        }
        owned_chunks<VEC, U>(rs, C, [&](int i0, int slot) {
            if (slot < 0) {
                float a[1] = {to_float(x[i0])}, b[1] = {y ? to_float(y[i0]) : 0.0f};
                f(a, b, i0);
                (slot == -1 ? head_val : tail_val) = a[0];
                return;
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {  // constant indices keep v in registers
                if (u != slot) continue;
                float b[VEC];
                pa[u].unpack(v[u]);
                if (y) {
                    pb[u].unpack(b);
                } else {
#pragma unroll
                    for (int k = 0; k < VEC; ++k) b[k] = 0.0f;
                }
                f(v[u], b, i0);
            }
        });
    }

    template <typename G>
    __device__ __forceinline__ void update(G&& g) {
        owned_chunks<VEC, U>(rs, C, [&](int i0, int slot) {
            if (slot < 0) {
                float a[1] = {slot == -1 ? head_val : tail_val};
                g(a, i0);
                (slot == -1 ? head_val : tail_val) = a[0];
                return;
            }
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (u == slot) g(v[u], i0);
        });
    }

    template <typename G>
    __device__ __forceinline__ void write(T* out, G&& g) {
        owned_chunks<VEC, U>(rs, C, [&](int i0, int slot) {
            if (slot < 0) {
                float a[1] = {slot == -1 ? head_val : tail_val}, o[1];
                g(a, i0, o);
                out[i0] = from_float<T>(o[0]);
                return;
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (u != slot) continue;
                float o[VEC];
                g(v[u], i0, o);
                store_vec<T, VEC>(out + i0, o);
            }
        });
    }
};

// Row in shared memory (`smem`: C + 3 floats), same interface as RegRow; the vectors are
// loaded U per thread at a time and the thread's part may be any length.
template <typename T, int VEC, int U>
struct SharedRow {
    RowSplit rs;
    int C;
    float* base;  // element i at base[i]; aligned vectors at 16-byte boundaries

    __device__ __forceinline__ explicit SharedRow(float* smem) : base(smem) {}

    template <int N> __device__ __forceinline__ void put(int i0, const float (&a)[N]) {
        if constexpr (N % 4 == 0) {
#pragma unroll
            for (int q = 0; q < N / 4; ++q)
                reinterpret_cast<float4*>(base + i0)[q] = make_float4(a[4 * q], a[4 * q + 1], a[4 * q + 2], a[4 * q + 3]);
        } else {
#pragma unroll
            for (int k = 0; k < N; ++k) base[i0 + k] = a[k];
        }
    }
    template <int N> __device__ __forceinline__ void get(int i0, float (&a)[N]) const {
        if constexpr (N % 4 == 0) {
#pragma unroll
            for (int q = 0; q < N / 4; ++q) {
                const float4 f = reinterpret_cast<const float4*>(base + i0)[q];
                a[4 * q] = f.x, a[4 * q + 1] = f.y, a[4 * q + 2] = f.z, a[4 * q + 3] = f.w;
            }
        } else {
#pragma unroll
            for (int k = 0; k < N; ++k) a[k] = base[i0 + k];
        }
    }

    // every chunk the thread owns, U vectors per round
    template <typename F>
    __device__ __forceinline__ void chunks(F&& f) {
        if (threadIdx.x < rs.head) f(static_cast<int>(threadIdx.x), 1);
        if (rs.tail + threadIdx.x < C) f(rs.tail + static_cast<int>(threadIdx.x), 1);
        for (int j = threadIdx.x; j < rs.n_vec; j += blockDim.x) f(rs.head + j * VEC, VEC);
    }

    template <typename F>
    __device__ __forceinline__ void fill(const T* x, const T* y, int n, F&& f) {
        C = n;
        rs = split_row<T, VEC>(x, C);
        base += (4 - rs.head % 4) % 4;
        auto scalar = [&](int i) {
            float a[1] = {to_float(x[i])}, b[1] = {y ? to_float(y[i]) : 0.0f};
            f(a, b, i);
            put(i, a);
        };
        if (threadIdx.x < rs.head) scalar(threadIdx.x);
        if (rs.tail + threadIdx.x < C) scalar(rs.tail + threadIdx.x);
        for (int first = threadIdx.x; first < rs.n_vec; first += blockDim.x * U) {
            Packed<T, VEC> pa[U], pb[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int j = first + u * blockDim.x;
                if (j < rs.n_vec) {
                    pa[u].load(x + rs.head + j * VEC);
                    if (y) pb[u].load(y + rs.head + j * VEC);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int j = first + u * blockDim.x;
                if (j >= rs.n_vec) continue;
                float a[VEC], b[VEC];
                pa[u].unpack(a);
                if (y) {
                    pb[u].unpack(b);
                } else {
#pragma unroll
                    for (int k = 0; k < VEC; ++k) b[k] = 0.0f;
                }
                f(a, b, rs.head + j * VEC);
                put(rs.head + j * VEC, a);
            }
        }
    }

    template <typename G>
    __device__ __forceinline__ void update(G&& g) {
        chunks([&](int i0, int n) {
            if (n == 1) {
                float a[1];
                get(i0, a);
                g(a, i0);
                put(i0, a);
            } else {
                float a[VEC];
                get(i0, a);
                g(a, i0);
                put(i0, a);
            }
        });
    }

    template <typename G>
    __device__ __forceinline__ void write(T* out, G&& g) {
        chunks([&](int i0, int n) {
            if (n == 1) {
                float a[1], o[1];
                get(i0, a);
                g(a, i0, o);
                out[i0] = from_float<T>(o[0]);
            } else {
                float a[VEC], o[VEC];
                get(i0, a);
                g(a, i0, o);
                store_vec<T, VEC>(out + i0, o);
            }
        });
    }
};

template <bool IN_REGS, typename A, typename B> struct Pick { using type = A; };
template <typename A, typename B> struct Pick<false, A, B> { using type = B; };

// RegRow when IN_REGS, else SharedRow
template <typename T, int VEC, int U, bool IN_REGS>
using Row = typename Pick<IN_REGS, RegRow<T, VEC, U>, SharedRow<T, VEC, U>>::type;

}  // namespace g2c
