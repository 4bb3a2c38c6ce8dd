"""Prefill attention against torch SDPA's backends, in one run.

    python -m benchmarks.attention [--quick]

TFLOP/s = 4 B H S^2 D / time (halved for causal). Ours is ``flash_attention`` (tensor
cores; in float32 as 3xTF32: three tf32 products per float32 product); "ours-cuda-cores"
is the float32 CUDA-core kernel ``causal_attention`` (causal only), in the same run.
torch: ``scaled_dot_product_attention`` pinned to one backend each (flash, efficient,
cudnn, math); a backend that refuses a case is recorded with its error. Median of CUDA
event timings (benchmarks/common.py, warm L2: the inputs are re-read by every tile).
Cases: GPT-2's (12 heads x hd64, causal, batch 8, S = 512 .. 4096) and hd128 non-causal
(16 heads, S = 512 .. 16384, batch x S = 65536 tokens). Peak extra memory of ours and of
the math backend at S = 4096. Writes benchmarks/results/attention-<device>.json and a PNG.
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cupy_kernels as K
from benchmarks.common import banner, plot_series, save_figure, subplots, time_gpu, write_results
from cupy_kernels import _build

DTYPES = {"float32": (np.float32, torch.float32), "float16": (np.float16, torch.float16),
          "bfloat16": (_build.BFLOAT16, torch.bfloat16)}
BACKENDS = {"torch-sdpa-flash": SDPBackend.FLASH_ATTENTION, "torch-sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
            "torch-sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "torch-sdpa-math": SDPBackend.MATH}
MATH_MAX_SCORES = 1 << 31  # the math backend materializes B H S^2 scores: skip it beyond this


def ours_fns(q, k, v, causal, out) -> dict:
    fns = {"ours": lambda: K.flash_attention(q, k, v, causal=causal, out=out)}
    if q.dtype == np.float32 and causal:  # causal_attention is causal only
        fns["ours-cuda-cores"] = lambda: K.causal_attention(q, k, v, out=out)
    return fns


def peak_bytes_ours(fn) -> int:
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    fn()
    cp.cuda.runtime.deviceSynchronize()
    return pool.total_bytes() - before


def peak_bytes_torch(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def measure(rows, dtype, B, H, D, S, causal):
    np_dt, t_dt = DTYPES[dtype]
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=t_dt) for _ in range(3))  # [B, S, H, D]
    qc, kc, vc = (cp.from_dlpack(t) for t in (q, k, v))
    out = cp.empty((B, S, H, D), np_dt)
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    key = {"bench": "attention", "dtype": dtype, "causal": causal, "batch": B, "heads": H, "head_dim": D, "seq": S}
    line = []
    fns = ours_fns(qc, kc, vc, causal, out)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, S, D] views, as SDPA wants
    for impl, backend in BACKENDS.items():
        def run(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        fns[impl] = run
    for impl, fn in fns.items():
        row = {**key, "impl": impl}
        if impl == "torch-sdpa-math" and B * H * S * S > MATH_MAX_SCORES:
            row["refused"] = f"skipped: the math backend would hold {B * H * S * S:.2e} scores"
        else:
            try:
                t = time_gpu(fn, warmup=2, reps=10, cold_l2=False)
                row.update(us=round(t["us"], 1), us_min=round(t["us_min"], 1), us_max=round(t["us_max"], 1),
                           TFLOPs=round(flops / t["us"] / 1e6, 1))
                if S == 4096 and impl in ("ours", "torch-sdpa-math"):
                    row["peak_extra_bytes"] = peak_bytes_ours(fn) if impl == "ours" else peak_bytes_torch(fn)
            except RuntimeError as err:  # the backend refuses this dtype / shape / GPU
                row["refused"] = str(err).splitlines()[0][:200]
        rows.append(row)
        name = impl.replace("torch-sdpa-", "").replace("ours-", "")
        line.append(f"{name} " + (f"{row['TFLOPs']:6.1f}" if "TFLOPs" in row else "  --  "))
    print(f"{dtype:8s} causal={causal!s:5s} B{B:3d} H{H} D{D:3d} S{S:6d} TFLOP/s: " + " | ".join(line), flush=True)
    del q, k, v, qc, kc, vc, out
    torch.cuda.empty_cache()
    cp.get_default_memory_pool().free_all_blocks()


def plot(rows):
    groups = [(d, c, hd) for d in DTYPES for c, hd in ((True, 64), (False, 128))]
    fig, axes = subplots(2, 3, figsize=(16, 8.5))
    for ax, (dtype, causal, hd) in zip(axes.T.flat, groups):
        plot_series(ax, [r for r in rows if r["dtype"] == dtype and r["causal"] == causal and r["head_dim"] == hd
                         and "TFLOPs" in r], "seq", "TFLOPs", log_base=2)
        ax.set_title(f"{dtype}, hd{hd}, {'causal' if causal else 'non-causal'}")
        ax.set_xlabel("sequence length S")
        ax.set_ylabel("TFLOP/s")
        ax.legend(fontsize=7)
    return save_figure(fig, "attention")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="S = 4096 only")
    args = p.parse_args()
    print(banner())
    rows = []
    for dtype in DTYPES:
        for S in ([4096] if args.quick else [512, 1024, 2048, 4096]):
            measure(rows, dtype, 8, 12, 64, S, causal=True)
        for S in ([4096] if args.quick else [512, 1024, 2048, 4096, 8192, 16384]):
            measure(rows, dtype, max(1, 65536 // S), 16, 128, S, causal=False)
    path = write_results("attention", rows, {})
    print(f"wrote {path}\nwrote {plot(rows)}")
    for dtype, causal, hd, base in (("float32", True, 64, "torch-sdpa-efficient"), ("float16", False, 128, "torch-sdpa-flash"),
                                    ("float16", True, 64, "torch-sdpa-flash")):
        sel = {r["impl"]: r for r in rows if r["dtype"] == dtype and r["causal"] == causal and r["head_dim"] == hd
               and r["seq"] == 4096}
        if "TFLOPs" in sel.get("ours", {}) and "TFLOPs" in sel.get(base, {}):
            cudnn = sel.get("torch-sdpa-cudnn", {}).get("TFLOPs")
            cuda_cores = sel.get("ours-cuda-cores", {}).get("TFLOPs")
            print(f"{dtype} hd{hd} {'causal' if causal else 'non-causal'} S4096: ours / {base} = "
                  f"{sel['ours']['TFLOPs'] / sel[base]['TFLOPs']:.2f} (cudnn {cudnn} TFLOP/s"
                  + (f", ours-cuda-cores {cuda_cores} TFLOP/s)" if cuda_cores else ")"))


if __name__ == "__main__":
    main()
