"""Decoding attention (q_len = 1) against torch SDPA, in one run.

    python -m benchmarks.decode_attention [--quick]

For each case: the median GPU time of ours (split and block width chosen by the library's heuristic) and
of ``torch.nn.functional.scaled_dot_product_attention`` on the same cache memory (q of
length 1, ``enable_gqa`` for grouped heads), CUDA events, cold L2, launches hidden behind a
sleep kernel (benchmarks/common.py). GB/s = K and V bytes read / time:

    2 B H_kv S D s   (s = bytes per cache element; + 2 B H_kv S 4 for int8 / fp8 scales)

Cases: the "Decoding Attention" article's (32 heads x hd128 fp16: batch 1 over S = 128 ..
32768, and batch 1 .. 128 at S = 128 and 4096), GQA (32 heads, 8 KV heads) and GPT-2
small's (12 heads x hd64, S <= 1024, batch 1 .. 64; also replayed inside a CUDA graph,
rows with graph: true, ours with each merge of the splits and torch SDPA in a torch
graph). int8 and fp8 caches are timed on the article's batch-1 sweep. At batch 1 with
S <= 1024 a read floor is timed too (impl "read-floor": cupy_kernels.read_floor reading the
same K and V bytes and computing nothing, best of 8 grid shapes): what reading the bytes
alone costs under the same timer.
A split sweep records why the heuristic picks what it picks. Accuracy of the quantized
caches: the attention output against the fp16 cache's, and the greedy-token agreement of
a 512-token GPT-2 generation (random weights: no GPT-2 checkpoint is reachable here).
Writes benchmarks/results/decode_attention-<device>.json and a PNG of GB/s against S.
"""

from __future__ import annotations

import argparse
import itertools

import cupy as cp
import numpy as np
import torch
import torch.nn.functional as F

import cupy_kernels as K
from benchmarks.common import (banner, copy_ceiling_GBps, plot_series, save_figure, subplots, time_gpu, time_in_graph,
                               write_results)
from cupy_kernels import _build
from cupy_kernels.decode_attention import launch_config

DTYPES = {"float16": (np.float16, torch.float16), "bfloat16": (_build.BFLOAT16, torch.bfloat16)}
LONG = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]


class Case:
    """Random q and a full cache of S rows per sequence, in the cache format ``kv``."""

    def __init__(self, dtype, B, H, H_kv, D, S, kv=None, seed=0):
        np_dt, self.torch_dtype = DTYPES[dtype]
        rng = cp.random.default_rng(seed)
        self.q = rng.standard_normal((B, H, D), dtype=np.float32).astype(np_dt)
        storage = K.kv_storage_dtype(kv, np_dt)
        self.cache = {"k_cache": cp.empty((B, H_kv, S, D), storage), "v_cache": cp.empty((B, H_kv, S, D), storage)}
        if kv is not None:
            self.cache["k_scale"] = cp.empty((B, H_kv, S), np.float32)
            self.cache["v_scale"] = cp.empty((B, H_kv, S), np.float32)
        for start in range(0, S, 4096):  # fill by kv_append in slices (bounded temporaries)
            n = min(4096, S - start)
            k = rng.standard_normal((B, n, H_kv, D), dtype=np.float32).astype(np_dt)
            v = rng.standard_normal((B, n, H_kv, D), dtype=np.float32).astype(np_dt)
            K.kv_append(k=k, v=v, start=cp.full(B, start, np.int32), **self.cache)
        self.seq = cp.full(B, S, dtype=np.int32)
        self.out = cp.empty((B, H, D), np_dt)
        self.nbytes = sum(a.nbytes for a in self.cache.values())
        self.shape = (B, H, H_kv, D, S)

    def ours(self, num_splits=None, merge="last-block"):
        return lambda: K.decode_attention(self.q, seq_lens=self.seq, out=self.out, num_splits=num_splits, merge=merge,
                                          **self.cache)

    def sdpa(self):
        B, H, H_kv, D, S = self.shape
        q = torch.from_dlpack(self.q).view(B, H, 1, D)
        k = torch.from_dlpack(self.cache["k_cache"])
        v = torch.from_dlpack(self.cache["v_cache"])
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=H != H_kv)

    def config(self):
        B, H, H_kv, D, S = self.shape
        return launch_config(self.q.dtype, self.cache["k_cache"].dtype, B, H, H_kv, D, S)

    def splits(self):
        return self.config().splits


