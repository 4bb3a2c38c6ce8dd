// flash_attention.cu - attention over a prompt (prefill) on tensor cores, FlashAttention-2
// style, for float16 and bfloat16 storage with float32 accumulation and softmax statistics.
//
//   out[b, i, h, :] = sum_j softmax_j(q[b,i,h,:] . k[b,j,h,:] * scale) v[b,j,h,:],   j < Tk
//
// varlen (VARLEN, cu_seqlens): q, k, v and out pack sequences along time, sequence b in rows
// cu_seqlens[b] .. cu_seqlens[b + 1]; each attends to its own keys only (Tq = Tk = its length).
//
// causal: query i sees key j only if j <= i + (Tk - Tq), the mask aligned to the bottom
// right as in FlashAttention (the last query sees every key; Tq < Tk is a prompt after a
// cached prefix). A query that sees no key (i < Tq - Tk) gets zeros.
//
// Mapping: one block of WARPS warps per (BR-query tile, head, batch); the tile shape is a
// Tiles struct below, chosen per head dim by the wrapper. Warp w owns BR / WARPS consecutive
// query rows, M_TILES blocks of 16 (the M of mma.sync.m16n8k16); lane (g, t) = (lane / 4,
// lane % 4) holds rows g and g + 8 of each (fragment layouts: mma.cuh). Per key tile of BC:
//   S = Q K^T     Q's A fragments are read by ldmatrix from the Q tile, which stays in shared
//                 memory, at each k-step; each of K's B fragments (ldmatrix on the row-major
//                 K tile) feeds the mma of all M_TILES m-tiles.
//   softmax       online, on S's accumulator fragments: a row's max is the lane's own values
//                 and 2 xor-shuffles over the quad t = 0..3; exp2 with scale * log2 e folded
//                 into one FMA; O and the row sum are rescaled only when the max grows by
//                 more than 2^8 (RESCALE_SLACK); the row sum stays per lane until the end.
//   O += P V      P's C fragments, rounded to T in pairs, are the A fragments of this mma
//                 (no shared memory); V's B fragments come from ldmatrix.trans, each feeding
//                 all M_TILES m-tiles.
// K and V tiles are double-buffered: tile j + 1 is copied by cp.async while tile j is
// computed, one barrier per tile. Shared tiles are row-major with 16-byte chunks XOR-swizzled
// (mma.cuh). Ragged tiles: rows past Tq or Tk are zero-filled by cp.async and keys >= Tk
// score -inf. Causal: key tiles above the block's diagonal are never loaded, and only tiles
// that cross a warp's part of it (or Tk) are masked. The division by the row sum happens
// once, before the store.
//
// Why 32 query rows per warp (measured on an H100 SXM, sm_90, ~1.8 GHz under load): mma.sync
// m16n8k16 (f16 in, f32 accumulate) peaks at 2660 FLOP/clk/SM (630 TFLOP/s, 65% of the
// dense wgmma rate), one 4096-FLOP mma per 1.54 clk per SM. Shared memory gives 128 B/clk/SM
// and a B fragment is 256 bytes. With 16 rows per warp every B fragment feeds one mma: 2 clk
// per mma, a shared-memory ceiling at 77% of the mma.sync peak (the old 64 x 64 kernel: 303
// TFLOP/s at D = 128 against FlashAttention-2's 361). With 32 rows it feeds two: 128 B per
// mma for K and V, plus 32 B for re-reading Q (16 ldmatrix.x4 per warp and 64-key tile, 256
// mma): 1.25 clk per mma, under the mma.sync time, which becomes the ceiling (ldmatrix.x4
// measured at 127.5 B/clk/SM). Holding Q in registers as well does not fit at D = 128 (O 128
// + S 64 + Q 64 registers), and at D = 64 only with 64-key tiles, which ran slower than
// 128-key tiles re-reading Q (the wrapper's table has the numbers).
//
// FLOPs: 4 B H Tq Tk D (half of it when causal and Tq = Tk). Bytes: q and out once; k and v
// once per BR-query tile from L2 (query tiles of one head run side by side, so HBM sees k
// and v about once): BR FLOPs per L2 byte.
//
// Specializations: T in {__half, __nv_bfloat16} x CAUSAL in {false, true} x Tiles for
// D in {64, 128} x VARLEN. Wrapper: cupy_kernels/flash_attention.py   Tests: tests/test_flash_attention_gpu.py
#include "common.cuh"
#include "mma.cuh"

