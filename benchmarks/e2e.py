"""End to end: 512 new tokens from "Hello, I'm a language model," (greedy, batch 1, and
batches of the same prompt), this library against transformers (eager, sdpa, and sdpa with
a static cache and torch.compile), in one run. Random weights at the real sizes (the speed
is that of the real weights). Wall-clock time of the whole generate call, prefill included.
CUDA-graph rows also give the share of the weight-read roofline (weight bytes / copy
bandwidth of the same run: ``pct_roofline``) and of the floor with the cache (a step reads
the weights once and each row's cache at its mean length over the call: ``pct_floor``). Their
copy bandwidth is measured at the run's start and again at its end, and the shares take the
higher (``ceilings``: copy_GBps, copy_GBps_start, copy_GBps_end): one measurement moved by 4%
between two runs minutes apart on one H100 (2.84 against 2.95 TB/s), and a share against the
lower would overstate the step. (The workload below takes the one at its start.)
Rows ``ours-one-token``: a warm call that makes one token, beside the prefill alone.

    python -m benchmarks.e2e [--new-tokens 512] [--quick] [--batches 8 64 256]
    python -m benchmarks.e2e --workload 1000

Writes benchmarks/results/e2e-<device>.json and prints a table. ``--workload N``: N prompts
drawn with a fixed seed (4-512 tokens, max_new_tokens 16-512 each, end-of-text enabled),
GPT-2 small float16, this library's continuous batching against transformers in padded
batches of 64, total new tokens / wall seconds, beside the floor (weights once a step at
full slots, and each token's cache rows, at the copy bandwidth of the run); and 16 prompts
of 500 tokens prefilled on GPT-2 XL. Into benchmarks/results/e2e_workload-<device>.json.
"""

from __future__ import annotations

import argparse
import gc
import time

import cupy
import numpy
import torch
import transformers

from benchmarks.common import banner, best_host_seconds, copy_ceiling_GBps, decode_weight_bytes, write_results
from gpt2_cupy import GPT2, SIZES

PROMPT = [15496, 11, 314, 1101, 257, 3303, 2746, 11]


def roofline_fields(seconds: float, batch: int, new: int, weight_bytes: float, kv_row_bytes: float,
                    copy_GBps: float) -> dict:
    """A CUDA-graph row's shares: ``new`` tokens a row in ``seconds`` against the weight-read
    roofline (every weight once a step at ``copy_GBps``) and the floor with the cache (also
    ``kv_row_bytes``, a row's cache at its mean length, for each of ``batch`` rows)."""
    weights_s = weight_bytes / (copy_GBps * 1e9)
    floor_s = weights_s + batch * kv_row_bytes / (copy_GBps * 1e9)
    return {"roofline_tok_s": round(batch / weights_s, 1), "pct_roofline": round(100 * weights_s * new / seconds, 1),
            "floor_tok_s": round(batch / floor_s, 1), "pct_floor": round(100 * floor_s * new / seconds, 1)}


def run_ceilings(start_GBps: float, end_GBps: float) -> dict:
    """The run's ``ceilings``: both copy bandwidth measurements, and the higher as copy_GBps,
    the one its shares take (a share against the lower would overstate the step)."""
    return {"copy_GBps": max(start_GBps, end_GBps), "copy_GBps_start": start_GBps, "copy_GBps_end": end_GBps}


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
    """Best of ``repeats`` wall-clock seconds, after one warm-up call fn(True)."""
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


def run_hf(size, dtype, attn, cache, repeats, batch=1):
    hf = hf_model(size, getattr(torch, dtype), attn)
    ids = torch.tensor([PROMPT] * batch, device="cuda")

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


def run_ours(size, dtype, cache, graph, repeats, batch=1):
    model = ours_model(size, dtype)
    prompts = [PROMPT] * batch if batch > 1 else PROMPT

    def fn(warm):  # (the warm-up makes as many tokens: its session, of the same cache bucket, is reused)
        out = model.generate(prompts, NEW, use_cache=cache, cuda_graph=graph)
        return len(out[0] if batch > 1 else out)

    return timed(fn, repeats)


def one_token(size, dtype, repeats: int = 20) -> dict:
    """A warm generate call that makes one token (its session is kept by the model),
    beside the prefill alone: the prompt's forward into a KV cache of its own, warm too, as
    generate runs it (a recorded prefill, on a stream of its own: its CUDA graph, model.py
    _forward)."""
    from gpt2_cupy.model import KVCache

    model = ours_model(size, dtype)
    ids = [numpy.asarray(PROMPT)]
    out = cupy.empty((1, model.config.n_embd), dtype=model.dtype)
    kv = KVCache(model.config, 1, len(PROMPT) + 1, model.dtype)

    stream = cupy.cuda.Stream(non_blocking=True)

    def prefill_alone():
        with stream:
            model._prefill(ids, kv, [0], out)

    call = best_host_seconds(lambda: model.generate(PROMPT, 1), repeats)
    prefill = best_host_seconds(prefill_alone, repeats)
    return {"seconds": round(call, 6), "prefill_seconds": round(prefill, 6),
            "beyond_prefill_ms": round((call - prefill) * 1e3, 3)}


