// gemm.cu - y = x W^T (+ bias, GELU) for many rows of x on tensor cores: the products of a
// (batched) prefill, float16 / bfloat16 with float32 accumulation.
//
//   s[m, n] = sum_k x[m, k] W[n, k]             x [M, K], W [N, K] (out, in), y [M, N], row-major
//   y       = T(s + bias)   or   T(gelu_tanh(s + bias))   (bias optional; added in float32)
//
// Mapping: a block computes a BM x BN tile of y with WM x WN warps, each warp a
// (BM / WM) x (BN / WN) tile held as TM x TN m16n8k16 accumulators (mma.cuh). The k loop
// walks BK = 64 columns at a time through a ring of STAGES shared tiles that cp.async fills
// (zero-filled past M, N and K, so no branch guards the copies), STAGES - 1 tiles ahead of
// the one in use. A tile's rows are 128 bytes, XOR-swizzled (mma.cuh swizzle<8>), so neither
// the 16-byte cp.async stores nor the ldmatrix reads of a phase meet in a bank. x is the A
// operand (ldmatrix.x4 of a 16 x 16 piece), W the B operand as it is stored: W's rows are
// the n columns of B, its k contiguous, which is the "col" layout mma.sync takes, so
// ldmatrix without .trans gives two n-tiles' fragments at once.
//
// Numbers: each output is one float32 accumulator that takes its k16 steps in increasing k,
// so its bits depend on K alone: not on M or N, the tile shape, the row's place in a tile,
// or the grid. A prompt's rows get the same numbers whatever they are packed with (the
// batched prefill relies on this), and every tile shape gives the same bits. No split-K,
// for that reason.
//
// Bytes and FLOPs: 2 M N K FLOPs; x is read N / BN times and W M / BM times (from L2 after
// the first). Compute bound for the prefill (M in the thousands): mma.sync's peak on an
// H100 is about 630 TFLOP/s (wgmma's, which this kernel does not use, 990).
//
// Specializations: T in {__half, __nv_bfloat16} x GemmTiles (cupy_kernels/gemm.py, where
// each is measured) x BIAS x GELU.
// Wrapper: cupy_kernels/gemm.py   Tests: tests/test_gemm_gpu.py   Benchmark: benchmarks/gemm.py
#include "common.cuh"
#include "mma.cuh"

using namespace g2c;

template <int BM_, int BN_, int WM_, int WN_, int STAGES_> struct GemmTiles {
    static constexpr int BM = BM_, BN = BN_, WM = WM_, WN = WN_, STAGES = STAGES_;
    static constexpr int BK = 64;  // 128-byte rows of 16-bit elements: 8 chunks, swizzle<8>
    static constexpr int CHUNKS = BK * 2 / 16;
    static constexpr int THREADS = 32 * WM * WN;
    static constexpr int TM = BM / WM / 16;  // m16 tiles per warp
    static constexpr int TN = BN / WN / 8;   // n8 tiles per warp
    static constexpr int SMEM = STAGES * (BM + BN) * BK * 2;
    // two blocks an SM where two fit in an sm_90 SM's 227 KiB of shared memory (registers
    // capped to match: 128 a thread for 256 threads, which the 128 x 128 tile of 8 warps
    // needs, at 130 uncapped; spill-free either way, checked through NVRTC)
    static constexpr int MIN_BLOCKS = 2 * SMEM <= 227 * 1024 ? 2 : 1;
    static_assert(BM % (16 * WM) == 0 && BN % (16 * WN) == 0, "a warp takes whole 16 x 16 pieces");
    static_assert(BM * CHUNKS % THREADS == 0 && BN * CHUNKS % THREADS == 0, "every thread copies as many chunks");
};

