// mma.cuh - tensor-core building blocks for sm_80 and newer: warp-wide mma.sync (16-bit, and
// tf32 with the 3xTF32 split at the end), ldmatrix, cp.async, mbarriers, and the XOR swizzle that keeps
// ldmatrix on row-major tiles free of bank conflicts.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type").
// In a warp, g = lane / 4 and t = lane % 4; a 32-bit register of 16-bit elements holds the
// lower column (or row, for B) in its low half.
//   A, 16 x 16 (m, k), 4 registers:   a[0]: row g,     cols 2t, 2t+1   a[2]: row g,     cols 2t+8, 2t+9
//                                     a[1]: row g + 8, cols 2t, 2t+1   a[3]: row g + 8, cols 2t+8, 2t+9
//   B, 16 x 8 (k, n), 2 registers:    b[0]: rows 2t, 2t+1 of col g     b[1]: rows 2t+8, 2t+9 of col g
//   C and D, 16 x 8 float32, 4 registers: c[0], c[1]: row g, cols 2t, 2t+1
//                                         c[2], c[3]: row g + 8, cols 2t, 2t+1
// So the C fragments of two neighbouring n-tiles, rounded to 16 bits in pairs, are the A
// fragment of one k-step: (c0 c1 | c2 c3) of n-tile 2i and (c0 c1 | c2 c3) of n-tile 2i+1
// are a[0] | a[1] and a[2] | a[3] of k-step i.
//
// ldmatrix.x4 loads four 8 x 8 matrices of 16-bit elements. Lanes 8i .. 8i+7 give the
// shared addresses of matrix i's rows 0..7 (16 contiguous, 16-byte aligned bytes each);
// register i of lane (g, t) receives row g, cols 2t, 2t+1 of matrix i. With .trans it
// receives rows 2t, 2t+1 of col g instead (the fragment of the transposed matrix).
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace g2c {

// The 32-bit shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ---------------------------------------------------------------------------------------
// mma.sync.m16n8k16, float32 accumulate in place: c += a b, for T = __half or __nv_bfloat16
// ---------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                                            unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats rounded to T and packed into one fragment register: `lo` in the low half.
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&h);
}

// ---------------------------------------------------------------------------------------
// ldmatrix: shared memory -> fragments (volatile: it must stay between the barriers around it)
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// ---------------------------------------------------------------------------------------
// cp.async: global -> shared without passing through registers (L1 bypassed, .cg).
// Copies `src_bytes` (0 or 16) bytes and zero-fills the rest of the 16: a row past the end
// of a matrix becomes zeros without a branch around the copy. `src` must be a valid
// address even when src_bytes is 0.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ void cp_async_16(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
                 : "memory");
}

// 4 bytes, through L1 (cp.async.ca: the only kind of that size).
__device__ __forceinline__ void cp_async_4(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// Close the group of copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's committed groups are still in flight. Other
// threads' copies are visible only after a barrier that follows this wait.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// ---------------------------------------------------------------------------------------
// mbarrier (sm_80 and newer): a shared-memory barrier that completes a phase when its count
// of arrivals is reached, then counts again; a waiter names the parity of the phase it waits
// for (a fresh barrier is in phase 0, and phase "-1", parity 1, counts as completed).
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.shared.b64 state, [%0];\n}\n" ::"r"(smem_addr(bar))
                 : "memory");
}