def workload(n: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """n prompts of 4-512 random tokens, each with its own max_new_tokens of 16-512."""
    rng = numpy.random.default_rng(seed)
    lens, news = rng.integers(4, 513, n), rng.integers(16, 513, n)
    return [rng.integers(0, 50256, int(k)).tolist() for k in lens], [int(m) for m in news]


def run_workload(n: int, ceiling_GBps: float, slots=(64, 256), hf_batch: int = 64) -> list[dict]:
    """The throughput workload: continuous batching against transformers in padded batches
    of ``hf_batch`` (each batch runs to its longest max_new_tokens; only the tokens a prompt
    asked for, up to end-of-text, count), GPT-2 small float16, end-of-text enabled."""
    prompts, news = workload(n)
    eos = 50256
    rows = []
    model = ours_model("gpt2", "float16")
    cfg = model.config
    row_kv = 2 * cfg.n_layer * cfg.n_embd * model.dtype.itemsize  # cache bytes a token reads per cached row
    base = {"bench": "e2e_workload", "model": "gpt2", "dtype": "float16", "prompts": n, "new_tokens_asked": sum(news)}
    for b in slots:
        # a warm-up pass of the same workload: its session and every kernel it compiles are the
        # timed pass's. (A short warm-up of 8 prompts left them in the timed pass: on a fresh
        # H100, 33,880 / 50,590 tok/s with 64 / 256 slots; the same code with this warm-up, next
        # on the same machine, 63,494 / 71,312.)
        model.generate(prompts, news, max_batch=b, eos_token_id=eos, progress=False)
        cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        out = model.generate(prompts, news, max_batch=b, eos_token_id=eos, progress=False)
        cupy.cuda.runtime.deviceSynchronize()
        s = time.perf_counter() - t0
        made = [len(o) - len(p) for o, p in zip(out, prompts)]
        kv = sum(row_kv * sum(range(len(p), len(p) + m)) for p, m in zip(prompts, made))
        floor_s = (-(-sum(made) // b) * decode_weight_bytes(model) + kv) / (ceiling_GBps * 1e9)
        rows.append({**base, "impl": "ours-continuous", "batch": b, "seconds": round(s, 3), "tokens": sum(made),
                     "tok_s": round(sum(made) / s, 1), "floor_tok_s": round(sum(made) / floor_s, 1),
                     "pct_floor": round(100 * floor_s / s, 1)})
        print(rows[-1], flush=True)
    hf = hf_model("gpt2", torch.float16, "sdpa")
    made, t0 = 0, time.perf_counter()
    for i in range(0, n, hf_batch):
        batch, want = prompts[i:i + hf_batch], news[i:i + hf_batch]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[eos] * (width - len(p)) + p for p in batch], device="cuda")  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device="cuda")
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=mask, max_new_tokens=max(want), do_sample=False,
                              eos_token_id=eos, pad_token_id=eos)[:, width:].tolist()
        for g, m in zip(gen, want):
            g = g[:m]
            made += g.index(eos) + 1 if eos in g else len(g)
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    rows.append({**base, "impl": "transformers-sdpa-padded", "batch": hf_batch, "seconds": round(s, 3),
                 "tokens": made, "tok_s": round(made / s, 1)})
    print(rows[-1], flush=True)
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def prefill_xl(repeats: int = 3) -> dict:
    """16 prompts of 500 tokens on GPT-2 XL float16: a warm generate call that makes one
    token each (the prefills and their first tokens)."""
    model = ours_model("gpt2-xl", "float16")
    prompts = [numpy.random.default_rng(i).integers(0, 50256, 500).tolist() for i in range(16)]
    model.generate(prompts, 1, max_batch=16)
    best = float("inf")
    for _ in range(repeats):
        cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        model.generate(prompts, 1, max_batch=16)
        cupy.cuda.runtime.deviceSynchronize()
        best = min(best, time.perf_counter() - t0)
    return {"bench": "e2e_workload", "impl": "ours-prefill", "model": "gpt2-xl", "dtype": "float16", "batch": 16,
            "prompt_tokens": 500, "seconds": round(best, 4)}


