"""What every benchmark shares: device banner, versions, the measured copy ceiling, a
CUDA-event timer with a cold L2, and the result file (benchmarks/results/<bench>-<device>.json)."""

from __future__ import annotations

import datetime
import json
import platform
import re
import statistics
import time
from pathlib import Path

import cupy
import numpy

RESULTS = Path(__file__).resolve().parent / "results"


def device_name() -> str:
    return cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()


def device_slug(name: str | None = None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100' (this machine's GPU unless a name is given)."""
    name = name or device_name()
    m = re.search(r"\b([A-Z]+\d+[A-Z]?)\b", name.replace("NVIDIA", ""))
    return (m.group(1) if m else re.sub(r"\W+", "-", name)).lower()


def versions() -> dict:
    out = {"python": platform.python_version(), "cupy": cupy.__version__,
           "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
           "driver": cupy.cuda.runtime.driverGetVersion()}
    for name in ("numpy", "torch", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            pass
    return out


def banner() -> str:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    return (f"{device_name()}: {props['multiProcessorCount']} SMs, {props['l2CacheSize'] / 2**20:.0f} MiB L2, "
            f"{props['totalGlobalMem'] / 2**30:.0f} GiB; " + ", ".join(f"{k} {v}" for k, v in versions().items()))


class _L2Flush:
    """Reads a buffer twice the L2 size, so a timed run starts with a cold cache of clean
    lines: the kernel's reads evict nothing that must be written back (the decode step's
    weights and KV rows evict other weights). Overwriting the buffer instead (``dirty``) leaves
    the L2 full of dirty lines, which the timed kernel writes back as its reads evict them: on
    an H100 GPT-2 XL's LM head took 66.5 us after the writes and 59.1 after the reads, GPT-2
    small's q|k|v 7.20 and 6.38, cuBLAS's XL LM head 78.9 and 69.7 (benchmarks/l2_flush.py,
    benchmarks/results/l2_flush-h100.json). A kernel that writes as many bytes as it reads
    leaves up to the L2's size of them in L2 when the timer stops, unwritten, which the dirty
    flush makes up for by about as many writebacks: benchmarks/kernels.py flushes dirty."""

    def __init__(self, dirty: bool = False):
        l2 = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["l2CacheSize"]
        self.buf = cupy.ones(2 * l2 // 4, dtype=cupy.float32)  # written once, here
        self.out = cupy.empty((), dtype=cupy.float32)
        self.dirty = dirty

    def __call__(self):
        if self.dirty:
            self.buf.fill(0)
        else:
            cupy.sum(self.buf, out=self.out)


def best_host_seconds(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn`` after a warm-up call, in host seconds between
    device synchronizations (what a caller waits for a call that returns after its GPU work)."""
    fn()
    times = []
    for _ in range(repeats):
        cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        fn()
        cupy.cuda.runtime.deviceSynchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def _spin(us: float) -> None:
    """Keeps the GPU busy for ``us`` microseconds (torch's sleep kernel), so the launches
    queued behind it are timed by the GPU alone, without the host's launch overhead."""
    import torch

    clock_khz = cupy.cuda.Device().attributes["ClockRate"]
    torch.cuda._sleep(int(us * clock_khz / 1e3))


_WAIT = r"""extern "C" __global__ void wait_ns(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)ns);
}"""


def gpu_seconds_behind_wait(fn, stream, repeats: int, wait_s: float) -> float:
    """The fastest of ``repeats`` GPU times of ``fn()`` (CUDA events on ``stream``) with its
    launches queued behind a kernel that waits on that stream: the GPU's time alone, not the
    host's launch cost. The wait starts at ``wait_s`` seconds and doubles (up to four times)
    whenever the host took longer than it to queue the launches (the time would then be the
    host's; with the GPU held back, the host's own calls can take longer than otherwise). The
    wait reads the GPU's global timer, so its length is known, where _spin's sleep counts clock
    cycles at the nominal clock, on torch's stream rather than ``stream``."""
    wait = cupy.RawKernel(_WAIT, "wait_ns")
    best = float("inf")
    for _ in range(repeats):
        for _ in range(5):
            cupy.cuda.runtime.deviceSynchronize()
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            with stream:
                wait((1,), (1,), (numpy.int64(wait_s * 1e9),))
                t0 = time.perf_counter()
                start.record(stream)
                fn()
                stop.record(stream)
                queued = time.perf_counter() - t0
            stop.synchronize()
            if queued < wait_s:
                break
            wait_s *= 2
        else:
            raise ValueError(f"the host took {queued:.4f} s to queue the launches, longer than the {wait_s / 2} s wait")
        best = min(best, cupy.cuda.get_elapsed_time(start, stop) / 1e3)
    return best