// One arrival once every cp.async this thread issued before has landed (counted in the
// barrier's arrivals: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(unsigned long long* bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// Whether the phase of parity `parity` has completed.
__device__ __forceinline__ bool mbar_done(unsigned long long* bar, unsigned parity) {
    unsigned done;
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.test_wait.parity.shared.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_addr(bar)), "r"(parity)
        : "memory");
    return done != 0;
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// sm_90: one arrival that also expects `bytes` of bulk copies (cp_bulk) before the phase completes.
__device__ __forceinline__ void mbar_arrive_expect(unsigned long long* bar, unsigned bytes) {
    asm volatile("{\n .reg .b64 state;\n mbarrier.arrive.expect_tx.shared.b64 state, [%0], %1;\n}\n" ::"r"(
                     smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
}

// sm_90: `bytes` (a multiple of 16, both addresses 16-byte aligned) from global to shared
// memory by the copy engine, counted on `bar` as they land.
__device__ __forceinline__ void cp_bulk(unsigned dst, const void* src, unsigned bytes, unsigned long long* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}
#endif

// ---------------------------------------------------------------------------------------
// XOR swizzle of a row-major shared tile whose rows are CHUNKS 16-byte chunks (8 or 16).
// Chunk c of row r is stored at chunk c ^ (r % 8) of that row, so the 8 rows one ldmatrix
// phase reads at the same logical chunk fall into 8 different 4-bank groups, and 8
// consecutive chunks of one row (a phase of 16-byte cp.async stores) stay distinct.
// Returns the chunk index from the tile's start; multiply by 16 for bytes.
// Since CHUNKS is a power of two, swizzle(r, c ^ m) == swizzle(r, c) ^ m for m < CHUNKS and
// swizzle(r + 8 i, c) == swizzle(r, c) + 8 i CHUNKS: a lane computes its offset once and
// steps through a tile with an XOR and an add of constants.
// ---------------------------------------------------------------------------------------
template <int CHUNKS> __device__ __forceinline__ int swizzle(int row, int chunk) {
    static_assert(CHUNKS == 8 || CHUNKS == 16, "swizzled rows are 128 or 256 bytes");
    return row * CHUNKS + (chunk ^ (row & 7));
}

// Varlen attention (packed sequences): sequence b holds rows cu_seqlens[b] .. cu_seqlens[b + 1]
// of q, k and v, whose batch strides are 0. Sets Tq = Tk to its length and moves the three
// pointers to its first row (time strides q_st, k_st, v_st); false when query tile q0 starts
// past its end (the grid covers the longest sequence), and the block has nothing to do.
template <typename P, typename S>
__device__ __forceinline__ bool enter_packed_sequence(const int* cu_seqlens, int b, int q0, int& Tq, int& Tk, P& q,
                                                      S q_st, P& k, S k_st, P& v, S v_st) {
    const int s0 = cu_seqlens[b];
    Tq = Tk = cu_seqlens[b + 1] - s0;
    if (q0 >= Tq) return false;
    q += static_cast<long long>(s0) * q_st;
    k += static_cast<long long>(s0) * k_st;
    v += static_cast<long long>(s0) * v_st;
    return true;
}

// =======================================================================================
// float32 on tensor cores: mma.sync.m16n8k8 with tf32 operands and the 3xTF32 split
// (flash_attention_tf32.cu).
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k8" with .tf32), g = lane / 4,
// t = lane % 4, one 32-bit element per register:
//   A, 16 x 8 (m, k), 4 registers:  a[0]: (g, t)   a[1]: (g + 8, t)   a[2]: (g, t + 4)   a[3]: (g + 8, t + 4)
//   B, 8 x 8 (k, n), 2 registers:   b[0]: (k = t, n = g)   b[1]: (k = t + 4, n = g)
//   C and D, 16 x 8 float32:        as for m16n8k16 above: c[0], c[1]: row g, cols 2t, 2t+1;
//                                   c[2], c[3]: row g + 8, cols 2t, 2t+1
// The k dimension of a product may be permuted as long as A and B share the permutation.
// Taking k = t to column 2t and k = t + 4 to column 2t + 1 makes (a[0], a[2]), (a[1], a[3])
// and (b[0], b[1]) pairs of neighbouring columns (one 64-bit shared load each), and makes the
// C fragment of an n-tile the A fragment of the next product: (c[0], c[2], c[1], c[3]).
//
// 3xTF32: x = hi + lo with hi = x rounded to tf32 (10 mantissa bits, to nearest, ties away
// from zero: cvt.rna.tf32.f32) and lo = x - hi (exact in float32) rounded the same way; then
// a b ~ a_hi b_hi + a_hi b_lo + a_lo b_hi, dropping a_lo b_lo (<= 2^-22 |a b|). The small
// products are accumulated first, so that they are not lost below the big one's rounding.
// =======================================================================================

// x rounded to tf32, as float32 bits. For finite x and for +-inf this is bit for bit what
// cvt.rna.tf32.f32 gives: ptxas expands that instruction into the same add and mask plus an
// infinity/NaN test and select (4 instructions on sm_80 and sm_90, checked with nvdisasm).
// A NaN stays a NaN here or in the lo part, so NaNs still propagate through the products.
__device__ __forceinline__ unsigned tf32_rna(float x) { return (__float_as_uint(x) + 0x1000u) & 0xffffe000u; }

// x = hi + lo, both tf32 (5 integer and float instructions)
__device__ __forceinline__ void split_tf32(float x, unsigned& hi, unsigned& lo) {
    hi = tf32_rna(x);
    lo = tf32_rna(x - __uint_as_float(hi));
}

// c += a b, a 16 x 8 and b 8 x 8 in tf32, float32 accumulation in place
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// An A fragment (a[0..3]) and a B fragment (b[0..1]) split into hi and lo parts.
struct FragA3x {
    unsigned hi[4], lo[4];
    __device__ __forceinline__ void split(float a0, float a1, float a2, float a3) {
        split_tf32(a0, hi[0], lo[0]);
        split_tf32(a1, hi[1], lo[1]);
        split_tf32(a2, hi[2], lo[2]);
        split_tf32(a3, hi[3], lo[3]);
    }
};
struct FragB3x {
    unsigned hi[2], lo[2];
    __device__ __forceinline__ void split(float b0, float b1) {
        split_tf32(b0, hi[0], lo[0]);
        split_tf32(b1, hi[1], lo[1]);
    }
};

// c += sum_i a[i] b[i] over N k-steps in 3xTF32, rounded into c once. mma.sync's own
// additions do not round to nearest (published measurements on V100 to A100 find truncation),
// and chaining every product of a row into one accumulator measured 5x (S over D = 64) to 12x
// (O over 1025 keys) the error of a naive float32 attention on an H100. So the N steps go
// into a fresh accumulator, the small terms of every step first (they stay ~2^-11 of the
// result, where truncation costs nothing), then the N big ones, and that partial sum is added
// to c with a float32 add (round to nearest): N truncations relative to a partial sum of 8 N
// products instead of 3 per step relative to the whole sum, for 4 adds per N mma triples.
template <int N>
__device__ __forceinline__ void mma_m16n8k8_3xtf32(float (&c)[4], const FragA3x (&a)[N], const FragB3x (&b)[N]) {
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < N; ++i) {
        mma_m16n8k8_tf32(t, a[i].lo, b[i].hi[0], b[i].hi[1]);
        mma_m16n8k8_tf32(t, a[i].hi, b[i].lo[0], b[i].lo[1]);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) mma_m16n8k8_tf32(t, a[i].hi, b[i].hi[0], b[i].hi[1]);
#pragma unroll
    for (int e = 0; e < 4; ++e) c[e] += t[e];
}

}  // namespace g2c
