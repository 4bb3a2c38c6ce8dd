// flash_attention.cu - attention over a prompt (prefill) on tensor cores, FlashAttention-2
// style, for float16 and bfloat16 storage with float32 accumulation and softmax statistics.
//
//   out[b, i, h, :] = sum_j softmax_j(q[b,i,h,:] . k[b,j,h,:] * scale) v[b,j,h,:],   j < Tk
//
// causal: query i sees key j only if j <= i + (Tk - Tq), the mask aligned to the bottom
// right as in FlashAttention (the last query sees every key; Tq < Tk is a prompt after a
// cached prefix). A query that sees no key (i < Tq - Tk) gets zeros.
//
// Mapping: one block of 4 warps per (64-query tile, head, batch). Warp w owns query rows
// 16w .. 16w+15 of the tile, the M of every mma.sync.m16n8k16 it issues; lane (g, t) =
// (lane / 4, lane % 4) holds rows g and g + 8 (fragment layouts: mma.cuh). Per key tile of 64:
//   S = Q K^T     Q's A fragments stay in registers for the whole loop (loaded once by
//                 ldmatrix); K's B fragments come from ldmatrix on the row-major K tile.
//   softmax       online, on S's accumulator fragments: a row's max is the lane's own 16
//                 values and 2 xor-shuffles over the quad t = 0..3; exp2 with scale * log2 e
//                 folded into one FMA; the row sum stays per lane until the end.
//   O += P V      P's C fragments, rounded to T in pairs, are the A fragments of this mma
//                 (no shared memory); V's B fragments come from ldmatrix.trans.
// K and V tiles are double-buffered: tile j + 1 is copied by cp.async while tile j is
// computed, one barrier per tile. Q is staged in the second buffer before tile 1 needs
// it. Shared tiles are row-major with 16-byte chunks XOR-swizzled (mma.cuh). Ragged tiles:
// rows past Tq or Tk are zero-filled by cp.async and keys >= Tk score -inf. Causal: key
// tiles above the diagonal are never loaded, and only tiles that cross it (or Tk) are masked.
// The division by the row sum happens once, before the store.
//
// FLOPs: 4 B H Tq Tk D (half of it when causal and Tq = Tk). Bytes: q and out once; k and v
// once per 64-query tile from L2 (query tiles of one head run side by side, so HBM sees k
// and v about once): 64 FLOPs per L2 byte.
//
// Specializations: T in {__half, __nv_bfloat16} x D in {64, 128} x CAUSAL in {false, true}.
// Wrapper: cupy_kernels/flash_attention.py   Tests: tests/test_flash_attention_gpu.py
#include "common.cuh"
#include "mma.cuh"

using namespace g2c;

namespace {
// 64 x 64 tiles, 4 warps of 16 query rows: the seed series' shape, small enough to keep Q's
// fragments in registers at D = 128 (32 registers, + 64 for O and 32 for S) and square so
// that a causal query tile crosses the diagonal in one or two key tiles. Not measured yet;
// BR = 128 (8 warps sharing each K and V tile: half the L2 traffic, one block per SM at
// D = 128) is the first alternative to measure, and needs only the wrapper's _BR to follow.
constexpr int BR = 64;  // query rows per block
constexpr int BC = 64;  // keys per tile
constexpr int WARPS = BR / 16;
constexpr int THREADS = 32 * WARPS;
static_assert(BR <= 2 * BC, "the Q tile is staged in the second K and V buffers");
}  // namespace

// cp.async copies of ROWS-row tiles of one [n_rows, D] matrix (row stride `stride` elements)
// into swizzled shared tiles. Thread i copies chunk i % CHUNKS of rows i / CHUNKS + p PASS_ROWS
// of the tile (p < PASSES), so each warp reads whole rows. Its offsets are computed once; a
// full tile costs a 64-bit add per copy. Rows >= n_rows (in the last tile only) are
// zero-filled, their source address being the tile's first row, which exists.
template <typename T, int D, int ROWS> struct TileLoader {
    static constexpr int CHUNKS = D * sizeof(T) / 16;  // 16-byte chunks per row
    static constexpr int PASS_ROWS = THREADS / CHUNKS;  // a multiple of 8: the swizzle repeats
    static constexpr int PASSES = ROWS / PASS_ROWS;
    static_assert(THREADS % CHUNKS == 0 && PASS_ROWS % 8 == 0 && ROWS % PASS_ROWS == 0, "whole passes");

    const char* src;
    long long row_bytes;   // the matrix's row stride, bytes
    long long pass_bytes;  // PASS_ROWS rows
    int n_rows;
    int row;               // this thread's first row in a tile
    long long offset;      // its source offset from the tile's first row, bytes
    unsigned dst;          // its destination offset in a tile, bytes

    __device__ __forceinline__ TileLoader(const T* src, long long stride, int n_rows)
        : src(reinterpret_cast<const char*>(src)),
          row_bytes(stride * sizeof(T)),
          pass_bytes(PASS_ROWS * row_bytes),
          n_rows(n_rows),
          row(threadIdx.x / CHUNKS) {
        const int chunk = threadIdx.x % CHUNKS;
        offset = row * row_bytes + 16 * chunk;
        dst = 16 * swizzle<CHUNKS>(row, chunk);
    }

    // Issue the copies of rows row0 .. row0 + ROWS - 1 (row0 < n_rows) into the tile at shared address `tile`.
    __device__ __forceinline__ void load(unsigned tile, int row0) const {
        const char* first = src + row0 * row_bytes;
        const char* from = first + offset;
        if (row0 + ROWS <= n_rows) {
#pragma unroll
            for (int p = 0; p < PASSES; ++p, from += pass_bytes)
                cp_async_16(tile + dst + p * PASS_ROWS * CHUNKS * 16, from, 16);
        } else {
#pragma unroll
            for (int p = 0; p < PASSES; ++p, from += pass_bytes) {
                const bool inside = row + p * PASS_ROWS < n_rows - row0;
                cp_async_16(tile + dst + p * PASS_ROWS * CHUNKS * 16, inside ? from : first, inside ? 16 : 0);
            }
        }
    }
};