using namespace g2c;

// The block shape, as flash-attention's kernel_traits: head dim D, BR query rows per block,
// K and V tiles of BC keys, and WARPS warps of BR / WARPS consecutive query rows each
// (M_TILES m16 tiles that share every K and V fragment read from shared memory). The wrapper
// picks one per head dim (cupy_kernels/flash_attention.py: TILES, with the measurements).
// Shared memory: two buffers of a K and a V tile, then the Q tile.
template <int D_, int BR_, int BC_, int WARPS_> struct Tiles {
    static constexpr int D = D_, BR = BR_, BC = BC_, WARPS = WARPS_;
    static constexpr int THREADS = 32 * WARPS;
    static constexpr int WARP_ROWS = BR / WARPS;  // query rows of one warp
    static constexpr int M_TILES = WARP_ROWS / 16;
    static constexpr int ROW = 2 * D;             // bytes of one row of a tile
    static constexpr int KV_TILE = BC * ROW;      // bytes of one K or V tile
    static constexpr int SMEM = 4 * KV_TILE + BR * ROW;
    static_assert(D == 64 || D == 128, "head dims 64 and 128");
    static_assert(BR % WARPS == 0 && WARP_ROWS % 16 == 0, "whole m16 tiles per warp");
    static_assert(BC % 16 == 0, "whole k-steps of O += P V");
};

// Rescaling only when a row's max passes its reference by more than 2^RESCALE_SLACK (log2
// units; FlashAttention-4's conditional rescaling): the warp skips the O *= alpha pass (64
// or 128 multiplies per lane) on almost every tile, and scores otherwise exponentiate against
// a stale max, so p <= 2^8: safe in float16, bfloat16 and the float32 sums. O, l and p share
// one reference, so the result is the same up to rounding. Measured on the H100, float16:
// +1% at D = 128 (388.7 against 383.9 TFLOP/s with slack 0), +4% at D = 64 causal.
constexpr float RESCALE_SLACK = 8.0f;

// cp.async copies of ROWS-row tiles of one [n_rows, D] matrix (row stride `stride` elements,
// under 2^30: the wrapper checks) into swizzled shared tiles by THREADS threads. Thread i
// copies chunk i % CHUNKS of rows i / CHUNKS + p PASS_ROWS of the tile (p < PASSES), so each
// warp reads whole rows. It keeps only the matrix's address and a 32-bit row stride (the K
// and V loaders of a thread share the rest), because with 32 query rows per warp the kernel
// runs at 255 registers and these few decide whether ptxas spills. Rows >= n_rows (in the
// last tile only) are zero-filled, their source address being the matrix's first row.
template <typename T, int D, int ROWS, int THREADS> struct TileLoader {
    static constexpr int CHUNKS = D * sizeof(T) / 16;  // 16-byte chunks per row
    static constexpr int PASS_ROWS = THREADS / CHUNKS;  // a multiple of 8: the swizzle repeats
    static constexpr int PASSES = ROWS / PASS_ROWS;
    static_assert(THREADS % CHUNKS == 0 && PASS_ROWS % 8 == 0 && ROWS % PASS_ROWS == 0, "whole passes");

    const char* src;
    int row_bytes;  // the matrix's row stride, bytes
    int n_rows;

    __device__ __forceinline__ TileLoader(const T* src, int stride, int n_rows)
        : src(reinterpret_cast<const char*>(src)), row_bytes(stride * static_cast<int>(sizeof(T))), n_rows(n_rows) {}

    // Issue the copies of rows row0 .. row0 + ROWS - 1 (row0 < n_rows) into the tile at shared address `tile`.
    __device__ __forceinline__ void load(unsigned tile, int row0) const {
        const int row = threadIdx.x / CHUNKS, chunk = threadIdx.x % CHUNKS;
        const unsigned dst = tile + 16 * swizzle<CHUNKS>(row, chunk);
        const char* from = src + static_cast<long long>(row0 + row) * row_bytes + 16 * chunk;
        const long long pass_bytes = static_cast<long long>(PASS_ROWS) * row_bytes;
        if (row0 + ROWS <= n_rows) {
#pragma unroll
            for (int p = 0; p < PASSES; ++p, from += pass_bytes)
                cp_async_16(dst + p * PASS_ROWS * CHUNKS * 16, from, 16);
        } else {
#pragma unroll
            for (int p = 0; p < PASSES; ++p, from += pass_bytes) {
                const bool inside = row + p * PASS_ROWS < n_rows - row0;
                cp_async_16(dst + p * PASS_ROWS * CHUNKS * 16, inside ? from : src, inside ? 16 : 0);
            }
        }
    }
};

