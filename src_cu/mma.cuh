// mma.cuh - tensor-core building blocks for sm_80 and newer: warp-wide mma.sync, ldmatrix,
// cp.async, and the XOR swizzle that keeps ldmatrix on row-major tiles free of bank conflicts.
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

// c0 += a b and c1 += a b' for two neighbouring n-tiles whose B fragments one ldmatrix.x4
// (TRANS: .x4.trans) gives at `addr`: registers 0 and 1 are b[0], b[1] of the first n-tile,
// registers 2 and 3 those of the second. The lanes' addresses decide which is which.
template <typename T, bool TRANS>
__device__ __forceinline__ void mma_m16n16k16(float (&c0)[4], float (&c1)[4], const unsigned (&a)[4], unsigned addr) {
    unsigned b[4];
    if constexpr (TRANS) {
        ldmatrix_x4_trans(b, addr);
    } else {
        ldmatrix_x4(b, addr);
    }
    mma_m16n8k16<T>(c0, a, b[0], b[1]);
    mma_m16n8k16<T>(c1, a, b[2], b[3]);
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

// Close the group of copies issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's committed groups are still in flight. Other
// threads' copies are visible only after a barrier that follows this wait.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

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

}  // namespace g2c
