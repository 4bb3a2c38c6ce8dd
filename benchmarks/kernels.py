"""Memory-bound kernels against torch, transformers' NewGELU chain and numpy, in one run.

    python -m benchmarks.kernels [--quick]

For each kernel, dtype and size: the median GPU time (CUDA events, cold L2, launches
queued behind a sleep kernel so the host's launch cost is not counted: see
benchmarks/common.py) and GB/s = bytes that must move / time:

    layernorm            read x, write out                 2 R C s  (+ 2 C s for weight, bias)
    layernorm_residual   read x, y; write sum, out         4 R C s  (+ 2 C s)
    softmax              read x, write out                 2 R C s
    gelu_bias            read x, write out                 2 R C s  (+ C s for the bias)
    embedding            read wte rows, wpe rows; write    3 R C s

(s = bytes per element). At GPT-2 decode sizes the kernels are also timed replayed inside
a CUDA graph (rows with graph: true), the way the decode step runs them.
Writes benchmarks/results/kernels-<device>.json and one PNG per kernel.
"""

from __future__ import annotations

import argparse
import time

import cupy as cp
import numpy as np
import torch
import torch.nn.functional as F

import cupy_kernels as K
from benchmarks.common import (banner, copy_ceiling_GBps, plot_series, save_figure, subplots, time_gpu, time_in_graph,
                               write_results)
from cupy_kernels import _build

DTYPES = {"float32": (np.float32, torch.float32), "float16": (np.float16, torch.float16),
          "bfloat16": (_build.BFLOAT16, torch.bfloat16)}
SIZES = [(1, 768), (8, 1024), (64, 1600), (1024, 768), (4096, 3072), (65536, 768), (16384, 4096), (16, 50257)]
DECODE = [(1, 768), (8, 1024), (64, 1600)]
NUMPY_MAX_ELEMENTS = 1 << 24


def cases(bench, rows, cols, dtype):
    """{impl: callable} for one case, plus the bytes that must move."""
    np_dt, t_dt = DTYPES[dtype]
    s = np.dtype(np_dt).itemsize
    rng = np.random.default_rng(0)
    tx = torch.randn(rows, cols, device="cuda", dtype=torch.float32).to(t_dt)
    ty = torch.randn(rows, cols, device="cuda", dtype=torch.float32).to(t_dt)
    tw = torch.randn(cols, device="cuda").to(t_dt)
    tb = torch.randn(cols, device="cuda").to(t_dt)
    x, y, w, b = (cp.from_dlpack(t) for t in (tx, ty, tw, tb))
    out, out2 = cp.empty_like(x), cp.empty_like(x)
    hx = tx.float().cpu().numpy() if dtype == "float32" and rows * cols <= NUMPY_MAX_ELEMENTS else None
    impls = {}
    if bench == "layernorm":
        nbytes = (2 * rows * cols + 2 * cols) * s
        impls["ours"] = lambda: K.layernorm(x, w, b, out=out)
        impls["torch"] = lambda: F.layer_norm(tx, (cols,), tw, tb)
        if hx is not None:
            hw, hb = tw.float().cpu().numpy(), tb.float().cpu().numpy()

            def np_ln():
                m = hx.mean(-1, keepdims=True)
                return (hx - m) / np.sqrt(((hx - m) ** 2).mean(-1, keepdims=True) + 1e-5) * hw + hb
            impls["numpy"] = np_ln
    elif bench == "layernorm_residual":
        nbytes = (4 * rows * cols + 2 * cols) * s
        impls["ours"] = lambda: K.layernorm_residual(x, y, w, b, out=out, sum_out=out2)
        impls["torch"] = lambda: F.layer_norm(torch.add(tx, ty), (cols,), tw, tb)
        if hx is not None:
            hy, hw, hb = ty.float().cpu().numpy(), tw.float().cpu().numpy(), tb.float().cpu().numpy()

            def np_lnr():
                z = hx + hy
                m = z.mean(-1, keepdims=True)
                return z, (z - m) / np.sqrt(((z - m) ** 2).mean(-1, keepdims=True) + 1e-5) * hw + hb
            impls["numpy"] = np_lnr
    elif bench == "softmax":
        nbytes = 2 * rows * cols * s
        impls["ours"] = lambda: K.softmax(x, out=out)
        impls["torch"] = lambda: torch.softmax(tx, dim=-1)
        if hx is not None:
            def np_sm():
                e = np.exp(hx - hx.max(-1, keepdims=True))
                return e / e.sum(-1, keepdims=True)
            impls["numpy"] = np_sm
    elif bench == "gelu_bias":
        from transformers.activations import NewGELUActivation

        newgelu = NewGELUActivation()
        nbytes = (2 * rows * cols + cols) * s
        impls["ours"] = lambda: K.bias_gelu(x, b, out=out)
        impls["torch"] = lambda: F.gelu(tx + tb, approximate="tanh")
        impls["transformers-newgelu"] = lambda: newgelu(tx + tb)
        if hx is not None:
            hb = tb.float().cpu().numpy()

            def np_gelu():
                v = hx + hb
                return 0.5 * v * (1 + np.tanh(0.7978845608028654 * (v + 0.044715 * v ** 3)))
            impls["numpy"] = np_gelu
    elif bench == "embedding":
        V, P = 50257, 1024
        nbytes = 3 * rows * cols * s
        twte = torch.randn(V, cols, device="cuda").to(t_dt)
        twpe = torch.randn(P, cols, device="cuda").to(t_dt)
        tids = torch.as_tensor(rng.integers(0, V, rows), device="cuda", dtype=torch.int32)
        tpos = torch.as_tensor(rng.integers(0, P, rows), device="cuda", dtype=torch.int32)
        wte, wpe, ids, pos = (cp.from_dlpack(t) for t in (twte, twpe, tids, tpos))
        impls["ours"] = lambda: K.embedding(ids, wte, wpe, pos, out=out)
        impls["torch"] = lambda: F.embedding(tids, twte) + F.embedding(tpos, twpe)
        if hx is not None:
            hwte, hwpe = twte.float().cpu().numpy(), twpe.float().cpu().numpy()
            hids, hpos = tids.cpu().numpy(), tpos.cpu().numpy()
            impls["numpy"] = lambda: hwte[hids] + hwpe[hpos]
    return impls, nbytes


