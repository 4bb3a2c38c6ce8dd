"""How the cold timer flushes the L2: by writing a buffer twice its size, or by reading one.

    python -m benchmarks.l2_flush

``time_gpu(cold_l2=True)`` (benchmarks/common.py) must start each timed launch with nothing
of its operands in L2. Overwriting a buffer (``dirty=True``) does that, but leaves the L2 full
of dirty lines, which the timed kernel writes back to DRAM as its reads evict them: a kernel
that reads b bytes also pays for up to b bytes of another's writes. Reading the buffer (the
default) leaves clean lines. This times an empty kernel and the decode step's products at
batch 1 (each float16 weight shape of GPT-2 small and XL, ``linear`` and cuBLAS through
``torch.nn.functional.linear``) after each flush. Writes benchmarks/results/l2_flush-<device>.json.
"""

from __future__ import annotations

import cupy as cp
import numpy as np
import torch
import torch.nn.functional as F

import cupy_kernels as K
from benchmarks.common import banner, copy_ceiling_GBps, time_gpu, write_results

# (model, role, N, K) of the weights [N, K]
SHAPES = [("gpt2", "qkv", 2304, 768), ("gpt2", "attn_proj", 768, 768), ("gpt2", "fc", 3072, 768),
          ("gpt2", "mlp_proj", 768, 3072), ("gpt2", "lm_head", 50257, 768),
          ("gpt2-xl", "qkv", 4800, 1600), ("gpt2-xl", "attn_proj", 1600, 1600), ("gpt2-xl", "fc", 6400, 1600),
          ("gpt2-xl", "mlp_proj", 1600, 6400), ("gpt2-xl", "lm_head", 50257, 1600)]


def main():
    print(banner())
    ceiling = copy_ceiling_GBps()
    empty = cp.RawKernel(r'extern "C" __global__ void empty_kernel() {}', "empty_kernel")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    rows = []
    for flush in ("write", "read"):
        dirty = flush == "write"
        t = time_gpu(lambda: empty((sms,), (256,), ()), dirty=dirty)
        rows.append({"bench": "l2_flush", "flush": flush, "impl": "empty", "us": round(t["us"], 3)})
        print(f"{flush:5s} empty kernel {t['us']:.2f} us", flush=True)
        for model, role, N, Kd in SHAPES:
            rng = np.random.default_rng(N + Kd)
            w = cp.asarray(rng.standard_normal((N, Kd), dtype=np.float32).astype(np.float16))
            x = cp.asarray(rng.standard_normal((1, Kd), dtype=np.float32).astype(np.float16))
            out = cp.empty((1, N), np.float16)
            tw, tx = torch.as_tensor(w, device="cuda"), torch.as_tensor(x, device="cuda")
            line = f"{flush:5s} {model:8s} {role:9s} {N:6d}x{Kd:<5d}"
            for impl, fn in (("ours", lambda: K.linear(x, w, out=out)), ("cublas", lambda: F.linear(tx, tw))):
                us = time_gpu(fn, dirty=dirty)["us"]
                pct = 100 * w.nbytes / us / 1e3 / ceiling
                rows.append({"bench": "l2_flush", "flush": flush, "impl": impl, "model": model, "role": role,
                             "N": N, "K": Kd, "dtype": "float16", "batch": 1, "bytes": w.nbytes,
                             "us": round(us, 3), "pct_copy": round(pct, 1)})
                line += f"  {impl} {us:7.2f} us {pct:5.1f}%"
            print(line, flush=True)
            w = tw = None  # freed before the next shape
    print(f"wrote {write_results('l2_flush', rows, {'copy_GBps': round(ceiling, 1)})}")


if __name__ == "__main__":
    main()
