"""The fused decode step (one persistent kernel, ``GPT2.fused_step``) against the
kernel-by-kernel step, batch 1, float16, each replayed as a CUDA graph.

    python -m benchmarks.fused_step [--sizes gpt2 gpt2-xl]

us a step (CUDA events around 50 replays, median of 5, the cache holding 264 and 520 rows:
garbage rows, timing only), against the floor (weight bytes / copy bandwidth of the run).
Writes benchmarks/results/fused_step-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics

import cupy as cp
import numpy as np
import torch

from benchmarks.common import banner, copy_ceiling_GBps, decode_weight_bytes, write_results


def step_us(model, fused: bool, length: int, replays: int = 50) -> tuple[float, int]:
    from gpt2_cupy.engine import Session

    model.fused_step = fused
    s = Session(model, 1, 1024, None, None, cuda_graph=True)
    times = []
    for _ in range(5):
        s.cache.positions.set(np.array([length], np.int32))
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record(s.stream)
        for _ in range(replays):
            s.graph.launch(stream=s.stream)
        stop.record(s.stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / replays)
    return statistics.median(times), len(s.step)


def main():
    import transformers

    from gpt2_cupy import GPT2, SIZES

    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="+", default=["gpt2", "gpt2-xl"])
    args = p.parse_args()
    print(banner(), flush=True)
    ceiling = copy_ceiling_GBps()
    rows = []
    for size in args.sizes:
        torch.manual_seed(0)
        with torch.device("cuda"):
            hf = transformers.GPT2LMHeadModel(SIZES[size].to_hf())
        model = GPT2.from_hf(hf, "float16")
        del hf
        floor = decode_weight_bytes(model) / ceiling / 1e3
        for fused in (False, True):
            for length in (264, 520):
                us, launches = step_us(model, fused, length)
                rows.append({"bench": "fused_step", "model": size, "dtype": "float16", "batch": 1,
                             "impl": "fused" if fused else "kernel-by-kernel", "launches": launches,
                             "cache_rows": length, "step_us": round(us, 2), "floor_us": round(floor, 2),
                             "pct_floor": round(100 * floor / us, 1)})
                print(rows[-1], flush=True)
            model._engine = None
        del model
        cp.get_default_memory_pool().free_all_blocks()
    print(write_results("fused_step", rows, {"copy_GBps": round(ceiling, 1)}))


if __name__ == "__main__":
    main()