template <typename T, bool CAUSAL, typename K, bool VARLEN>
__global__ void __launch_bounds__(K::THREADS)
    flash_attention_kernel(T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k,
                           const T* __restrict__ v, int Tq, int Tk, int H, long long q_sb, int q_st,
                           long long q_sh, long long k_sb, int k_st, long long k_sh, long long v_sb, int v_st,
                           long long v_sh, float scale, const int* __restrict__ cu_seqlens) {
    static_assert(sizeof(T) == 2, "16-bit storage types only");
    constexpr int D = K::D, BR = K::BR, BC = K::BC, MT = K::M_TILES, ROW = K::ROW, TILE = K::KV_TILE;
    constexpr int CHUNKS = D / 8;      // 16-byte chunks per row of a tile
    constexpr int KSTEPS = D / 16;     // k-steps of S = Q K^T
    constexpr int S_TILES = BC / 8;    // n-tiles of S (8 keys each)
    constexpr int O_TILES = D / 8;     // n-tiles of O (8 columns each)
    constexpr int P_STEPS = BC / 16;   // k-steps of O += P V
    // buffer s (s = 0, 1) holds a K tile at 2 s TILE and a V tile at (2 s + 1) TILE (Tiles::SMEM)
    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned k_buf = smem_addr(smem), v_buf = k_buf + TILE;
    const unsigned q_buf = k_buf + 4 * TILE;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = lane / 4, t = lane % 4;
    // causal: the last query tiles see the most keys; run them first for a shorter tail
    const int q0 = (CAUSAL ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * BR;
    const int h = blockIdx.y, b = blockIdx.z;
    if constexpr (VARLEN) {  // sequence b: rows cu_seqlens[b] .. cu_seqlens[b + 1] (mma.cuh)
        if (!enter_packed_sequence(cu_seqlens, b, q0, Tq, Tk, q, q_st, k, k_st, v, v_st)) return;
    }
    q += b * q_sb + h * q_sh;
    k += b * k_sb + h * k_sh;
    v += b * v_sb + h * v_sh;

    // Keys the block's queries see: row i sees j < min(Tk, i + 1 + shift) when causal. The
    // block loads tiles up to its last row's; a warp masks from the first tile that some of
    // its rows do not wholly see (w_full).
    const int shift = Tk - Tq;
    const int n_keys = CAUSAL ? min(Tk, q0 + BR + shift) : Tk;
    const int n_tiles = n_keys > 0 ? (n_keys + BC - 1) / BC : 0;
    const int row0 = q0 + K::WARP_ROWS * warp;  // this warp's first query row
    const int w_open = CAUSAL ? min(Tk, row0 + 1 + shift) : Tk;
    const int w_full = w_open > 0 ? w_open / BC : 0;
    // The mask: element e of S's n-tile n of m-tile mt holds key k0 + 8 n + 2 t + e % 2 of row
    // row0 + 16 mt + g + 8 (e / 2), masked where key >= Tk or (causal) key > row + shift. Both
    // limits less the lane's 2 t are fixed for the loop: a register each, not g, t and shift.
    const int key_end = Tk - 2 * t;
    const int key_last = row0 + g + shift - 2 * t;  // + 16 mt + 8 (e / 2)

    const TileLoader<T, D, BC, K::THREADS> k_loader(k, k_st, Tk), v_loader(v, v_st, Tk);
    TileLoader<T, D, BR, K::THREADS>(q, q_st, Tq).load(q_buf, q0);
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
    const unsigned q_warp = q_buf + K::WARP_ROWS * ROW * warp;  // the warp's rows; m-tile i at + 16 ROW i

    float o[MT][O_TILES][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int n = 0; n < O_TILES; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.0f;
    // per m-tile, rows g and g + 8: the reference max of the scores times scale log2 e (-inf
    // until the row sees a key), and this lane's share of the row sum against it
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) m[mt][r] = -INFINITY, l[mt][r] = 0.0f;
    const float scale_log2 = scale * LOG2E;

    for (int j = 0; j < n_tiles; ++j) {
        cp_async_wait<0>();  // tile j has landed (this thread's copies) ...
        __syncthreads();     // ... and everyone's; every warp is done with tile j - 1
        if (j + 1 < n_tiles) {
            const unsigned next = ((j + 1) % 2) * 2 * TILE;
            k_loader.load(k_buf + next, (j + 1) * BC);
            v_loader.load(v_buf + next, (j + 1) * BC);
            cp_async_commit();
        }
        const unsigned k_tile = k_buf + (j % 2) * 2 * TILE, v_tile = v_buf + (j % 2) * 2 * TILE;
        const int k0 = j * BC;

        // S = Q K^T. The four matrices of keys 16n .. 16n+15 are b0, b1 of n-tile 2n, then of
        // 2n+1; each feeds the mma of every m-tile
        float s[MT][S_TILES][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < KSTEPS; ++kk) {
            unsigned a[MT][4];  // Q's A fragments (a[0..3] = the four matrices in order)
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], q_warp + 16 * ROW * mt + (qv_lane ^ (32 * kk)));
#pragma unroll
            for (int n = 0; n < S_TILES / 2; ++n) {
                unsigned kb[4];
                ldmatrix_x4(kb, k_tile + 16 * ROW * n + (k_lane ^ (32 * kk)));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_m16n8k16<T>(s[mt][2 * n], a[mt], kb[0], kb[1]);
                    mma_m16n8k16<T>(s[mt][2 * n + 1], a[mt], kb[2], kb[3]);
                }
            }
        }

        if (j >= w_full) {  // the tile crosses the diagonal or Tk for some of the warp's rows
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int key = k0 + 8 * n + e % 2;  // less the lane's 2 t
                        if (key >= key_end || (CAUSAL && key > key_last + 16 * mt + 8 * (e / 2))) s[mt][n][e] = -INFINITY;
                    }
        }

        // online softmax: each row's max over the tile (the lane's values, then the quad);
        // where one passes its reference max by more than RESCALE_SLACK, that becomes the new
        // reference and the row's O and l are rescaled by 2^(old - new) (a warp-uniform branch)
        float mx[MT][2];
        bool raise = false;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float x = -INFINITY;
