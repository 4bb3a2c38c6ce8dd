"""What a dependent load waits while weights stream: the bandwidth of a read with a given
number of bytes requested at once, and the latency of one load through L2 beside it.

    python -m benchmarks.memory_queue

Each case reads 1 GiB once (cupy_kernels.read_under_load: blocks x threads x loads x 16
bytes in flight), timed alone (CUDA events, median of 3), then again with one more block
whose thread, 30 us in, follows a random cycle of cache lines (ld.global.cg) 20 times, one
load waiting for the last: the mean ns a hop (median of 3). ``hit_ns``: a cycle of 2 lines,
each touched every other hop, so it stays in L2 while the stream passes (a load that hits, as
a kernel's read of the row the kernel before it wrote); ``hop_ns``: a cycle of 64 lines
(8 KiB), which the stream evicts from L2 between laps (mostly loads that miss: 0.27 MB in
flight already doubles it). The first row has no stream (1 block of 32 threads, 16 bytes):
the idle latency. A decode step hands activations from kernel to kernel through such loads
while the next weights stream.
Writes benchmarks/results/memory_queue-<device>.json and a PNG.
"""

from __future__ import annotations

import statistics

import cupy as cp
import numpy as np

import cupy_kernels as K
from benchmarks.common import banner, copy_ceiling_GBps, save_figure, subplots, write_results

HOPS = 20
DELAY_NS = 30_000
LINES = {"hit_ns": 2, "hop_ns": 64}  # the chases' cache lines


def _chase(rng, lines: int) -> cp.ndarray:
    """A cycle through ``lines`` cache lines of 128 bytes, in uint32 indices."""
    words = 32  # a line's uint32s
    order = rng.permutation(lines)
    nxt = np.zeros(lines * words, np.uint32)
    nxt[order * words] = np.roll(order, -1) * words
    return cp.asarray(nxt)


def main():
    print(banner(), flush=True)
    ceiling = copy_ceiling_GBps()
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    rng = np.random.default_rng(0)
    chases = {key: _chase(rng, lines) for key, lines in LINES.items()}
    buf = cp.ones((1 << 30) // 4, np.uint32)
    out = cp.empty(2 * sms, np.uint32)
    lat = cp.empty(2, np.uint64)
    cases = [(1, 32, 4, 16)] + [(sms, t, 4, buf.nbytes) for t in (32, 64, 128, 256, 512, 1024)] \
        + [(sms, 1024, 8, buf.nbytes), (2 * sms - 1, 1024, 8, buf.nbytes)]  # (the probe block resident too)
    rows = []
    for blocks, threads, loads, nbytes in cases:
        a = buf.view(np.uint8)[:nbytes]
        run = lambda hops, chase: K.read_under_load(  # noqa: E731
            a, chase, blocks=blocks, threads=threads, loads=loads, hops=hops, delay_ns=DELAY_NS if hops else 0,
            out=out[:blocks], lat=lat)
        run(0, chases["hop_ns"])
        times, hops_ns = [], {key: [] for key in LINES}
        for _ in range(3):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            run(0, chases["hop_ns"])
            stop.record()
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
            for key, chase in chases.items():
                run(HOPS, chase)
                hops_ns[key].append(int(lat.get()[0]))
        us = statistics.median(times)
        row = {"bench": "memory_queue", "blocks": blocks, "threads": threads, "loads": loads,
               "in_flight_MB": round(blocks * threads * loads * 16 / 1e6, 3), "bytes": nbytes,
               "us": round(us, 1), "GBps": round(nbytes / us / 1e3, 1),
               "pct_copy": round(100 * nbytes / us / 1e3 / ceiling, 1)}
        for key, runs in hops_ns.items():
            row.update({key: statistics.median(runs), f"{key}_runs": runs, f"{key}_lines": LINES[key]})
        rows.append(row)
        print(row, flush=True)
    print(write_results("memory_queue", rows, {"copy_GBps": round(ceiling, 1)}))
    streamed = [r for r in rows if r["bytes"] > 16]
    fig, ax = subplots(1, 1, figsize=(7, 4))
    x = [r["in_flight_MB"] for r in streamed]
    ax.plot(x, [r["GBps"] for r in streamed], marker="o", color="tab:blue", label="read bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bytes requested at once (MB)")
    ax.set_ylabel("GB/s", color="tab:blue")
    ax.grid(True, which="both", alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(x, [r["hit_ns"] / 1e3 for r in streamed], marker="s", color="tab:red",
             label="one load that hits in L2 (2 lines)")
    ax2.plot(x, [r["hop_ns"] / 1e3 for r in streamed], marker="^", color="tab:orange",
             label="one load of 64 lines the stream evicts")
    ax2.axhline(rows[0]["hit_ns"] / 1e3, color="tab:red", linestyle=":", label="idle")
    ax2.set_ylabel("latency of a dependent load (us)", color="tab:red")
    ax.set_title("a read of 1 GiB and one dependent load beside it")
    fig.legend(loc="lower right", fontsize=7)
    print(save_figure(fig, "memory_queue"))


if __name__ == "__main__":
    main()
