"""End to end: 512 new tokens from "Hello, I'm a language model," (greedy, batch 1), this
library against transformers (eager, sdpa, and sdpa with a static cache and torch.compile),
in one run. Random weights at the real sizes (the speed is that of the real weights).
Wall-clock time of the whole generate call, prefill included; CUDA-graph rows also give
the share of the weight-read roofline (weight bytes / copy bandwidth of the same run).
Rows ``ours-one-token``: a warm call that makes one token, beside the prefill alone.

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

from benchmarks.common import banner, copy_ceiling_GBps, decode_weight_bytes, write_results
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


def run_hf_compile(size, dtype, repeats):
    """transformers' fastest decode path: a static KV cache and torch.compile of the
    forward (the first call compiles, and is the warm-up)."""
    hf = hf_model(size, getattr(torch, dtype), "sdpa")
    hf.generation_config.cache_implementation = "static"
    hf.forward = torch.compile(hf.forward, fullgraph=True)  # ("reduce-overhead" failed in generate)
    ids = torch.tensor([PROMPT], device="cuda")

    def fn(warm):
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=NEW, do_sample=False)
        return out.shape[1]

    t0 = time.perf_counter()
    fn(True)
    first = time.perf_counter() - t0
    s = timed(fn, repeats)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return s, first


def ours_model(size, dtype, model_cache={}):
    key = (size, dtype)
    if key not in model_cache:
        model_cache.clear()
        gc.collect()
        hf = hf_model(size, torch.float32, "eager")
        model_cache[key] = GPT2.from_hf(hf, dtype)
        del hf
        torch.cuda.empty_cache()
    return model_cache[key]


def run_ours(size, dtype, cache, graph, repeats):
    model = ours_model(size, dtype)

    def fn(warm):
        return len(model.generate(PROMPT, 8 if warm else NEW, use_cache=cache, cuda_graph=graph))

    return timed(fn, repeats)


def one_token(size, dtype, repeats: int = 20) -> dict:
    """A warm generate call that makes one token (its session is kept by the model),
    beside the prefill alone (the prompt's forward on the same model, no cache)."""
    model = ours_model(size, dtype)
    ids = cupy.asarray(PROMPT, dtype=cupy.int32)
    out = cupy.empty((1, model.config.n_embd), dtype=model.dtype)

    def best(fn):
        fn()
        times = []
        for _ in range(repeats):
            cupy.cuda.runtime.deviceSynchronize()
            t0 = time.perf_counter()
            fn()
            cupy.cuda.runtime.deviceSynchronize()
            times.append(time.perf_counter() - t0)
        return min(times)

    call = best(lambda: model.generate(PROMPT, 1))
    prefill = best(lambda: model._prefill(ids, None, 0, out))
    return {"seconds": round(call, 6), "prefill_seconds": round(prefill, 6),
            "beyond_prefill_ms": round((call - prefill) * 1e3, 3)}


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
    cases.insert(4, ("transformers-compile", "gpt2", "float16", True, False))
    rows = []
    for impl, size, dtype, cache, graph in cases:
        extra = {}
        if impl == "ours":
            s = run_ours(size, dtype, cache, graph, args.repeats)
            if cache and graph:  # against the weight-read roofline of the same run
                floor_s = decode_weight_bytes(ours_model(size, dtype)) / (ceilings["copy_GBps"] * 1e9)
                extra = {"roofline_tok_s": round(1 / floor_s, 1), "pct_roofline": round(100 * floor_s * NEW / s, 1)}
        elif impl == "transformers-compile":
            try:
                s, first = run_hf_compile(size, dtype, args.repeats)
            except Exception as err:  # noqa: BLE001  (torch.compile failing is a result too)
                rows.append({"bench": "e2e", "impl": impl, "dtype": dtype, "model": size, "error": repr(err)[:300]})
                print(f"{impl} failed: {err!r}"[:300], flush=True)
                continue
            extra = {"first_call_seconds": round(first, 2)}
        else:
            s = run_hf(size, dtype, impl.split("-")[1], cache, args.repeats)
        row = {"bench": "e2e", "impl": impl, "dtype": dtype, "model": size, "batch": 1, "cache": cache,
               "graph": graph, "new_tokens": NEW, "seconds": round(s, 4), "tok_s": round(NEW / s, 1), **extra}
        rows.append(row)
        print(f"{impl:20s} {size:8s} {dtype:9s} cache={cache!s:5s} graph={graph!s:5s} "
              f"{s:8.3f} s {NEW / s:9.1f} tok/s {extra}", flush=True)
    for size in ("gpt2",) if args.quick else ("gpt2", "gpt2-xl"):
        r = {"bench": "e2e", "impl": "ours-one-token", "dtype": "float16", "model": size, "batch": 1, "cache": True,
             "graph": True, "new_tokens": 1, **one_token(size, "float16")}
        rows.append(r)
        print(f"ours, warm one-token call, {size} float16: {r['seconds'] * 1e3:.2f} ms, prefill alone "
              f"{r['prefill_seconds'] * 1e3:.2f} ms, {r['beyond_prefill_ms']:.2f} ms beyond it", flush=True)
    path = write_results("e2e", rows, ceilings)
    base = {(r["model"], r["dtype"]): r["tok_s"] for r in rows if r["impl"] == "transformers-sdpa" and r["cache"]}
    best_hf = {(r["model"], r["dtype"]): r["tok_s"] for r in rows if r["impl"] == "transformers-compile" and "tok_s" in r}
    print(f"\nwrote {path}")
    no_cache = {r["impl"]: r["seconds"] for r in rows if r["model"] == "gpt2" and r["dtype"] == "float32" and not r["cache"]}
    for impl in ("transformers-eager", "transformers-sdpa"):
        print(f"ours gpt2 float32 without KV cache: {no_cache[impl] / no_cache['ours']:.2f}x {impl} (no cache)")
    for r in rows:
        if r["impl"] == "ours" and r["cache"] and (r["model"], r["dtype"]) in base:
            print(f"ours {r['model']} {r['dtype']} graph={r['graph']}: "
                  f"{r['tok_s'] / base[(r['model'], r['dtype'])]:.1f}x transformers-sdpa"
                  + (f", {r['tok_s'] / best_hf[(r['model'], r['dtype'])]:.1f}x transformers-compile"
                     if (r["model"], r["dtype"]) in best_hf else "")
                  + (f", {r['pct_roofline']}% of the weight-read roofline" if "pct_roofline" in r else ""))


if __name__ == "__main__":
    main()