def time_gpu(fn, *, warmup: int = 3, reps: int = 20, cold_l2: bool = True, dirty: bool = False,
             hide_launch: bool = True) -> dict:
    """Median and spread (min, max) in microseconds of ``fn()`` timed with CUDA events.

    cold_l2: read a buffer twice the L2 size before each run (_L2Flush; ``dirty``: overwrite
    it, leaving dirty lines for the run to write back). hide_launch: queue
    ``fn`` behind a 1 ms sleep kernel, so that the time is the GPU's, not the host's
    launch cost (which a CUDA graph removes in real use, and which differs between
    CuPy and torch). Everything runs on the legacy default stream, shared by both.
    """
    flush = _L2Flush(dirty) if cold_l2 else None
    for _ in range(warmup):
        fn()
    times = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for _ in range(reps):
        if flush:
            flush()
        if hide_launch:
            _spin(1000)  # (300 us: a run's host once took longer to queue fn, GPT-2 XL's MLP down)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3)
    return {"us": statistics.median(times), "us_min": min(times), "us_max": max(times)}


def time_in_graph(fn, n: int = 50) -> float:
    """Median microseconds per call of ``fn`` captured n times into one CUDA graph and
    replayed: the GPU time of its launches without the host's launch cost, the way the
    decode step runs them."""
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.runtime.deviceSynchronize()
    with stream:
        fn()  # once outside the capture: what it allocates on first use is not captured
        stream.synchronize()
        stream.begin_capture()
        for _ in range(n):
            fn()
        graph = stream.end_capture()
    return graph_replay_us(graph, stream, n)


def graph_replay_us(graph, stream, n: int = 1) -> float:
    """Median microseconds of one replay of ``graph`` on ``stream`` (CUDA events, after 3
    warm-up replays), divided by ``n``, the calls it holds."""
    for _ in range(3):
        graph.launch(stream)
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(10):
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop) * 1e3 / n)
    return statistics.median(times)


def decode_weight_bytes(model) -> int:
    """Bytes one decode step of a gpt2_cupy.GPT2 must read: every weight once (wte as the
    tied LM head; the few wpe rows left out). Over the copy bandwidth: the step's floor."""
    arrays = [model.lm_head, model.ln_f_w, model.ln_f_b, model.lm_head_b, model.head_u, model.head_c]
    for blk in model.blocks:
        arrays += [getattr(blk, f) for f in blk.__dataclass_fields__]
    return sum(a.nbytes for a in arrays if a is not None)


def random_model(size: str, dtype: str = "float16"):
    """A gpt2_cupy.GPT2 of ``size`` in ``dtype`` with transformers' random weights of seed 0
    (the benchmarks' model: no download)."""
    import torch
    import transformers

    from gpt2_cupy import GPT2, SIZES

    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.GPT2LMHeadModel(SIZES[size].to_hf())
    model = GPT2.from_hf(hf, dtype)
    del hf
    torch.cuda.empty_cache()
    return model


def copy_ceiling_GBps(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second / 1e9."""
    src = cupy.ones(nbytes // 4, dtype=cupy.float32)
    dst = cupy.empty_like(src)
    t = time_gpu(lambda: cupy.copyto(dst, src), warmup=3, reps=10, cold_l2=False, hide_launch=False)
    return 2 * nbytes / (t["us"] * 1e-6) / 1e9


def write_results(bench: str, rows: list[dict], ceilings: dict, *, device: str | None = None,
                  versions_: dict | None = None, **extra) -> Path:
    """benchmarks/results/<bench>-<device>.json: device, date, versions, ceilings, rows,
    and any ``extra`` sections. ``device`` and ``versions_``: those of the machine that measured
    the rows, where they are not this one's (a file merged from parts)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    device = device or device_name()
    path = RESULTS / f"{bench}-{device_slug(device)}.json"
    doc = {"device": device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "versions": versions_ if versions_ is not None else versions(), "ceilings": ceilings, "rows": rows,
           **extra}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


# ---------------------------------------------------------------------------------------
# plots: one line per implementation, against a size on a log axis
# ---------------------------------------------------------------------------------------
def subplots(nrows: int, ncols: int, **kwargs):
    """A matplotlib figure and its axes, drawn without a display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, **kwargs)


def plot_series(ax, rows: list[dict], x: str, y: str, label=lambda r: r["impl"], log_base: int = 10) -> None:
    """One marked line per distinct ``label(row)``: ``y`` against ``x``, x on a log axis."""
    for name in dict.fromkeys(label(r) for r in rows):
        pts = sorted((r[x], r[y]) for r in rows if label(r) == name)
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=log_base)
    ax.grid(True, which="both", alpha=0.3)


def save_figure(fig, name: str, device: str | None = None) -> Path:
    """benchmarks/results/<name>-<device>.png (device: this GPU's slug unless given)"""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = RESULTS / f"{name}-{device or device_slug()}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
