"""The decode step with its weights requested into L2 ahead of the products (a branch of the
step's CUDA graph, gpt2_cupy/engine.py prefetch_schedule), at several leads, against none.

    python -m benchmarks.l2_prefetch [--cases gpt2:float16:1 gpt2-xl:float16:1 ...]
                                     [--leads 0 0.2 0.4 0.6]

us a step: CUDA events around 20 replays of the step's graph (with programmatic dependent
launch where the GPU has it), median of 5, the cache holding 264 rows (garbage rows: timing
only), for each lead (a share of the device's L2; 0: no requests). Beside it the floor
(weight bytes / copy bandwidth of the run). Writes benchmarks/results/l2_prefetch-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics

import cupy as cp
import numpy as np
import torch

from benchmarks.common import banner, copy_ceiling_GBps, decode_weight_bytes, write_results
from cupy_kernels import _build

CACHED = 264
CASES = ["gpt2:float16:1", "gpt2:bfloat16:1", "gpt2:float32:1", "gpt2:float16:8", "gpt2:float16:64",
         "gpt2-xl:float16:1", "gpt2-xl:float16:8"]


def step_us(s, graph, replays: int = 20) -> float:
    times = []
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(3):
        graph.launch(s.stream)
    for _ in range(5):
        s.cache.positions.set(np.full(s.batch, CACHED, np.int32))
        start.record(s.stream)
        for _ in range(replays):
            graph.launch(s.stream)
        stop.record(s.stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / replays)
    return statistics.median(times)


def main():
    import transformers

    from gpt2_cupy import GPT2, SIZES
    from gpt2_cupy.engine import Session

    p = argparse.ArgumentParser()
    p.add_argument("--cases", nargs="+", default=CASES, metavar="SIZE:DTYPE:BATCH")
    p.add_argument("--leads", nargs="+", type=float, default=[0, 0.2, 0.4, 0.6])
    p.add_argument("--rounds", type=int, default=2, help="passes over the leads (their spread is the noise)")
    args = p.parse_args()
    print(banner(), flush=True)
    ceiling = copy_ceiling_GBps()
    pdl = _build.pdl_supported()
    rows, models = [], {}
    for case in args.cases:
        size, dtype, batch = case.split(":")
        batch = int(batch)
        if (size, dtype) not in models:
            models.clear()
            cp.get_default_memory_pool().free_all_blocks()
            torch.manual_seed(0)
            with torch.device("cuda"):
                hf = transformers.GPT2LMHeadModel(SIZES[size].to_hf())
            models[(size, dtype)] = GPT2.from_hf(hf, dtype)
            del hf
            torch.cuda.empty_cache()
        model = models[(size, dtype)]
        floor = decode_weight_bytes(model) / ceiling / 1e3
        s = Session(model, batch, 1024, None, None, cuda_graph=False)
        graphs = {lead: s.capture(pdl, lead, publish=False) for lead in args.leads}
        times = {lead: [] for lead in args.leads}
        for _ in range(args.rounds):
            for lead in args.leads:
                times[lead].append(step_us(s, graphs[lead]))
        for lead in args.leads:
            us = min(times[lead])
            rows.append({"bench": "l2_prefetch", "model": size, "dtype": dtype, "batch": batch, "cache_rows": CACHED,
                         "pdl": pdl, "lead": lead, "prefetch_launches": len(s.prefetches(lead)) if lead else 0,
                         "step_us": round(us, 2), "step_us_runs": [round(t, 2) for t in times[lead]],
                         "floor_us": round(floor, 2), "pct_floor": round(100 * floor / us, 1)})
            print(rows[-1], flush=True)
        del s, graphs
    print(write_results("l2_prefetch", rows, {"copy_GBps": round(ceiling, 1)}))


if __name__ == "__main__":
    main()
