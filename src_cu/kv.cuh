// kv.cuh - element formats of the KV cache.
//
// A cache holds the model's dtype (float, __half, __nv_bfloat16) as is, or a quantized
// format with one float scale per (sequence, head, position) row of D elements:
//   int8 (signed char)   x ~ q * scale, q = round(x / scale) in [-127, 127], scale = max|x| / 127
//   fp8 (__nv_fp8_e4m3)  x ~ q * scale, q = e4m3(x / scale),                 scale = max|x| / 448
// (448 is e4m3's largest finite value). kv_cache.cu quantizes rows on append;
// decode_attention.cu dequantizes them as it reads. The host stores fp8 caches as uint8.
#pragma once

#include "common.cuh"
#include <cuda_fp8.h>

namespace g2c {

enum class Kv { PLAIN, INT8, FP8 };

template <typename KT> struct KvFormat {  // the model's own dtype: no scales
    static constexpr Kv KIND = Kv::PLAIN;
    static constexpr bool QUANTIZED = false;
};

template <> struct KvFormat<signed char> {
    static constexpr Kv KIND = Kv::INT8;
    static constexpr bool QUANTIZED = true;
    static constexpr float QMAX = 127.0f;
    __device__ static __forceinline__ signed char encode(float x) {
        return static_cast<signed char>(max(-127, min(127, __float2int_rn(x))));
    }
};

template <> struct KvFormat<__nv_fp8_e4m3> {
    static constexpr Kv KIND = Kv::FP8;
    static constexpr bool QUANTIZED = true;
    static constexpr float QMAX = 448.0f;
    // round to nearest even, saturating to +-448 (the __nv_fp8_e4m3 constructor)
    __device__ static __forceinline__ __nv_fp8_e4m3 encode(float x) { return __nv_fp8_e4m3(x); }
};

// 16 bytes of cache elements, loaded raw and converted to float only when used, so that
// the registers of loads in flight hold packed data (N = 4 to 16 elements).
// Plain loads: keeping the cache in L2 from step to step (an evict-last policy on the q|k|v
// product's cache stores and on these loads, branch kv-l2) left the step within 1% (H100,
// the step with PDL at 64 / 264 / 520 / 900 cached keys, us, two rounds of one run,
// benchmarks/results/kv_l2-h100.log, "kvo": GPT-2 small float16 B = 1 227.6 / 237.8 / 264.3 /
// 291.4 against 226.5 / 237.0 / 263.9 / 292.1, XL 1588.9 / 1598.6 / 1706.2 / 1830.3 against
// 1590.2 / 1598.0 / 1710.8 / 1831.5), as if the attention's row loads waited behind the
// weights that the next kernels request meanwhile whether they hit L2 or not.
template <typename KT> struct KvVec {
    static constexpr int N = 16 / sizeof(KT);
    uint4 raw;

    __device__ __forceinline__ void load(const KT* p) { raw = *reinterpret_cast<const uint4*>(p); }
    // the same with the evict-first hint (ld.global.cs): rows read once and not kept
    __device__ __forceinline__ void load_streaming(const KT* p) { raw = __ldcs(reinterpret_cast<const uint4*>(p)); }
    // through L2 only (ld.global.cg)
    __device__ __forceinline__ void load_l2(const KT* p) { raw = __ldcg(reinterpret_cast<const uint4*>(p)); }
    __device__ __forceinline__ void zero() { raw = make_uint4(0u, 0u, 0u, 0u); }

    __device__ __forceinline__ void unpack(float (&out)[N]) const {
        const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
        if constexpr (KvFormat<KT>::KIND == Kv::INT8) {
            // int8 -> float without the slow integer conversion: bias each byte to x + 128,
            // place it in the mantissa of 2^23 (0x4B000000), subtract 2^23 + 128. Exact.
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const unsigned biased = w[i] ^ 0x80808080u;
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    out[4 * i + j] = __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7650 + j)) - 8388736.0f;
            }
        } else if constexpr (KvFormat<KT>::KIND == Kv::FP8) {  // e4m3: pairs to half2 (one cvt on sm_89+)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const __nv_fp8x2_storage_t pair = static_cast<__nv_fp8x2_storage_t>(w[i / 2] >> (16 * (i % 2)));
                const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
                out[2 * i] = f.x;
                out[2 * i + 1] = f.y;
            }
        } else {
            const KT* e = reinterpret_cast<const KT*>(w);
#pragma unroll
            for (int i = 0; i < N; ++i) out[i] = to_float(e[i]);
        }
    }
};

}  // namespace g2c
