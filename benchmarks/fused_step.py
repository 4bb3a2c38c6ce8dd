"""The fused decode step (one persistent kernel, ``GPT2.fused_step``) against the
kernel-by-kernel step, batch 1, float16, each replayed as a CUDA graph.

    python -m benchmarks.fused_step [--sizes gpt2 gpt2-xl] [--trace]

us a step (CUDA events around 50 replays, median of 5, the cache holding 264 and 520 rows:
garbage rows, timing only), against the floor (weight bytes / copy bandwidth of the run).
``--trace``: where the fused step's time goes, per phase, and what bounds its weight ring
(ring_use: whether the consumers wait for weights or the producer for free slots).
Writes benchmarks/results/fused_step-<device>.json.
"""

from __future__ import annotations

import argparse
import statistics

import cupy as cp
import numpy as np

from benchmarks.common import banner, copy_ceiling_GBps, decode_weight_bytes, random_model, write_results


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


PHASES = ("qkv", "attention", "attn_proj", "fc", "mlp_proj")
_MARKS = {"qkv": 3, "attention": 2, "attn_proj": 3, "fc": 3, "mlp_proj": 3}  # decode_step.cu's Trace marks


def timeline(model, length: int) -> list[dict]:
    """Where the fused step's time goes, from its timeline (global timer at each block's
    marks): per phase, the time a block waits at the barrier before it (from its own
    arrival to the release), its prologue (LayerNorm statistics and x into shared
    memory) and its tiles, medians over blocks and layers; and the phase's span (release to
    the next release, median over blocks), us."""
    from cupy_kernels.decode_step import ring_stages, split_trace, trace_marks
    from gpt2_cupy.engine import Session

    cfg = model.config
    model.fused_step = True
    s = Session(model, 1, 1024, None, None, cuda_graph=True)
    trace = cp.zeros((cp.cuda.Device().attributes["MultiProcessorCount"], trace_marks(cfg.n_layer)), dtype=cp.uint64)
    for _ in range(3):
        s.cache.positions.set(np.array([length], np.int32))
        with s.stream:
            model.fused_step_launch(s.cache, s.buf, trace=trace)
        s.stream.synchronize()
    marks, stages = split_trace(trace.get().astype(np.int64), cfg.n_layer)
    ring = ring_use(stages, ring_stages())
    t = marks / 1e3  # us
    t -= t.min()
    per = {name: {"wait_us": [], "prologue_us": [], "tiles_us": [], "span_us": []} for name in PHASES + ("lm_head",)}
    i, prev_done = 1, t[:, 0]
    releases = []
    for _ in range(cfg.n_layer):
        for name in PHASES:
            rel, done = t[:, i], t[:, i + _MARKS[name] - 1]
            per[name]["wait_us"].append(np.median(rel - prev_done))
            if _MARKS[name] == 3:
                per[name]["prologue_us"].append(np.median(t[:, i + 1] - rel))
            per[name]["tiles_us"].append(np.median(done - t[:, i + _MARKS[name] - 2]))
            releases.append((name, np.median(rel)))
            prev_done, i = done, i + _MARKS[name]
    rel, done = t[:, i], t[:, i + 2]
    per["lm_head"]["wait_us"].append(np.median(rel - prev_done))
    per["lm_head"]["prologue_us"].append(np.median(t[:, i + 1] - rel))
    per["lm_head"]["tiles_us"].append(np.median(done - t[:, i + 1]))
    releases.append(("lm_head", np.median(rel)))
    releases.append(("end", np.median(t[:, i + 3])))
    for (name, r0), (_, r1) in zip(releases, releases[1:]):
        per[name]["span_us"].append(r1 - r0)
    rows = []
    for name, d in per.items():
        rows.append({"phase": name, "count": len(d["span_us"]),
                     **{k: round(float(np.mean(v)), 2) for k, v in d.items() if v}})
    rows.append({"phase": "step", "span_us": round(float(releases[-1][1] - np.median(t[:, 0])), 2)})
    rows.append({"phase": "ring", **ring})
    model._engine = None
    return rows


def ring_use(st: np.ndarray, slots: int) -> dict:
    """What bounds the weight ring, from its stage times [blocks, 4, k] (issued, wanted, had,
    freed; ns; 0 = no such stage): medians over blocks of the time a block's consumers waited
    for weights (had - wanted, summed), the time its producer waited for a full ring to free a
    slot (the gaps before issues that came within 0.5 us of the release of the slot they
    reuse, summed), how long a stage sat in the ring before it was wanted, and how long the
    consumers took over one (had to freed)."""
    waits, blocked, lead, use, stages = [], [], [], [], []
    for issued, wanted, had, freed in st:
        n = int(np.count_nonzero(freed))
        if n < 2 or np.count_nonzero(issued[:n]) < n:
            continue
        issued, wanted, had, freed = (a[:n] / 1e3 for a in (issued, wanted, had, freed))
        gated = np.zeros(n, bool)
        gated[slots:] = issued[slots:] - freed[:-slots] < 0.5
        stages.append(n)
        waits.append(np.sum(had - wanted))
        blocked.append(np.sum(np.diff(issued)[gated[1:]]))
        lead.append(np.median(wanted - issued))
        use.append(np.median(freed - had))
    return {"slots": slots, "stages_per_block": int(np.median(stages)),
            "consumers_wait_us": round(float(np.median(waits)), 1),
            "producer_full_ring_us": round(float(np.median(blocked)), 1),
            "stage_lead_us": round(float(np.median(lead)), 2), "stage_use_us": round(float(np.median(use)), 2)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="+", default=["gpt2", "gpt2-xl"])
    p.add_argument("--trace", action="store_true", help="also the fused step's timeline per phase")
    args = p.parse_args()
    print(banner(), flush=True)
    ceiling = copy_ceiling_GBps()
    rows = []
    for size in args.sizes:
        model = random_model(size)
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
        if args.trace:
            for r in timeline(model, 264):
                rows.append({"bench": "fused_step_timeline", "model": size, "dtype": "float16", "batch": 1,
                             "cache_rows": 264, **r})
                print(rows[-1], flush=True)
        del model
        cp.get_default_memory_pool().free_all_blocks()
    print(write_results("fused_step", rows, {"copy_GBps": round(ceiling, 1)}))


if __name__ == "__main__":
    main()
