// linear.cu - y = x W^T + bias (optionally GELU) for a few rows: the decode step's
// matrix-vector products, and the LM head.
//
//   y[b, n] = act(sum_k x[b, k] W[n, k] + bias[n]),  W in (out, in) layout, act = id | gelu
//
// Mapping: one warp per output feature n (8 warps per block). The warp streams W's row n
// once with 16-byte loads and dots it with up to ROWS rows of x at a time (x is small and
// stays in L1/L2), then reduces over the warp with shuffles. Each output's reduction order
// depends only on K, never on how many rows are in the batch, so a sequence gets the same
// bits alone or batched. OutT may be float (logits) when T is half precision.
// Bytes: N K sizeof(T) for W (read once for B <= ROWS); 2 B N K FLOPs: bandwidth bound.
// Used inside the decode step instead of cuBLAS, which cannot run in a captured CUDA graph.
//
// Specializations: T in {float, __half, __nv_bfloat16} x OutT in {T, float} x VEC in
// {1, 16/sizeof(T)} x GELU.
// Wrapper: cupy_kernels/linear.py   Tests: tests/test_kernels_gpu.py
#include "common.cuh"

using namespace g2c;

namespace {
// Not tuned yet (decode-step GEMV speed is measured end to end only, in benchmarks/e2e.py).
constexpr int WARPS = 8;
constexpr int ROWS = 4;  // rows of x per pass over W's row
}  // namespace

template <typename T, typename OutT, int VEC, bool GELU>
__global__ void __launch_bounds__(WARPS * 32)
    linear_rows_kernel(OutT* __restrict__ y, const T* __restrict__ x, const T* __restrict__ W,
                       const T* __restrict__ bias, int B, int N, int K) {
    const int lane = threadIdx.x & 31;
    const int n = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (n >= N) return;  // whole warps leave together
    const T* w = W + static_cast<long long>(n) * K;
    const float bn = bias != nullptr ? to_float(bias[n]) : 0.0f;

    for (int b0 = 0; b0 < B; b0 += ROWS) {
        float acc[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
#pragma unroll 4  // W loads in flight; ptxas's default unrolling spilled on sm_80-89
        for (int k = lane * VEC; k < K; k += 32 * VEC) {
            float wv[VEC];
            load_vec<T, VEC>(w + k, wv);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (b0 + r < B) {
                    float xv[VEC];
                    load_vec<T, VEC>(x + static_cast<long long>(b0 + r) * K + k, xv);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[r] = fmaf(xv[i], wv[i], acc[r]);
                }
            }
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const float s = warp_sum(acc[r]);
            if (lane == r && b0 + r < B) {
                float v = s + bn;
                if constexpr (GELU) v = gelu_tanh(v);
                y[static_cast<long long>(b0 + r) * N + n] = from_float<OutT>(v);
            }
        }
    }
}