#pragma unroll
                for (int n = 0; n < S_TILES; ++n) x = fmaxf(x, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
                x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, 1));
                x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, 2));
                mx[mt][r] = x * scale_log2;
                raise |= mx[mt][r] > m[mt][r] + RESCALE_SLACK;
            }
        if (__any_sync(FULL_MASK, raise)) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const bool up = mx[mt][r] > m[mt][r] + RESCALE_SLACK;
                    const float alpha = up ? exp2_approx(m[mt][r] - mx[mt][r]) : 1.0f;  // 0 while m is -inf
                    m[mt][r] = up ? mx[mt][r] : m[mt][r];
                    l[mt][r] *= alpha;
#pragma unroll
                    for (int n = 0; n < O_TILES; ++n) {
                        o[mt][n][2 * r] *= alpha;
                        o[mt][n][2 * r + 1] *= alpha;
                    }
                }
        }
        // p = 2^(score scale log2 e - reference); a row that has seen only masked keys keeps
        // reference -inf: subtracting 0 gives p = 0, not NaN
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const float ref = m[mt][r] == -INFINITY ? 0.0f : m[mt][r];
#pragma unroll
                for (int n = 0; n < S_TILES; ++n)
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; ++e) {
                        s[mt][n][e] = exp2_approx(fmaf(s[mt][n][e], scale_log2, -ref));
                        l[mt][r] += s[mt][n][e];
                    }
            }

        // P's A fragments: C fragments of n-tiles 2i and 2i+1 are a[0], a[1] and a[2], a[3]
        unsigned pa[MT][P_STEPS][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < P_STEPS; ++i) {
                pa[mt][i][0] = pack2<T>(s[mt][2 * i][0], s[mt][2 * i][1]);
                pa[mt][i][1] = pack2<T>(s[mt][2 * i][2], s[mt][2 * i][3]);
                pa[mt][i][2] = pack2<T>(s[mt][2 * i + 1][0], s[mt][2 * i + 1][1]);
                pa[mt][i][3] = pack2<T>(s[mt][2 * i + 1][2], s[mt][2 * i + 1][3]);
            }

        // O += P V. ldmatrix.trans of the four matrices of keys 16i .. 16i+15, columns
        // 16n .. 16n+15 gives b0, b1 of O's n-tile 2n, then of 2n+1; each feeds every m-tile
