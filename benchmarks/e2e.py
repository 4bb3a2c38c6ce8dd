"""End to end: 512 new tokens from "Hello, I'm a language model," (greedy, batch 1), this
library against transformers, in one run. Random weights at the real sizes (the speed is
that of the real weights). Wall-clock time of the whole generate call, prefill included.

    python -m benchmarks.e2e [--new-tokens 512] [--quick]

Writes benchmarks/results/e2e-<device>.json and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import time

import cupy
import torch
import transformers

from benchmarks.common import banner, copy_ceiling_GBps, write_results
from gpt2_cupy import GPT2, SIZES

PROMPT = [15496, 11, 314, 1101, 257, 3303, 2746, 11]


def hf_model(size: str, dtype: torch.dtype, attn: str):
    torch.manual_seed(0)
    with torch.device("cuda"):
        cfg = SIZES[size].to_hf()
        cfg._attn_implementation = attn
        hf = transformers.GPT2LMHeadModel(cfg)
    hf = hf.to(dtype).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


def timed(fn, repeats: int) -> float:
    """Best of ``repeats`` wall-clock seconds, after one short warm-up inside fn(True)."""
    fn(True)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        n = fn(False)
        cupy.cuda.runtime.deviceSynchronize()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    assert n == len(PROMPT) + NEW, f"generated {n - len(PROMPT)} tokens, expected {NEW}"
    return best


def run_hf(size, dtype, attn, cache, repeats):
    hf = hf_model(size, getattr(torch, dtype), attn)
    ids = torch.tensor([PROMPT], device="cuda")

    def fn(warm):
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=8 if warm else NEW, do_sample=False, use_cache=cache)
        return out.shape[1]

    s = timed(fn, repeats)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return s


def run_ours(size, dtype, cache, graph, repeats, model_cache={}):
    key = (size, dtype)
    if key not in model_cache:
        model_cache.clear()
        gc.collect()
        hf = hf_model(size, torch.float32, "eager")
        model_cache[key] = GPT2.from_hf(hf, dtype)
        del hf
        torch.cuda.empty_cache()
    model = model_cache[key]

    def fn(warm):
        return len(model.generate(PROMPT, 8 if warm else NEW, use_cache=cache, cuda_graph=graph))

    return timed(fn, repeats)


def main():
    global NEW
    p = argparse.ArgumentParser()
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="GPT-2 small only")
    args = p.parse_args()
    NEW = args.new_tokens
    print(banner())
    ceilings = {"copy_GBps": round(copy_ceiling_GBps(), 1)}
    cases = [  # (impl, model, dtype, cache, graph)
        ("transformers-eager", "gpt2", "float32", False, False),
        ("transformers-sdpa", "gpt2", "float32", False, False),
        ("transformers-sdpa", "gpt2", "float32", True, False),
        ("transformers-sdpa", "gpt2", "float16", True, False),
        ("ours", "gpt2", "float32", False, False),
        ("ours", "gpt2", "float32", True, False),
        ("ours", "gpt2", "float16", True, False),
        ("ours", "gpt2", "bfloat16", True, False),
        ("ours", "gpt2", "float32", True, True),
        ("ours", "gpt2", "float16", True, True),
        ("ours", "gpt2", "bfloat16", True, True),
    ]
    if not args.quick:
        cases += [
            ("transformers-sdpa", "gpt2-xl", "float16", True, False),
            ("ours", "gpt2-xl", "float16", True, False),
            ("ours", "gpt2-xl", "float16", True, True),
        ]
    rows = []
    for impl, size, dtype, cache, graph in cases:
        if impl == "ours":
            s = run_ours(size, dtype, cache, graph, args.repeats)
        else:
            s = run_hf(size, dtype, impl.split("-")[1], cache, args.repeats)
        row = {"bench": "e2e", "impl": impl, "dtype": dtype, "model": size, "batch": 1, "cache": cache,
               "graph": graph, "new_tokens": NEW, "seconds": round(s, 4), "tok_s": round(NEW / s, 1)}
        rows.append(row)
        print(f"{impl:20s} {size:8s} {dtype:9s} cache={cache!s:5s} graph={graph!s:5s} "
              f"{s:8.3f} s {NEW / s:9.1f} tok/s", flush=True)
    path = write_results("e2e", rows, ceilings)
    base = {(r["model"], r["dtype"]): r["tok_s"] for r in rows if r["impl"] == "transformers-sdpa" and r["cache"]}
    print(f"\nwrote {path}")
    no_cache = {r["impl"]: r["seconds"] for r in rows if r["model"] == "gpt2" and r["dtype"] == "float32" and not r["cache"]}
    for impl in ("transformers-eager", "transformers-sdpa"):
        print(f"ours gpt2 float32 without KV cache: {no_cache[impl] / no_cache['ours']:.2f}x {impl} (no cache)")
    for r in rows:
        if r["impl"] == "ours" and r["cache"] and (r["model"], r["dtype"]) in base:
            print(f"ours {r['model']} {r['dtype']} graph={r['graph']}: "
                  f"{r['tok_s'] / base[(r['model'], r['dtype'])]:.1f}x transformers-sdpa")


if __name__ == "__main__":
    main()