template <typename T, typename Tiles, bool BIAS, bool GELU>
__global__ void __launch_bounds__(Tiles::THREADS, Tiles::MIN_BLOCKS)
    gemm_kernel(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w, const T* __restrict__ bias,
                int M, int N, int K) {
    constexpr int BM = Tiles::BM, BN = Tiles::BN, BK = Tiles::BK, CHUNKS = Tiles::CHUNKS;
    constexpr int STAGES = Tiles::STAGES, THREADS = Tiles::THREADS, TM = Tiles::TM, TN = Tiles::TN;
    constexpr int STAGE = (BM + BN) * CHUNKS;  // 16-byte chunks of one stage: BM rows of x, then BN of W
    extern __shared__ uint4 smem[];
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp / Tiles::WN, wn = warp % Tiles::WN;
    const int k_tiles = (K + BK - 1) / BK;

    // chunk c of row r of a stage: thread i copies rows i / CHUNKS + j THREADS / CHUNKS, chunk i % CHUNKS
    auto load_stage = [&](int stage, int kt) {
        uint4* tile = smem + stage * STAGE;
        const int c = threadIdx.x % CHUNKS, k = kt * BK + c * 8;
#pragma unroll
        for (int j = 0; j < BM * CHUNKS / THREADS; ++j) {
            const int r = threadIdx.x / CHUNKS + j * (THREADS / CHUNKS), m = m0 + r;
            const bool ok = m < M && k < K;
            cp_async_16(smem_addr(tile + swizzle<CHUNKS>(r, c)), ok ? x + static_cast<long long>(m) * K + k : x,
                        ok ? 16 : 0);
        }
#pragma unroll
        for (int j = 0; j < BN * CHUNKS / THREADS; ++j) {
            const int r = threadIdx.x / CHUNKS + j * (THREADS / CHUNKS), n = n0 + r;
            const bool ok = n < N && k < K;
            cp_async_16(smem_addr(tile + swizzle<CHUNKS>(BM + r, c)), ok ? w + static_cast<long long>(n) * K + k : w,
                        ok ? 16 : 0);
        }
    };

    float acc[TM][TN][4];
#pragma unroll
    for (int i = 0; i < TM; ++i)
#pragma unroll
        for (int j = 0; j < TN; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < k_tiles) load_stage(s, s);
        cp_async_commit();  // an empty group past the last tile keeps the wait counts uniform
    }
    // ldmatrix rows of this lane: A pieces rows a_row + 16 i, chunk 2 kk + a_hi; B pieces (two
    // n-tiles each) rows b_row + 16 j, chunk 2 kk + b_hi
    const int a_row = wm * (BM / Tiles::WM) + lane % 16, a_hi = lane / 16;
    const int b_row = BM + wn * (BN / Tiles::WN) + (lane / 16) * 8 + lane % 8, b_hi = (lane / 8) % 2;
    for (int kt = 0; kt < k_tiles; ++kt) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of tile kt have landed ...
        __syncthreads();              // ... and everyone's; and tile kt - 1's stage is no longer read
        const int next = kt + STAGES - 1;
        if (next < k_tiles) load_stage(next % STAGES, next);
        cp_async_commit();
        const uint4* tile = smem + (kt % STAGES) * STAGE;
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            unsigned a[TM][4], b[TN][2];
#pragma unroll
            for (int i = 0; i < TM; ++i)
                ldmatrix_x4(a[i], smem_addr(tile + swizzle<CHUNKS>(a_row + 16 * i, 2 * kk + a_hi)));
#pragma unroll
            for (int j = 0; j < TN / 2; ++j) {
                unsigned r[4];
                ldmatrix_x4(r, smem_addr(tile + swizzle<CHUNKS>(b_row + 16 * j, 2 * kk + b_hi)));
                b[2 * j][0] = r[0];
                b[2 * j][1] = r[1];
                b[2 * j + 1][0] = r[2];
                b[2 * j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) mma_m16n8k16<T>(acc[i][j], a[i], b[j][0], b[j][1]);
        }
    }
    cp_async_wait<0>();  // no copy may still target shared memory when the block exits

    // epilogue: lane (g, t) holds rows g and g + 8, columns 2t and 2t + 1 of each accumulator
    const bool pairs = N % 2 == 0;  // a column pair is one aligned 4-byte store
#pragma unroll
    for (int j = 0; j < TN; ++j) {
        const int n = n0 + wn * (BN / Tiles::WN) + j * 8 + (lane % 4) * 2;
        if (n >= N) continue;
        const bool second = n + 1 < N;
        float b0 = 0.0f, b1 = 0.0f;
        if constexpr (BIAS) {
            b0 = to_float(bias[n]);
            if (second) b1 = to_float(bias[n + 1]);
        }
#pragma unroll
        for (int i = 0; i < TM; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = m0 + wm * (BM / Tiles::WM) + i * 16 + lane / 4 + 8 * h;
                if (m >= M) continue;
                float v0 = acc[i][j][2 * h] + b0, v1 = acc[i][j][2 * h + 1] + b1;
                if constexpr (GELU) {
                    v0 = gelu_tanh(v0);
                    v1 = gelu_tanh(v1);
                }
                T* dst = y + static_cast<long long>(m) * N + n;
                if (pairs) {
                    *reinterpret_cast<unsigned*>(dst) = pack2<T>(v0, v1);
                } else {
                    dst[0] = from_float<T>(v0);
                    if (second) dst[1] = from_float<T>(v1);
                }
            }
    }
}