#pragma unroll
        for (int i = 0; i < P_STEPS; ++i) {
#pragma unroll
            for (int n = 0; n < O_TILES / 2; ++n) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb, v_tile + 16 * ROW * i + (qv_lane ^ (32 * n)));
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_m16n8k16<T>(o[mt][2 * n], pa[mt][i], vb[0], vb[1]);
                    mma_m16n8k16<T>(o[mt][2 * n + 1], pa[mt][i], vb[2], vb[3]);
                }
            }
        }
    }

    // varlen: the sequence's rows and length read again (kept in registers through the loop
    // they pushed the largest tiles past 255 registers: ptxas spilled)
    long long row_base = static_cast<long long>(b) * Tq;  // out's row of the sequence's query 0
    if constexpr (VARLEN) {
        row_base = reload_int(cu_seqlens + b);
        Tq = reload_int(cu_seqlens + b + 1) - static_cast<int>(row_base);
    }
    // out is a contiguous [B, Tq, H, D] array. Each lane stores 2 elements (4 bytes) per n-tile
    // and row, straight from registers: out is written once while k and v are read Tq / BR
    // times, so a pass through shared memory for 16-byte stores is not worth its barrier.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float sum = l[mt][r];
            sum += __shfl_xor_sync(FULL_MASK, sum, 1);
            sum += __shfl_xor_sync(FULL_MASK, sum, 2);
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // no visible key: zeros
            const int row = row0 + 16 * mt + g + 8 * r;
            if (row >= Tq) continue;
            T* dst = out + ((row_base + row) * H + h) * D + 2 * t;
#pragma unroll
            for (int n = 0; n < O_TILES; ++n)
                *reinterpret_cast<unsigned*>(dst + 8 * n) = pack2<T>(o[mt][n][2 * r] * inv, o[mt][n][2 * r + 1] * inv);
        }
}