def time_numpy(fn, reps=3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def plot(rows, ceiling):
    paths = []
    for bench in dict.fromkeys(r["bench"] for r in rows):
        fig, axes = subplots(1, 3, figsize=(15, 4.5), sharey=True)
        for ax, dtype in zip(axes, DTYPES):
            plot_series(ax, [r for r in rows if r["bench"] == bench and r["dtype"] == dtype and not r["graph"]],
                        "elements", "GBps")
            ax.axhline(ceiling, color="k", linestyle="--", label="copy ceiling (same run)")
            ax.set_yscale("log")
            ax.set_title(f"{bench}, {dtype}")
            ax.set_xlabel("elements (rows x cols)")
        axes[0].set_ylabel("GB/s (bytes that must move / time)")
        axes[0].legend(fontsize=8)
        paths.append(save_figure(fig, f"kernels-{bench}"))
    return paths


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="float32 and float16, fewer sizes")
    args = p.parse_args()
    print(banner())
    ceiling = copy_ceiling_GBps()
    print(f"copy ceiling {ceiling:.0f} GB/s")
    dtypes = ["float32", "float16"] if args.quick else list(DTYPES)
    sizes = [SIZES[0], SIZES[5], SIZES[6]] if args.quick else SIZES
    rows_out = []
    for bench in ("layernorm", "layernorm_residual", "softmax", "gelu_bias", "embedding"):
        for dtype in dtypes:
            for rows, cols in sizes:
                if bench == "embedding" and cols > 4096:
                    continue
                impls, nbytes = cases(bench, rows, cols, dtype)
                key = {"bench": bench, "dtype": dtype, "rows": rows, "cols": cols, "elements": rows * cols}
                line = []
                for impl, fn in impls.items():
                    if impl == "numpy":
                        us, spread = time_numpy(fn), {}
                    else:
                        t = time_gpu(fn, dirty=True)  # (they write what they read: benchmarks/common.py _L2Flush)
                        us, spread = t["us"], {"us_min": round(t["us_min"], 2), "us_max": round(t["us_max"], 2)}
                    rows_out.append({**key, "impl": impl, "graph": False, "us": round(us, 2), **spread,
                                     "GBps": round(nbytes / us / 1e3, 1)})
                    line.append(f"{impl} {us:9.2f} us {nbytes / us / 1e3:7.0f} GB/s")
                if (rows, cols) in DECODE:
                    us = time_in_graph(impls["ours"])
                    rows_out.append({**key, "impl": "ours", "graph": True, "us": round(us, 2),
                                     "GBps": round(nbytes / us / 1e3, 1)})
                    line.append(f"graph {us:6.2f} us")
                print(f"{bench:18s} {dtype:8s} {rows:6d}x{cols:<6d} " + " | ".join(line), flush=True)
    path = write_results("kernels", rows_out, {"copy_GBps": round(ceiling, 1)})
    print(f"wrote {path}")
    for png in plot(rows_out, ceiling):
        print(f"wrote {png}")
    # the bars: largest size at >= 90% of the copy ceiling; never slower than torch
    for bench in ("layernorm", "softmax", "gelu_bias"):
        for dtype in dtypes:
            sel = [r for r in rows_out if r["bench"] == bench and r["dtype"] == dtype and not r["graph"]]
            big = max(r["elements"] for r in sel)
            ours_big = [r for r in sel if r["impl"] == "ours" and r["elements"] == big][0]
            worst = min((o["us"] and t["us"] / o["us"], o["rows"], o["cols"]) for o in sel if o["impl"] == "ours"
                        for t in sel if t["impl"] == "torch" and t["rows"] == o["rows"] and t["cols"] == o["cols"])
            print(f"{bench:10s} {dtype:8s}: largest {ours_big['GBps'] / ceiling:5.1%} of copy; "
                  f"worst torch/ours time ratio {worst[0]:.2f} at {worst[1]}x{worst[2]}")


if __name__ == "__main__":
    main()
