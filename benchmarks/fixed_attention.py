"""fixed_attention (the decode step's attention for 16-bit caches, whose bits do not depend on
its block width) against decode_attention as the decode step runs it: bits across widths,
error against float64, and the time of one launch (cold L2) and of launches back to back in a
CUDA graph. (In the decode step: benchmarks/step_variants.py.)

    python -m benchmarks.fixed_attention
"""

from __future__ import annotations

import numpy as np
import cupy as cp

import cupy_kernels as K
from benchmarks.common import banner, time_gpu, time_in_graph, write_results
from cupy_kernels import reference as reference_f64
from cupy_kernels.fixed_attention import THREADS, fixed_attention

CASES = [(1, 12, 264), (1, 12, 40), (1, 12, 520), (8, 12, 264), (64, 12, 264), (1, 25, 264), (8, 25, 264)]
S_MAX = 1024


def main():
    print(banner(), flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for B, H, L in CASES:
        q = cp.asarray(rng.standard_normal((B, H, 64)).astype(np.float32)).astype(cp.float16)
        k = cp.asarray(rng.standard_normal((B, H, S_MAX, 64)).astype(np.float32)).astype(cp.float16)
        v = cp.asarray(rng.standard_normal((B, H, S_MAX, 64)).astype(np.float32)).astype(cp.float16)
        lens_h = np.full(B, L, np.int32)
        lens_h[::3] = max(1, L - 7)  # (not all the same length)
        lens = cp.asarray(lens_h)
        ref = reference_f64.decode_attention(q, k, v, lens_h)
        outs = {t: fixed_attention(q, k, v, lens, threads=t) for t in THREADS}
        base = outs[THREADS[0]]
        same = all(bool(cp.array_equal(o, base)) for o in outs.values())
        err = float(np.abs(base.astype(cp.float64).get() - ref).max() / np.abs(ref).max())
        att = K.decode_attention(q, k, v, lens, split_keys=512, threads=128)
        err_da = float(np.abs(att.astype(cp.float64).get() - ref).max() / np.abs(ref).max())
        deep = H >= 16 and B <= 8
        ahead = 4 if deep else 1
        impls = {"decode_attention": lambda: K.decode_attention(q, k, v, lens, split_keys=512, threads=128,
                                                                  ahead=ahead, out=att)}
        for t in THREADS:
            impls[f"fixed {t}"] = lambda t=t: fixed_attention(q, k, v, lens, threads=t, out=outs[t])
        print(f"B={B} H={H} L={L}: widths bit-equal {same}, max rel err {err:.2e} (decode_attention {err_da:.2e})",
              flush=True)
        for name, fn in impls.items():
            cold = time_gpu(fn, reps=20)["us"]
            graph = time_in_graph(fn, n=50)
            rows.append({"bench": "fixed_attention", "impl": name, "batch": B, "heads": H, "keys": L,
                         "us_cold": round(cold, 3), "us_graph": round(graph, 3), "bit_equal_widths": same,
                         "max_rel_err": err if name != "decode_attention" else err_da})
            print(f"    {name:18s} cold {cold:7.2f} us   graph {graph:7.2f} us", flush=True)
    print(write_results("fixed_attention", rows, {}))


if __name__ == "__main__":
    main()