def read_floor(case, graph=False):
    """Best time (us) and launch shape of a kernel that only reads the case's K and V bytes
    (cupy_kernels.read_floor), over a few grid shapes: the floor under the same timer."""
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    k, v = case.cache["k_cache"], case.cache["v_cache"]
    best = None
    for blocks, threads in itertools.product((sms, 2 * sms, 4 * sms, 8 * sms), (256, 512)):
        out = cp.empty(blocks, np.uint32)
        fn = lambda: K.read_floor(k, v, blocks=blocks, threads=threads, out=out)  # noqa: E731
        us = time_in_graph(fn) if graph else time_gpu(fn)["us"]
        if best is None or us < best[0]:
            best = (us, blocks, threads)
    return best


def measure(rows, group, dtype, B, H, H_kv, D, S, kv=None, graph=False, sdpa=True, floor=False):
    """Ours and torch SDPA (cold L2; with graph, also inside a replayed CUDA graph); with
    floor, also the read floor of the case's K and V bytes."""
    case = Case(dtype, B, H, H_kv, D, S, kv)
    key = {"bench": "decode_attention", "group": group, "dtype": dtype, "kv_dtype": kv or dtype, "batch": B,
           "heads": H, "kv_heads": H_kv, "head_dim": D, "seq": S}
    line = []
    impls = {"ours": case.ours()}
    if sdpa and kv is None:
        impls["torch-sdpa"] = case.sdpa()
    for impl, fn in impls.items():
        t = time_gpu(fn)
        row = {**key, "impl": impl, "graph": False, "us": round(t["us"], 2), "us_min": round(t["us_min"], 2),
               "us_max": round(t["us_max"], 2), "GBps": round(case.nbytes / t["us"] / 1e3, 1)}
        if impl == "ours":
            cfg = case.config()
            row.update(splits=cfg.splits, threads=cfg.threads, heads_per_block=H // cfg.blocks)
        rows.append(row)
        line.append(f"{impl} {t['us']:8.2f} us {row['GBps']:6.0f} GB/s")
    if floor:
        us, blocks, threads = read_floor(case)
        rows.append({**key, "impl": "read-floor", "graph": False, "us": round(us, 2),
                     "GBps": round(case.nbytes / us / 1e3, 1), "blocks": blocks, "threads": threads})
        line.append(f"read floor {us:6.2f} us")
    if graph:  # warm L2 inside a graph: the decode step's situation
        for merge in ("last-block", "kernel"):
            us = time_in_graph(case.ours(merge=merge))
            rows.append({**key, "impl": "ours", "merge": merge, "graph": True, "us": round(us, 2),
                         "GBps": round(case.nbytes / us / 1e3, 1), "splits": case.splits()})
            line.append(f"graph ({merge}) {us:5.2f} us")
        if floor:
            us, blocks, threads = read_floor(case, graph=True)
            rows.append({**key, "impl": "read-floor", "graph": True, "us": round(us, 2),
                         "GBps": round(case.nbytes / us / 1e3, 1), "blocks": blocks, "threads": threads})
            line.append(f"floor graph {us:5.2f} us")
        if sdpa:
            us = time_in_torch_graph(impls["torch-sdpa"])
            rows.append({**key, "impl": "torch-sdpa", "graph": True, "us": round(us, 2),
                         "GBps": round(case.nbytes / us / 1e3, 1)})
            line.append(f"sdpa graph {us:5.2f} us")
    print(f"{group:8s} {dtype:8s} kv {kv or dtype:12s} B{B:4d} H{H:3d}/{H_kv:<3d} D{D:4d} S{S:6d} "
          f"split {case.splits():3d} | " + " | ".join(line), flush=True)
    del case
    cp.get_default_memory_pool().free_all_blocks()


def time_in_torch_graph(fn, n: int = 50) -> float:
    """Median microseconds per call of a torch function captured n times into one torch
    CUDA graph and replayed (the counterpart of benchmarks.common.time_in_graph)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / n)
    return float(np.median(times))


def split_sweep(rows, B, H, D, S):
    """Time of ours at forced splits, beside the heuristic's choice."""
    case = Case("float16", B, H, H, D, S)
    picked = case.splits()
    for n in sorted({1, 2, 4, 8, 16, 32, 64, 128, picked}):
        if n > S // 16:
            continue
        t = time_gpu(case.ours(n))
        rows.append({"bench": "decode_attention_splits", "dtype": "float16", "batch": B, "heads": H, "head_dim": D,
                     "seq": S, "splits": n, "picked": n == picked, "us": round(t["us"], 2)})
        print(f"split sweep B{B} H{H} D{D} S{S}: {n:3d} splits {t['us']:8.2f} us{'  (picked)' if n == picked else ''}")


def output_accuracy(B=1, H=32, D=128, S=32768):
    """Max and mean |out - out_fp16cache| / max |out_fp16cache| for the quantized caches."""
    ref = Case("float16", B, H, H, D, S, None, seed=7)
    base = ref.ours()().astype(cp.float32)
    scale = float(cp.abs(base).max())
    out = {}
    for kv in ("int8", "float8_e4m3"):
        case = Case("float16", B, H, H, D, S, kv, seed=7)  # same random K, V and q
        got = case.ours()().astype(cp.float32)
        err = cp.abs(got - base)
        out[kv] = {"shape": f"B{B} H{H} D{D} S{S}", "max_abs": float(err.max()), "mean_abs": float(err.mean()),
                   "max_rel_to_max_out": float(err.max()) / scale}
        print(f"accuracy {kv}: {out[kv]}")
    return out


def generation_agreement(n_new=512):
    """Greedy GPT-2 small (fp16, random weights) with each quantized cache against the fp16 cache."""
    from gpt2_cupy import GPT2

    model = GPT2.random("gpt2", dtype="float16", seed=0)
    prompt = [15496, 11, 314, 1101, 257, 3303, 2746, 11]  # "Hello, I'm a language model,"
    base = model.generate(prompt, n_new)[len(prompt):]
    out = {}
    for kv in ("int8", "float8_e4m3"):
        got = model.generate(prompt, n_new, kv_cache_dtype=kv)[len(prompt):]
        same = [a == b for a, b in zip(base, got)]
        first = same.index(False) if False in same else len(same)
        out[kv] = {"tokens": n_new, "agreement": sum(same) / len(same), "identical_prefix": first,
                   "weights": "random (GPT2.random seed 0)"}
        print(f"greedy agreement {kv}: {out[kv]}")
    return out


def plot(rows, ceiling):
    fig, axes = subplots(1, 2, figsize=(13, 4.5), sharey=True)
    for ax, group in zip(axes, ("article", "gqa")):
        plot_series(ax, [r for r in rows if r.get("group") == group and r["batch"] == 1 and not r["graph"]],
                    "seq", "GBps", label=lambda r: f"{r['impl']} (kv {r['kv_dtype']})", log_base=2)
        ax.axhline(ceiling, color="k", linestyle="--", label="copy ceiling (same run)")
        ax.set_title(f"decode attention, batch 1, {'32 heads' if group == 'article' else '32 q / 8 kv heads'}, hd128")
        ax.set_xlabel("cache length S")
    axes[0].set_ylabel("GB/s (K and V bytes read / time)")
    axes[0].legend(fontsize=8)
    return save_figure(fig, "decode_attention")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="fewer cases, no accuracy section")
    args = p.parse_args()
    print(banner())
    ceiling = copy_ceiling_GBps()
    print(f"copy ceiling {ceiling:.0f} GB/s")
    long = [128, 1024, 32768] if args.quick else LONG
    batches = [1, 16, 128] if args.quick else BATCHES
    rows = []
    for S in long:
        for kv in (None, "int8", "float8_e4m3"):
            measure(rows, "article", "float16", 1, 32, 32, 128, S, kv, floor=kv is None and S <= 1024)
    for S in (128, 4096):
        for B in batches:
            if B > 1:
                measure(rows, "article", "float16", B, 32, 32, 128, S)
    for S in long:
        measure(rows, "gqa", "float16", 1, 32, 8, 128, S, floor=S <= 1024)
    for B in batches[1:4]:
        measure(rows, "gqa", "float16", B, 32, 8, 128, 4096)
    for S in (128, 256, 512, 1024):
        for B in (1, 8, 64):
            measure(rows, "gpt2", "float16", B, 12, 12, 64, S, graph=True, floor=B == 1)
    for S in (1024, 32768):
        measure(rows, "article", "bfloat16", 1, 32, 32, 128, S)
    split_sweep(rows, 1, 32, 128, 32768)
    split_sweep(rows, 1, 12, 64, 1024)
    extra = {}
    if not args.quick:
        extra = {"accuracy": output_accuracy(), "generation_agreement": generation_agreement()}
    path = write_results("decode_attention", rows, {"copy_GBps": round(ceiling, 1)}, **extra)
    print(f"wrote {path}")
    print(f"wrote {plot(rows, ceiling)}")
    summary(rows, ceiling)


