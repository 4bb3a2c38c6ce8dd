"""The prefill's products (``gemm``) against cuBLAS, every tile shape, in one run.

    python -m benchmarks.gemm [--quick] [--rows M ...]

For each weight shape of GPT-2 small and XL (q|k|v C x 3C, attention out C x C, MLP up
C x 4C, MLP down 4C x C) and M rows of x (prompts of 8 and 64 tokens; one 500-token prompt;
16 of them packed, GPT-2 XL's prefill benchmark; 16,384; or --rows): the median GPU time of
y = x W^T (CUDA events, cold L2, queued behind a sleep kernel so the host's launch cost is not
counted: benchmarks/common.py) and TFLOP/s = 2 M N K / time, for each of gemm's tile shapes
(``impl: ours-tile``; the one the wrapper picks is ``impl: ours``) and for cuBLAS (torch.matmul
on the same memory, whose bits for a row may change with M). The epilogues (bias, GELU) are
timed on the MLP up shape.
Writes benchmarks/results/gemm-<device>.json.
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np
import torch

import cupy_kernels as K
from benchmarks.common import banner, time_gpu, write_results
from cupy_kernels import _build
from cupy_kernels.gemm import TILES, gemm_tiles
from gpt2_cupy import SIZES

DTYPES = {"float16": (np.float16, torch.float16), "bfloat16": (_build.BFLOAT16, torch.bfloat16)}
ROWS = (8, 64, 500, 8000, 16384)


def shapes(size: str) -> dict:
    C = SIZES[size].n_embd
    return {"qkv": (3 * C, C), "attn_proj": (C, C), "fc": (4 * C, C), "mlp_proj": (C, 4 * C)}


def measure(rows: list, size: str, role: str, M: int, N: int, K_: int, dtype: str, epilogue: str = "none") -> None:
    np_dt, t_dt = DTYPES[dtype]
    tx = torch.randn(M, K_, device="cuda").to(t_dt)
    tw = (torch.randn(N, K_, device="cuda") / K_**0.5).to(t_dt)
    tb = torch.randn(N, device="cuda").to(t_dt)
    x, w, b = (cp.from_dlpack(t) for t in (tx, tw, tb))
    out = cp.empty((M, N), dtype=np_dt)
    kw = {} if epilogue == "none" else {"bias": b, "gelu": epilogue == "bias_gelu"}
    flops = 2 * M * N * K_
    base = {"bench": "gemm", "size": size, "role": role, "M": M, "N": N, "K": K_, "dtype": dtype,
            "epilogue": epilogue}
    dev = cp.cuda.Device().id
    chosen = gemm_tiles(M, N, _build.sm_count(dev), _build.smem_per_sm(dev))
    for name, t in TILES.items():
        if t.smem_bytes > _build.smem_optin():
            continue
        r = time_gpu(lambda: K.gemm(x, w, out=out, tiles=name, **kw))
        row = {**base, "impl": "ours" if name == chosen else "ours-tile", "tiles": name, **r,
               "tflops": round(flops / (r["us"] * 1e-6) / 1e12, 1)}
        rows.append(row)
    if epilogue == "none":
        r = time_gpu(lambda: torch.matmul(tx, tw.T))
        rows.append({**base, "impl": "cublas", **r, "tflops": round(flops / (r["us"] * 1e-6) / 1e12, 1)})
    ours = next(r for r in rows[::-1] if r["impl"] == "ours" and r["M"] == M and r["N"] == N and r["K"] == K_)
    cub = rows[-1] if rows[-1]["impl"] == "cublas" else None
    print(f"{size:8s} {role:9s} {dtype:8s} M {M:5d} {epilogue:9s} ours ({chosen}) {ours['tflops']:6.1f} TFLOP/s"
          + (f", cuBLAS {cub['tflops']:6.1f} ({ours['tflops'] / cub['tflops']:.2f}x)" if cub else "")
          + "  tiles: " + ", ".join(f"{r['tiles']} {r['tflops']}" for r in rows if r.get("tiles") and r["M"] == M
                                    and r["N"] == N and r["K"] == K_ and r["dtype"] == dtype
                                    and r["epilogue"] == epilogue), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="GPT-2 small, float16, M = 8000 only")
    ap.add_argument("--rows", nargs="+", type=int, default=list(ROWS), help=f"M values (default {ROWS})")
    args = ap.parse_args()
    print(banner(), flush=True)
    rows: list = []
    for size in ("gpt2",) if args.quick else ("gpt2", "gpt2-xl"):
        for dtype in ("float16",) if args.quick else DTYPES:
            for M in (8000,) if args.quick else args.rows:
                for role, (N, K_) in shapes(size).items():
                    measure(rows, size, role, M, N, K_, dtype)
                N, K_ = shapes(size)["fc"]
                for epi in ("bias", "bias_gelu"):
                    measure(rows, size, "fc", M, N, K_, dtype, epi)
    path = write_results("gemm", rows, {})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