template <typename T, int D, bool CAUSAL>
__global__ void __launch_bounds__(THREADS)
    flash_attention_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k,
                           const T* __restrict__ v, int Tq, int Tk, int H, long long q_sb, long long q_st,
                           long long q_sh, long long k_sb, long long k_st, long long k_sh, long long v_sb,
                           long long v_st, long long v_sh, float scale) {
    static_assert(sizeof(T) == 2, "16-bit storage types only");
    constexpr int CHUNKS = D / 8;      // 16-byte chunks per row of a tile
    constexpr int ROW = D * 2;         // bytes of one row of a tile
    constexpr int TILE = BC * ROW;     // bytes of one K or V tile
    constexpr int KSTEPS = D / 16;     // k-steps of S = Q K^T
    constexpr int S_TILES = BC / 8;    // n-tiles of S (8 keys each)
    constexpr int O_TILES = D / 8;     // n-tiles of O (8 columns each)
    constexpr int P_STEPS = BC / 16;   // k-steps of O += P V
    // buffer s (s = 0, 1) holds a K tile at 2 s TILE and a V tile at (2 s + 1) TILE; Q waits
    // in buffer 1 until tile 1 arrives
    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned k_buf = smem_addr(smem), v_buf = k_buf + TILE, q_buf = k_buf + 2 * TILE;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // causal: the last query tiles see the most keys; run them first for a shorter tail
    const int q0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR;
    const int h = blockIdx.y, b = blockIdx.z;
    q += b * q_sb + h * q_sh;
    k += b * k_sb + h * k_sh;
    v += b * v_sb + h * v_sh;

    // Keys this tile's queries see: row i sees j < min(Tk, i + 1 + shift) when causal.
    // Tiles below n_full are visible to every row and need no mask.
    const int shift = Tk - Tq;
    const int n_keys = CAUSAL ? min(Tk, q0 + BR + shift) : Tk;
    const int n_open = CAUSAL ? min(Tk, q0 + 1 + shift) : Tk;
    const int n_tiles = n_keys > 0 ? (n_keys + BC - 1) / BC : 0;
    const int n_full = n_open > 0 ? n_open / BC : 0;

    const TileLoader<T, D, BC> k_loader(k, k_st, Tk), v_loader(v, v_st, Tk);
    TileLoader<T, D, BR>(q, q_st, Tq).load(q_buf, q0);
    if (n_tiles > 0) {
        k_loader.load(k_buf, 0);
        v_loader.load(v_buf, 0);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    // The rows whose addresses this lane gives to ldmatrix, as byte offsets at k-step (Q, K)
    // or n-tile pair (V) 0; step s XORs the chunk with 2 s (mma.cuh: swizzle).
    // Q, V: lane l gives row l % 16 and chunk l / 16: matrices (rows 0-7, cols 0-7),
    // (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15).
    // K: lane l gives row l % 8 + 8 (l / 16) and chunk (l / 8) % 2: matrices (keys 0-7,
    // d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15).
    const unsigned qv_lane = 16 * swizzle<CHUNKS>(lane % 16, lane / 16);
    const unsigned k_lane = 16 * swizzle<CHUNKS>(lane % 8 + 8 * (lane / 16), (lane / 8) % 2);

    // Q's A fragments (a[0..3] = the four matrices in order) of the warp's 16 rows
    unsigned qa[KSTEPS][4];
#pragma unroll
    for (int kk = 0; kk < KSTEPS; ++kk) ldmatrix_x4(qa[kk], q_buf + 16 * ROW * warp + (qv_lane ^ (32 * kk)));

    float o[O_TILES][4];
#pragma unroll
    for (int n = 0; n < O_TILES; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY};  // running max of the raw scores of rows g, g + 8
    float l[2] = {0.0f, 0.0f};            // this lane's share of their running sums
    const float scale_log2 = scale * LOG2E;

    for (int j = 0; j < n_tiles; ++j) {
        cp_async_wait<0>();  // tile j has landed (this thread's copies) ...
        __syncthreads();     // ... and everyone's; every warp is done with tile j - 1 and Q
        if (j + 1 < n_tiles) {
            const unsigned next = ((j + 1) % 2) * 2 * TILE;
            k_loader.load(k_buf + next, (j + 1) * BC);
            v_loader.load(v_buf + next, (j + 1) * BC);
            cp_async_commit();
        }
        const unsigned k_tile = k_buf + (j % 2) * 2 * TILE, v_tile = v_buf + (j % 2) * 2 * TILE;
        const int k0 = j * BC;

        // S = Q K^T. The four matrices of keys 16n .. 16n+15 are b0, b1 of n-tile 2n, then of 2n+1
        float s[S_TILES][4];
#pragma unroll
        for (int n = 0; n < S_TILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
#pragma unroll
            for (int n = 0; n < S_TILES / 2; ++n)
                mma_m16n16k16<T, false>(s[2 * n], s[2 * n + 1], qa[kk], k_tile + 16 * ROW * n + (k_lane ^ (32 * kk)));
        }

        if (j >= n_full) {  // the tile crosses the diagonal or Tk
#pragma unroll
            for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = k0 + 8 * n + 2 * t + e % 2;
                    const int row = q0 + 16 * warp + g + 8 * (e / 2);
                    if (key >= Tk || (CAUSAL && key > row + shift)) s[n][e] = -INFINITY;
                }
        }

        // online softmax: new row max over the quad, rescale O and l by 2^(scaled old - new max)
        float m_scaled[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = m[r];
#pragma unroll
            for (int n = 0; n < S_TILES; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
            // a row that has seen only masked keys keeps max -inf; subtracting 0 gives p = 0, not NaN
            m_scaled[r] = mx == -INFINITY ? 0.0f : mx * scale_log2;
            const float alpha = exp2_approx(m[r] * scale_log2 - m_scaled[r]);  // 0 while m[r] is -inf
            m[r] = mx;
            l[r] *= alpha;
#pragma unroll
            for (int n = 0; n < O_TILES; ++n) {
                o[n][2 * r] *= alpha;
                o[n][2 * r + 1] *= alpha;
            }
        }
#pragma unroll
        for (int n = 0; n < S_TILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[n][e] = exp2_approx(fmaf(s[n][e], scale_log2, -m_scaled[e / 2]));
                l[e / 2] += s[n][e];
            }

        // P's A fragments: C fragments of n-tiles 2i and 2i+1 are a[0], a[1] and a[2], a[3]
        unsigned pa[P_STEPS][4];
#pragma unroll
        for (int i = 0; i < P_STEPS; ++i) {
            pa[i][0] = pack2<T>(s[2 * i][0], s[2 * i][1]);
            pa[i][1] = pack2<T>(s[2 * i][2], s[2 * i][3]);
            pa[i][2] = pack2<T>(s[2 * i + 1][0], s[2 * i + 1][1]);
            pa[i][3] = pack2<T>(s[2 * i + 1][2], s[2 * i + 1][3]);
        }

        // O += P V. ldmatrix.trans of the four matrices of keys 16i .. 16i+15, columns
        // 16n .. 16n+15 gives b0, b1 of O's n-tile 2n, then of 2n+1
#pragma unroll
        for (int i = 0; i < P_STEPS; ++i) {
#pragma unroll
            for (int n = 0; n < O_TILES / 2; ++n)
                mma_m16n16k16<T, true>(o[2 * n], o[2 * n + 1], pa[i], v_tile + 16 * ROW * i + (qv_lane ^ (32 * n)));
        }
    }

    // out is a contiguous [B, Tq, H, D] array. Each lane stores 2 elements (4 bytes) per n-tile
    // and row, straight from registers: out is written once while k and v are read Tq / 64
    // times, so a pass through shared memory for 16-byte stores is not worth its barrier.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float sum = l[r];
        sum += __shfl_xor_sync(FULL_MASK, sum, 1);
        sum += __shfl_xor_sync(FULL_MASK, sum, 2);
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // no visible key: zeros
        const int row = q0 + 16 * warp + g + 8 * r;
        if (row >= Tq) continue;
        T* dst = out + ((static_cast<long long>(b) * Tq + row) * H + h) * D + 2 * t;
#pragma unroll
        for (int n = 0; n < O_TILES; ++n)
            *reinterpret_cast<unsigned*>(dst + 8 * n) = pack2<T>(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
    }
}