def summary(rows, ceiling):
    """The figures the targets are stated in."""
    def find(**kw):
        return [r for r in rows if all(r.get(k) == v for k, v in kw.items())]

    timed = [r for r in rows if r["bench"] == "decode_attention" and not r["graph"]]
    ours = {(r["group"], r["dtype"], r["kv_dtype"], r["batch"], r["seq"]): r for r in timed if r["impl"] == "ours"}
    worst = min(((t["us"] / ours[k]["us"]), k) for t in timed if t["impl"] == "torch-sdpa"
                for k in [(t["group"], t["dtype"], t["kv_dtype"], t["batch"], t["seq"])])
    print(f"worst torch-sdpa / ours time ratio {worst[0]:.2f} at {worst[1]}")
    short = [t["us"] / ours[(t["group"], t["dtype"], t["kv_dtype"], 1, t["seq"])]["us"]
             for t in timed if t["impl"] == "torch-sdpa" and t["batch"] == 1 and t["seq"] <= 1024]
    print(f"batch 1, S <= 1024: torch-sdpa / ours at least {min(short):.2f}")
    for graph in (False, True):  # where 1.5x torch SDPA would be faster than reading the bytes
        for fl in find(bench="decode_attention", impl="read-floor", graph=graph):
            key = {k: fl[k] for k in ("group", "dtype", "kv_dtype", "batch", "seq", "graph")}
            sd, us = find(impl="torch-sdpa", **key), find(impl="ours", **key)
            if sd and us:
                print(f"  {'graph' if graph else 'cold '} {fl['group']:7s} S{fl['seq']:5d}: read floor {fl['us']:6.2f} us, "
                      f"torch-sdpa / 1.5 {sd[0]['us'] / 1.5:6.2f}, ours {min(u['us'] for u in us):6.2f}"
                      f"{'  (1.5x is below the floor)' if sd[0]['us'] / 1.5 < fl['us'] else ''}")
    big = find(group="article", dtype="float16", kv_dtype="float16", batch=1, seq=32768, impl="ours", graph=False)
    if big:
        print(f"article B1 S32768 fp16: {big[0]['GBps'] / ceiling:.1%} of the copy ceiling")
        for kv in ("int8", "float8_e4m3"):
            q = find(group="article", kv_dtype=kv, batch=1, seq=32768, impl="ours")
            if q:
                print(f"  {kv} cache: {q[0]['us'] / big[0]['us']:.2f}x the fp16 time")
    for g in find(group="gpt2", batch=1, seq=1024, graph=True):
        print(f"GPT-2 small shape B1 S1024 in a CUDA graph, {g['impl']} {g.get('merge', '')}: {g['us']:.2f} us per call")


if __name__ == "__main__":
    main()