def main():
    global NEW
    p = argparse.ArgumentParser()
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="GPT-2 small only")
    p.add_argument("--batches", nargs="*", type=int, default=[8, 64, 256],
                   help="batch sizes of the batched rows (the same prompt in every row)")
    p.add_argument("--workload", type=int, metavar="N",
                   help="only the throughput workload of N prompts (and the GPT-2 XL prefill row), "
                        "into e2e_workload-<device>.json")
    args = p.parse_args()
    NEW = args.new_tokens
    print(banner())
    ceilings = {"copy_GBps": round(copy_ceiling_GBps(), 1)}
    if args.workload:
        rows = run_workload(args.workload, ceilings["copy_GBps"])
        rows.append(prefill_xl())
        print(rows[-1])
        print(f"wrote {write_results('e2e_workload', rows, ceilings)}")
        return
    cases = [  # (impl, model, dtype, cache, graph[, batch])
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
    for b in args.batches:
        cases += [("transformers-sdpa", "gpt2", "float16", True, False, b), ("ours", "gpt2", "float16", True, True, b),
                  ("ours", "gpt2", "bfloat16", True, True, b)]
        if not args.quick and b <= 64:
            cases += [("ours", "gpt2-xl", "float16", True, True, b)]
    rows, shares = [], []  # shares: (row, seconds, batch, new tokens, weight bytes, a row's cache bytes)
    for impl, size, dtype, cache, graph, *bs in cases:
        batch = bs[0] if bs else 1
        extra, share = {}, None
        if impl == "ours":
            s = run_ours(size, dtype, cache, graph, args.repeats, batch)
            if cache and graph:  # against the roofline of the same run: weights and the cache once a step
                model = ours_model(size, dtype)
                cfg = model.config
                kv = 2 * cfg.n_layer * cfg.n_embd * model.dtype.itemsize * (len(PROMPT) + NEW / 2)  # a row, mean
                share = (s, batch, NEW, decode_weight_bytes(model), kv)
                extra = roofline_fields(*share, ceilings["copy_GBps"])
        elif impl == "transformers-compile":
            try:
                s, first = run_hf_compile(size, dtype, args.repeats)
            except Exception as err:  # noqa: BLE001  (torch.compile failing is a result too)
                rows.append({"bench": "e2e", "impl": impl, "dtype": dtype, "model": size, "error": repr(err)[:300]})
                print(f"{impl} failed: {err!r}"[:300], flush=True)
                continue
            extra = {"first_call_seconds": round(first, 2)}
        else:
            s = run_hf(size, dtype, impl.split("-")[1], cache, args.repeats, batch)
        row = {"bench": "e2e", "impl": impl, "dtype": dtype, "model": size, "batch": batch, "cache": cache,
               "graph": graph, "new_tokens": NEW, "seconds": round(s, 4), "tok_s": round(batch * NEW / s, 1), **extra}
        rows.append(row)
        if share is not None:
            shares.append((row, *share))
        write_results("e2e", rows, ceilings)  # (after every row: a run cut short keeps what it measured)
        print(f"{impl:20s} {size:8s} {dtype:9s} B={batch:<4d} cache={cache!s:5s} graph={graph!s:5s} "
              f"{s:8.3f} s {batch * NEW / s:9.1f} tok/s {extra}", flush=True)
    for size in ("gpt2",) if args.quick else ("gpt2", "gpt2-xl"):
        r = {"bench": "e2e", "impl": "ours-one-token", "dtype": "float16", "model": size, "batch": 1, "cache": True,
             "graph": True, "new_tokens": 1, **one_token(size, "float16")}
        rows.append(r)
        print(f"ours, warm one-token call, {size} float16: {r['seconds'] * 1e3:.2f} ms, prefill alone "
              f"{r['prefill_seconds'] * 1e3:.2f} ms, {r['beyond_prefill_ms']:.2f} ms beyond it", flush=True)
    start, end = ceilings["copy_GBps"], round(copy_ceiling_GBps(), 1)
    ceilings = run_ceilings(start, end)
    for row, *share in shares:  # against the higher of the two measurements
        row.update(roofline_fields(*share, ceilings["copy_GBps"]))
    print(f"copy bandwidth {start} GB/s at the start, {end} at the end: the shares take {ceilings['copy_GBps']}")
    path = write_results("e2e", rows, ceilings)
    base = {(r["model"], r["dtype"], r["batch"]): r["tok_s"] for r in rows
            if r["impl"] == "transformers-sdpa" and r["cache"]}
    best_hf = {(r["model"], r["dtype"]): r["tok_s"] for r in rows if r["impl"] == "transformers-compile" and "tok_s" in r}
    print(f"\nwrote {path}")
    no_cache = {r["impl"]: r["seconds"] for r in rows if r["model"] == "gpt2" and r["dtype"] == "float32" and not r["cache"]}
    for impl in ("transformers-eager", "transformers-sdpa"):
        print(f"ours gpt2 float32 without KV cache: {no_cache[impl] / no_cache['ours']:.2f}x {impl} (no cache)")
    for r in rows:
        if r["impl"] == "ours" and r["cache"] and (r["model"], r["dtype"], r["batch"]) in base:
            print(f"ours {r['model']} {r['dtype']} B={r['batch']} graph={r['graph']}: "
                  f"{r['tok_s'] / base[(r['model'], r['dtype'], r['batch'])]:.1f}x transformers-sdpa"
                  + (f", {r['tok_s'] / best_hf[(r['model'], r['dtype'])]:.1f}x transformers-compile"
                     if (r["model"], r["dtype"]) in best_hf and r["batch"] == 1 else "")
                  + (f", {r['pct_roofline']}% of the weight-read roofline" if "pct_roofline" in r else ""))


if __name__ == "__main__":
    main()
