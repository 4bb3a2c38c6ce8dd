"""Where a generated token's time goes, and the matrix-vector products on their own.

    python -m benchmarks.decode_step [--quick] [--skip-gemv] [--skip-profile] [--gemv-batches 1 64]
                                     [--sweep-dtypes float16 float32] [--steps SIZE:DTYPE:BATCH ...] [--chain]

1. Products (``linear``), each weight shape of GPT-2 small and XL, B = 1 (and the rows of x
   ``--gemv-batches`` gives):
   GB/s = weight bytes N K s / median time, against the copy ceiling of the same run and
   cuBLAS (torch.nn.functional.linear on the same memory) under the same timer. Two
   timings: one launch with a cold L2 (queued behind a sleep kernel, so the host's launch
   cost is not counted), and launches back to back in a CUDA graph, each on its own copy
   of the weights (copies spanning twice the L2, so none is re-read from L2), with and
   without programmatic dependent launch: the way the decode step runs them. In the dtypes
   of ``--sweep-dtypes`` (float16 unless told) the other launch shapes are timed too
   (``impl: ours-tile``: on CUDA cores every tile and block width; on tensor cores the warps
   that split K at B = 1, the n-tiles per block past it); the wrapper's choice is
   ``impl: ours``. An empty kernel under the cold timer (``bench: launch``) gives what one cold
   launch costs before any byte moves, and with it each cold row's ``bound_pct``: the most of
   the copy bandwidth a launch of that many bytes can show when timed that way.
2. The decode step (``impl: step``): for each size and dtype at batch 1 and 8, the
   CUDA graph of one step is replayed under torch.profiler (CUPTI sees CuPy's kernels);
   per launch of the step: kernel, role, bytes it must move, median time, GB/s, and what
   it adds to the step replayed with programmatic dependent launch (``us_pdl_marginal``: its
   end after the end of the kernel before it, which it waits for; they sum to the step). The
   step's time per token (CUDA events around the replays, with and without programmatic
   dependent launch), its kernels' sum, and the floor (weight bytes / copy bandwidth).
   Wall time per token of a 512-token ``generate`` call beside it, and the GPU time per
   token of such a call (the span of its kernels in a CUPTI trace / 512): the host's
   share is their difference; a real call's step can differ from the replayed one, which
   runs at fixed positions on whatever data the buffers hold.

Writes benchmarks/results/decode_step-<device>.json and decode_step-<device>.png
(``--replot FILE`` redraws the picture from a results file, without a GPU, as the PNG of
the file's name). The run can be
split over several calls of a machine: ``--out NAME`` writes a part of it (say
``--skip-profile``, or some ``--steps``) to NAME-<device>.json, and ``--merge PART ...``
writes decode_step-<device>.json and its picture from the parts' rows, as they are, each row
with its part's copy bandwidth (``copy_GBps``) and the parts' files, dates and versions in
``parts``.
``--chain``: only a chain of 63 dependent kernels with nothing to read (GPT-2 small's step
has 63), each empty or handing a row of 768 floats to the next through L2, in a CUDA graph
with and without programmatic dependent launch, and the same hand-offs as phases of one
cooperative launch with a grid-wide barrier between them: what a step of that many kernels,
or of that many phases of a persistent kernel, pays whatever its bytes
(decode_step_chain-<device>.json).
``--carveout-sweep [SIZE:DTYPE:BATCH ...]``: only the step with every kernel's split of L1 and
shared memory set alike at several splits, against the driver's choice, and each kernel's
registers, shared memory and blocks an SM (decode_step_carveout-<device>.json).
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import re
import statistics
import time
from pathlib import Path

import cupy as cp
import numpy as np
import torch
import torch.nn.functional as F

import cupy_kernels as K
from benchmarks.common import (banner, copy_ceiling_GBps, decode_weight_bytes, device_slug, graph_replay_us,
                               save_figure, subplots, time_gpu, write_results)
from cupy_kernels import _build

linear_mod = importlib.import_module("cupy_kernels.linear")  # the module (the package exports the function)

DTYPES = {"float32": (np.float32, torch.float32), "float16": (np.float16, torch.float16),
          "bfloat16": (_build.BFLOAT16, torch.bfloat16)}
PROMPT = [15496, 11, 314, 1101, 257, 3303, 2746, 11]


def gemv_shapes(size: str) -> dict:
    from gpt2_cupy import SIZES

    C, V = SIZES[size].n_embd, SIZES[size].vocab_size
    return {"qkv": (3 * C, C), "attn_proj": (C, C), "fc": (4 * C, C), "mlp_proj": (C, 4 * C), "lm_head": (V, C)}


def graph_time(launch, n: int, pdl: bool) -> float:
    """Median us per launch of ``launch(i)`` for i < n captured into one graph, replayed."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        with _build.recording() as plan:
            for i in range(n):
                launch(i)
        plan.replay()
        stream.synchronize()
        stream.begin_capture()
        plan.replay(pdl=pdl)
        graph = stream.end_capture()
    return graph_replay_us(graph, stream, n)


def launch_floor() -> dict:
    """An empty kernel, one block of 256 threads an SM, under the products' cold timer: the
    part of one cold launch that no bandwidth removes. Timed that way, a matrix of b bytes
    can show at most (b / copy) / (b / copy + this) of the copy bandwidth (each cold row's
    ``bound_pct``)."""
    kernel = cp.RawKernel(r'extern "C" __global__ void empty_kernel() {}', "empty_kernel")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    t = time_gpu(lambda: kernel((sms,), (256,), ()))
    return {"bench": "launch", "impl": "empty", "timing": "cold", "blocks": sms, "threads": 256,
            **{k: round(v, 3) for k, v in t.items()}}


_CHAIN_SRC = r"""
extern "C" __global__ void chain_empty_kernel() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// out[j] = in[j] + 1e-6 * sum(in) over this block's slice of j: every block reads the whole
// row written before (L2: through L2 only, ld.global.cg), folds it across the block, writes a slice.
template <bool L2> __device__ __forceinline__ float load(const float* p) { return L2 ? __ldcg(p) : *p; }
template <bool L2>
__device__ __forceinline__ void hand_off(float* __restrict__ out, const float* __restrict__ in, int C, float* part) {
    float v = 0.f;
    for (int i = threadIdx.x; i < C; i += blockDim.x) v += load<L2>(in + i);
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < (int)blockDim.x / 32; ++w) total += part[w];
    const int per = (C + gridDim.x - 1) / gridDim.x, j = blockIdx.x * per + threadIdx.x;
    if (threadIdx.x < per && j < C) out[j] = load<L2>(in + j) + 1e-6f * total;
}

// the row the kernel before wrote
extern "C" __global__ void chain_row_kernel(float* __restrict__ out, const float* __restrict__ in, int C) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
    __shared__ float part[32];
    hand_off<false>(out, in, C, part);
}

// The same hand-offs as phases of one cooperative launch (one block an SM, all resident),
// with a grid-wide barrier between phases instead of a kernel boundary: an arrival counter
// (sync[0]) that only grows within a launch, phase p waiting for (p + 1) x gridDim.x
// arrivals; the last block to finish (sync[1]) sets both back to zero. The rows other blocks
// wrote in this launch are read through L2 (ld.global.cg).
extern "C" __global__ void chain_persistent_kernel(float* a, float* b, unsigned* sync, int C, int phases) {
    __shared__ float part[32];
    for (int p = 0; p < phases; ++p) {
        hand_off<true>(p % 2 ? a : b, p % 2 ? b : a, C, part);
        __syncthreads();  // every thread's store and read of part done before thread 0 arrives
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(sync, 1u);
            const unsigned target = (p + 1u) * gridDim.x;
            unsigned seen = 0;
            do {
                asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(sync) : "memory");
            } while (seen < target);
        }
        __syncthreads();
    }
    if (threadIdx.x == 0 && atomicAdd(sync + 1, 1u) == gridDim.x - 1) {
        sync[0] = 0;  // every block is past its last barrier: no one reads sync[0] again
        sync[1] = 0;
    }
}
"""


def chain_floor(pdl_ok: bool, kernels: int = 63, C: int = 768) -> list[dict]:
    """What a chain of ``kernels`` dependent launches costs with no weights to read: as many
    as GPT-2 small's decode step, one block of 256 threads an SM each, in a CUDA graph, with
    and without programmatic dependent launch. ``empty``: the launches alone; ``row``: each
    kernel reads the row of C floats the one before it wrote (every block the whole row,
    through L2), folds it and writes its slice of the next row, the smallest hand-off a step's
    kernel makes. Its time over ``kernels`` is what a step of that many kernels pays however
    few bytes they read. ``persistent``: the same ``kernels`` hand-offs as phases of one
    cooperative launch with a grid-wide barrier between them (where cuda.bindings can make
    cooperative launches): what a barrier costs in place of a kernel boundary."""
    mod = cp.RawModule(code=_CHAIN_SRC)
    empty, row = mod.get_function("chain_empty_kernel"), mod.get_function("chain_row_kernel")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    bufs = [cp.random.standard_normal(C, dtype=cp.float32) for _ in range(2)]
    plans = {"empty": _build.Plan(_build.Launch(empty, (sms,), (256,), (), 0, True) for _ in range(kernels)),
             "row": _build.Plan(_build.Launch(row, (sms,), (256,), (bufs[(i + 1) % 2], bufs[i % 2], np.int32(C)), 0,
                                              True) for i in range(kernels))}
    if _build.cooperative_supported():
        persistent = mod.get_function("chain_persistent_kernel")
        sync = cp.zeros(2, dtype=cp.uint32)
        plans["persistent"] = _build.Plan([_build.Launch(persistent, (sms,), (256,),
                                                         (bufs[0], bufs[1], sync, np.int32(C), np.int32(kernels)),
                                                         0, False, True)])
    rows = []
    stream = cp.cuda.Stream(non_blocking=True)
    for impl, plan in plans.items():
        for pdl in (False, True) if pdl_ok and impl != "persistent" else (False,):
            with stream:
                plan.replay()
                stream.synchronize()
                stream.begin_capture()
                plan.replay(pdl=pdl)
                graph = stream.end_capture()
            us = graph_replay_us(graph, stream, 1)
            rows.append({"bench": "chain", "impl": impl, "kernels": kernels, "C": C, "blocks": sms, "threads": 256,
                         "pdl": pdl, "us": round(us, 2), "us_per_kernel": round(us / kernels, 3)})
            print(f"chain of {kernels} {impl:10s} kernels, pdl {pdl!s:5s}: {us:8.2f} us, {us / kernels:.2f} a kernel",
                  flush=True)
    return rows


def bench_gemv(sizes, dtypes, ceiling, pdl_ok, sweep_dtypes, batches=(1,)) -> list[dict]:
    floor = launch_floor()
    print(f"empty kernel, cold: {floor['us']:.2f} us", flush=True)
    rows = []
    l2 = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["l2CacheSize"]
    for size in sizes:
        for (role, (N, Kd)), dtype, B in itertools.product(gemv_shapes(size).items(), dtypes, batches):
            np_dt, t_dt = DTYPES[dtype]
            s = np.dtype(np_dt).itemsize
            nbytes = N * Kd * s
            copies = max(2, -(-2 * l2 // nbytes))
            tw = [torch.randn(N, Kd, device="cuda", dtype=torch.float32).to(t_dt) for _ in range(copies)]
            tx = torch.randn(B, Kd, device="cuda", dtype=torch.float32).to(t_dt)
            w = [cp.from_dlpack(t) for t in tw]
            x = cp.from_dlpack(tx)
            out = cp.empty((B, N), dtype=np_dt)
            base = {"bench": "gemv", "model": size, "role": role, "N": N, "K": Kd, "dtype": dtype, "batch": B,
                    "bytes": nbytes}

            read_us = nbytes / ceiling / 1e3  # the matrix at the copy bandwidth

            def record(impl, t, **extra):
                row = {**base, "impl": impl, **extra, "us": round(t["us"], 3),
                       "us_min": round(t["us_min"], 3), "us_max": round(t["us_max"], 3),
                       "GBps": round(nbytes / t["us"] / 1e3, 1),
                       "pct_copy": round(100 * nbytes / t["us"] / 1e3 / ceiling, 1),
                       "bound_pct": round(100 * read_us / (read_us + floor["us"]), 1)}
                rows.append(row)
                return row

            def graph_row(impl, fn, **extra):
                for pdl in (False, True) if pdl_ok else (False,):
                    us = graph_time(fn, copies, pdl)
                    rows.append({**base, "impl": impl, **extra, "timing": "graph", "pdl": pdl, "copies": copies,
                                 "us": round(us, 3), "GBps": round(nbytes / us / 1e3, 1),
                                 "pct_copy": round(100 * nbytes / us / 1e3 / ceiling, 1)})

            shapes = [{}]  # launch-shape overrides: the default first
            if dtype in sweep_dtypes and s == 2 and B == 1:  # tensor cores: the warps that split K, and
                shapes += [{"warps": wp} for wp in (2, 4, 8, 16)]  # W a batch ahead or not
                shapes += [{"ahead": a} for a in (False, True)  # (W ahead: blocks of at most 8 warps)
                           if not a or linear_mod._mma_warps(Kd) <= linear_mod.MMA_NARROW_WARPS]
            elif dtype in sweep_dtypes and s == 2:  # n-tiles of 8 rows of x per block
                shapes += [{"tile": t} for t in linear_mod.MMA_TILES]
            elif dtype in sweep_dtypes:
                shapes += [{"tile": t, "warps": wp} for t in linear_mod.TILES for wp in linear_mod.WARPS]
            for kw in shapes:
                impl = "ours-tile" if kw else "ours"
                extra = {k: list(v) if isinstance(v, tuple) else v for k, v in kw.items()}
                t = time_gpu(lambda: K.linear(x, w[0], out=out, **kw))
                record(impl, t, timing="cold", **extra)
                graph_row(impl, lambda i: K.linear(x, w[i], out=out, **kw), **extra)
            t = time_gpu(lambda: F.linear(tx, tw[0]))
            record("cublas", t, timing="cold")
            r = [x for x in rows if x["role"] == role and x["model"] == size and x["dtype"] == dtype
                 and x["batch"] == B and x["impl"] in ("ours", "cublas")]
            print(f"{size:8s} {role:9s} {N:6d}x{Kd:<5d} {dtype:9s} B={B:<3d} "
                  + "  ".join(f"{q['impl']}/{q['timing']}{'/pdl' if q.get('pdl') else ''} "
                              f"{q['us']:7.2f} us {q['pct_copy']:5.1f}%" for q in r), flush=True)
            sweep = [q for q in rows if q["role"] == role and q["model"] == size and q["dtype"] == dtype
                     and q["batch"] == B and q["impl"] == "ours-tile" and q["timing"] == "graph" and q["pdl"] == pdl_ok]
            if sweep:
                print("    tiles (graph): " + ", ".join(
                    f"{q.get('tile')}x{q.get('warps')}{' ahead' if q.get('ahead') else ''} {q['us']:.2f}"
                    for q in sorted(sweep, key=lambda q: q["us"])), flush=True)
            tw = w = None  # free the copies before the next shape
            torch.cuda.empty_cache()
    return [floor] + rows


# ---------------------------------------------------------------------------------------
# the decode step, kernel by kernel
# ---------------------------------------------------------------------------------------
def _kernel_name(launch) -> str:
    """The kernel's C++ name: 'linear_kernel' from '_Z13linear_kernelI6__half...'."""
    name = launch.kernel.name
    m = re.match(r"_Z(\d+)", name)
    return name[m.end():m.end() + int(m.group(1))] if m else name.split("<")[0]


def launch_roles(model, plan, batch: int, cache_rows: int) -> list[tuple[str, int]]:
    """(role, bytes that must move) of each launch of a recorded decode step."""
    cfg = model.config
    s = model.dtype.itemsize
    C, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
    layer = ["qkv", "attn_proj", "fc", "mlp_proj"]
    roles, li = [], 0
    for launch in plan:
        name = _kernel_name(launch)
        if name in ("linear_kernel", "linear_mma_kernel", "linear_mma_ahead_kernel", "linear_mma_stats_warp_kernel",
                    "linear_mma_stream_kernel"):
            N, Kd = int(launch.args[linear_mod.ARG_N]), int(launch.args[linear_mod.ARG_K])
            role = "lm_head" if N == cfg.vocab_size else layer[li % 4]
            li += role != "lm_head"
            roles.append((role, N * Kd * s + batch * (N + Kd) * s))
        elif name == "linear_q8_max_kernel":  # the screened LM head's 8-bit pass (linear_argmax's screen)
            N, Kd = int(launch.args[-3]), int(launch.args[-2])
            roles.append(("lm_head", N * Kd + 12 * N + batch * Kd * s))
        elif name == "linear_mma_list_kernel":  # its exact tiles (a few, known only on the GPU) and the bounds
            roles.append(("lm_head_tiles", 4 * batch * -(-int(launch.args[linear_mod.ARG_N]) // 16)))
        elif name == "linear_q8f_max_kernel":  # the float32 screen's 8-bit pass: W, its scales, x and ln_f
            N, Kd = int(launch.args[-3]), int(launch.args[-2])
            roles.append(("lm_head", N * Kd + 4 * N + 3 * Kd * s))
        elif name == "linear_list_kernel":  # its exact blocks of 32 rows (a few) and their upper bounds
            roles.append(("lm_head_tiles", 4 * -(-int(launch.args[linear_mod.ARG_N]) // 32)))
        elif name in ("decode_attention_kernel", "fixed_attention_kernel"):
            roles.append(("attention", 2 * batch * H * cache_rows * D * s))
        elif name == "decode_attention_merge_kernel":
            roles.append(("attention_merge", batch * C * s))
        elif name.startswith("kv_append"):
            roles.append(("kv_append", 2 * batch * C * s))
        elif name == "ln_rows_kernel":
            roles.append(("layernorm", 2 * batch * int(launch.args[-1]) * s))
        elif name == "embedding_kernel":
            roles.append(("embedding", 3 * batch * C * s))
        else:
            roles.append((name.replace("_kernel", ""), 0))
    if li != 4 * cfg.n_layer:  # a product kernel this function does not know would shift the roles
        raise RuntimeError(f"{li} products in the step's blocks, expected {4 * cfg.n_layer}")
    return roles


def step_replay_us(s, graph, cached: int, replays: int = 20) -> float:
    """us a step of ``graph`` (session ``s``'s decode step): CUDA events around ``replays``
    replays, median of 5, each batch of replays from ``cached`` cached keys (the cache holds
    garbage rows: timing only; positions move on every replay), after 3 warm-up replays."""
    with s.stream:
        for _ in range(3):
            graph.launch(s.stream)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        times = []
        for _ in range(5):
            s.cache.positions.set(np.full(s.batch, cached, np.int32))
            start.record(s.stream)
            for _ in range(replays):
                graph.launch(s.stream)
            stop.record(s.stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / replays)
    return statistics.median(times)


def profile_step(model, batch: int, ceiling: float, replays: int, pdl_ok: bool) -> tuple[list[dict], dict]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from gpt2_cupy.engine import Session

    prompt_len = len(PROMPT)
    max_len = 1024
    rows_out, summary = [], {}
    for pdl in (True, False) if pdl_ok else (False,):  # the profile: without PDL, kernels do not overlap
        s = Session(model, batch, max_len, None, None, cuda_graph=False)
        with s.stream:
            s.cache.positions.set(np.full(batch, prompt_len, np.int32))
        graph = s.capture(pdl, publish=False)
        summary[f"step_us{'_pdl' if pdl else ''}"] = round(step_replay_us(s, graph, prompt_len + 256, replays), 2)
    def traced(graph_pdl: bool) -> list:
        # the graph captured inside the profiler, which then sees every kernel of every replay
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            with s.stream:
                s.stream.begin_capture()
                s.step.replay(pdl=graph_pdl)
                graph = s.stream.end_capture()
                s.cache.positions.set(np.full(batch, prompt_len + 256, np.int32))
                for _ in range(replays):
                    graph.launch(s.stream)
            s.stream.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA
                          and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()),
                         key=lambda e: e.time_range.start)
        if len(kernels) != n * replays:
            raise RuntimeError(f"profiler saw {len(kernels)} kernels, expected {n} x {replays}")
        return kernels

    n = len(s.step)
    # the profile: the plain graph (with PDL, a kernel's time would include its wait)
    kernels = traced(False)
    # with PDL, what each kernel adds to the step: its end after the end of the kernel before
    # it (every kernel waits for the one before it to finish); the first, its own time
    marginal = [None] * n
    if pdl_ok:
        kp = traced(True)
        for j in range(n):
            marginal[j] = statistics.median(
                (kp[i * n + j].time_range.end - kp[i * n + j - 1].time_range.end) if j else
                kp[i * n].time_range.elapsed_us() for i in range(replays))
    # the cache rows each step's attention reads: about the middle of the replays
    roles = launch_roles(model, s.step, batch, prompt_len + 256 + replays // 2)
    for j, launch in enumerate(s.step):
        us = statistics.median(kernels[i * n + j].time_range.elapsed_us() for i in range(replays))
        role, nbytes = roles[j]
        rows_out.append({"index": j, "kernel": _kernel_name(launch), "role": role, "bytes": nbytes,
                         "us": round(us, 3),
                         "GBps": round(nbytes / us / 1e3, 1) if us > 0 else None,
                         "pct_copy": round(100 * nbytes / us / 1e3 / ceiling, 1) if us > 0 else None,
                         "us_pdl_marginal": None if marginal[j] is None else round(marginal[j], 3)})
    summary["kernels"] = n
    summary["kernel_sum_us"] = round(sum(r["us"] for r in rows_out), 2)
    weight_bytes = decode_weight_bytes(model)
    summary["weight_bytes"] = weight_bytes
    summary["floor_us"] = round(weight_bytes / ceiling / 1e3, 2)
    best = min(summary.get("step_us_pdl", 1e30), summary["step_us"])
    summary["pct_floor"] = round(100 * summary["floor_us"] / best, 1)
    return rows_out, summary


def wall_per_token(model, batch: int, new: int = 512, calls: int = 3) -> float:
    """Wall time a token of a ``new``-token generate call: the best of ``calls`` calls after
    one of the same length. (After an 8-token warm-up instead, whose session is another
    bucket's, the first two 512-token calls of GPT-2 small float16 took 242.7 and 188.6 us a
    token and the next ones 179.9, GPT-2 large 1251.5, 964.7 and 928.5 (H100,
    results/wall_calls-h100.log): the first makes the session and runs the prefill launch by
    launch, the second captures the prefill's graph, PREFILL_GRAPH in gpt2_cupy/model.py.)"""
    prompts = [PROMPT] * batch if batch > 1 else PROMPT
    model.generate(prompts, new)
    best = 1e30
    for _ in range(calls):
        cp.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        model.generate(prompts, new)
        cp.cuda.runtime.deviceSynchronize()
        best = min(best, time.perf_counter() - t0)
    return best / new * 1e6


def traced_per_token(model, batch: int, new: int = 512) -> float:
    """GPU time a token of one ``new``-token generate call, prefill included: the span of its
    kernels in a CUPTI trace over ``new``. Run after wall_per_token, whose calls leave the
    session warm. Against wall_per_token it says what the host adds; against the replayed
    step, what a real call's data and positions change on the GPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prompts = [PROMPT] * batch if batch > 1 else PROMPT
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(prompts, new)
        cp.cuda.runtime.deviceSynchronize()
    spans = [e.time_range for e in prof.events() if e.device_type == DeviceType.CUDA]
    return (max(t.end for t in spans) - min(t.start for t in spans)) / new


def bench_steps(cases, ceiling, replays, pdl_ok) -> tuple[list[dict], list[dict]]:
    from gpt2_cupy import GPT2, SIZES
    import transformers

    rows, summaries = [], []
    by_size = {}
    for size, dtype, batch in cases:
        by_size.setdefault(size, []).append((dtype, batch))
    for size, todo in by_size.items():
        torch.manual_seed(0)
        with torch.device("cuda"):
            hf = transformers.GPT2LMHeadModel(SIZES[size].to_hf())
        for dtype in dict.fromkeys(d for d, _ in todo):
            model = GPT2.from_hf(hf, dtype)
            for d, batch in todo:
                if d != dtype:
                    continue
                per_kernel, summary = profile_step(model, batch, ceiling, replays, pdl_ok)
                summary.update({"bench": "decode_step", "impl": "step", "model": size, "dtype": dtype,
                                "batch": batch})
                summary["wall_us_per_token"] = round(wall_per_token(model, batch), 2)
                summary["gpu_us_per_token"] = round(traced_per_token(model, batch), 2)
                summaries.append(summary)
                for r in per_kernel:
                    rows.append({"bench": "decode_step_kernel", "model": size, "dtype": dtype, "batch": batch, **r})
                by_role = {}
                for r in per_kernel:
                    t = by_role.setdefault(r["role"], [0, 0.0, 0])
                    t[0] += 1
                    t[1] += r["us"]
                    t[2] += r["bytes"]
                print("    " + ", ".join(f"{role} {k}x {us:.1f} us ({100 * b / us / 1e3 / ceiling:.0f}%)"
                                         for role, (k, us, b) in by_role.items()), flush=True)
                print(f"{size:12s} {dtype:9s} B={batch:<3d} step {summary['step_us']:8.2f} us"
                      f" (pdl {summary.get('step_us_pdl', float('nan')):8.2f}), kernels {summary['kernel_sum_us']:8.2f} us"
                      f" in {summary['kernels']}, floor {summary['floor_us']:7.2f} us ({summary['pct_floor']}%),"
                      f" wall/token {summary['wall_us_per_token']:8.2f} us"
                      f" (GPU {summary['gpu_us_per_token']:8.2f} us)", flush=True)
            del model
            cp.get_default_memory_pool().free_all_blocks()
        del hf
        torch.cuda.empty_cache()
    return rows, summaries


def _blocks_per_sm(kern, threads: int, smem: int) -> int | None:
    """Blocks of ``kern`` an SM holds at once (the driver's occupancy calculator), or None."""
    try:
        from cuda.bindings import driver

        err, n = driver.cuOccupancyMaxActiveBlocksPerMultiprocessor(driver.CUfunction(kern.kernel.ptr), threads, smem)
        return int(n) if err == driver.CUresult.CUDA_SUCCESS else None
    except ImportError:
        return None


def carveout_sweep(cases, ceiling, pdl_ok, carveouts=(None, 0, 8, 15, 30, 100), rounds: int = 2) -> list[dict]:
    """The step with every kernel's preferred split of the SM's L1 and shared memory
    (``preferred_shared_memory_carveout``, percent of the most shared memory) set alike, or
    left to the driver (None): us a step, CUDA events around 20 replays of its graph at 264
    cached keys, the best of ``rounds`` passes (each the median of 5). Beside it, each kernel's
    registers, threads, shared memory a block and blocks an SM."""
    from gpt2_cupy import GPT2, SIZES
    from gpt2_cupy.engine import Session
    import transformers

    rows, models = [], {}
    for size, dtype, batch in cases:
        if (size, dtype) not in models:
            models.clear()
            cp.get_default_memory_pool().free_all_blocks()
            torch.manual_seed(0)
            with torch.device("cuda"):
                hf = transformers.GPT2LMHeadModel(SIZES[size].to_hf())
            models[(size, dtype)] = GPT2.from_hf(hf, dtype)
            del hf
            torch.cuda.empty_cache()
        s = Session(models[(size, dtype)], batch, 1024, None, None, cuda_graph=False)
        kernels = {}  # one launch of each specialization and launch shape
        for launch in s.step:
            kernels.setdefault((launch.kernel.name, launch.block, launch.shared_mem), launch)
        kernels = {launch.kernel: launch for launch in kernels.values()}
        for k, launch in kernels.items():
            threads = int(np.prod(launch.block))
            rows.append({"bench": "decode_step_kernel_resources", "model": size, "dtype": dtype, "batch": batch,
                         "kernel": _kernel_name(launch), "registers": k.num_regs, "threads": threads,
                         "smem_bytes": k.shared_size_bytes + launch.shared_mem,
                         "blocks_per_sm": _blocks_per_sm(k, threads, launch.shared_mem)})
            print(rows[-1], flush=True)
        times = {co: [] for co in carveouts}
        try:
            for _ in range(rounds):
                for co in carveouts:
                    for k in kernels:
                        k.preferred_shared_memory_carveout = -1 if co is None else co
                    times[co].append(step_replay_us(s, s.capture(pdl_ok, publish=False), 264))
        finally:
            for k in kernels:
                k.preferred_shared_memory_carveout = -1
        for co in carveouts:
            rows.append({"bench": "decode_step_carveout", "model": size, "dtype": dtype, "batch": batch,
                         "cache_rows": 264, "pdl": pdl_ok, "carveout": co, "step_us": round(min(times[co]), 2),
                         "step_us_runs": [round(t, 2) for t in times[co]]})
            print(rows[-1], flush=True)
    return rows


def plot(rows, summaries, device: str | None = None, name: str = "decode_step"):
    shown = [s for s in summaries if s["batch"] == 1]
    if not shown:
        return None
    fig, ax = subplots(1, 1, figsize=(11, 0.6 * len(shown) + 3))
    roles = list(dict.fromkeys(r["role"] for r in rows))
    colors = dict(zip(roles, ["C%d" % i for i in range(10)] * 3))
    labels, named = [], set()
    for y, s in enumerate(shown):
        mine = [r for r in rows if (r["model"], r["dtype"], r["batch"]) == (s["model"], s["dtype"], s["batch"])]
        left = 0.0
        for role in roles:
            us = sum(r["us"] for r in mine if r["role"] == role)
            if us:
                ax.barh(y, us, left=left, color=colors[role], label=None if role in named else role)
                named.add(role)
                left += us
        step = min(s["step_us"], s.get("step_us_pdl", 1e30))
        ax.plot([step], [y], "k|", markersize=18)
        ax.plot([s["floor_us"]], [y], "rx", markersize=10)
        labels.append(f"{s['model']} {s['dtype']}")
    ax.set_yticks(range(len(shown)), labels)
    ax.set_xlabel("us per token, batch 1: kernels (bars), step in its CUDA graph (|), weight-read floor (x)")
    ax.legend(loc="lower right", fontsize=8, ncol=2)  # where the small models leave room
    ax.grid(True, axis="x", which="both", alpha=0.3)
    return save_figure(fig, name, device)


def _profile_rows(rows) -> tuple[list[dict], list[dict]]:
    """(per-kernel rows, per-step summaries) of a results file's rows: what plot draws."""
    return ([r for r in rows if r.get("bench") == "decode_step_kernel"],
            [r for r in rows if r.get("bench") == "decode_step"])


def merge(parts) -> Path:
    """decode_step-<device>.json from the results files of parts of one run's work (``--out``):
    their rows as they are, in the order given, each with its part's copy bandwidth; the
    parts' files, dates, versions and ceilings in ``parts``. The parts must come from one
    device, and no step (model, dtype, batch) nor product shape may be in two of them. The file
    names the parts' device and, where the parts agree on them, their versions (a merge needs no
    GPU)."""
    docs = [(Path(f), json.loads(Path(f).read_text())) for f in parts]
    devices = {doc["device"] for _, doc in docs}
    if len(devices) != 1:
        raise ValueError(f"the parts come from several devices: {sorted(devices)}")
    rows, seen = [], {}
    for f, doc in docs:
        copy = doc["ceilings"]["copy_GBps"]
        for r in doc["rows"]:
            if r.get("bench") in ("decode_step", "gemv", "launch"):
                key = tuple(r.get(k) for k in ("bench", "model", "dtype", "batch", "role", "impl", "timing", "pdl",
                                               "tile", "warps", "ahead"))
                if key in seen and seen[key] != f.name:
                    raise ValueError(f"{f.name} and {seen[key]} both hold {key}")
                seen[key] = f.name
            rows.append({**r, "copy_GBps": copy})
    copies = [doc["ceilings"]["copy_GBps"] for _, doc in docs]
    same = all(doc["versions"] == docs[0][1]["versions"] for _, doc in docs)  # (else each part's alone)
    return write_results("decode_step", rows, {"copy_GBps_min": min(copies), "copy_GBps_max": max(copies)},
                         device=devices.pop(), versions_=docs[0][1]["versions"] if same else {},
                         parts=[{"file": f.name, "date": doc["date"], "versions": doc["versions"],
                                 "ceilings": doc["ceilings"]} for f, doc in docs])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="GPT-2 small only, fewer cases")
    p.add_argument("--skip-gemv", action="store_true")
    p.add_argument("--skip-profile", action="store_true")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--gemv-sizes", nargs="*", help="model sizes of the matrix-vector part (default: gpt2 gpt2-xl)")
    p.add_argument("--gemv-dtypes", nargs="*", help="dtypes of the matrix-vector part (default: all)")
    p.add_argument("--gemv-batches", nargs="*", type=int, default=[1], help="rows of x (default: 1)")
    p.add_argument("--sweep-dtypes", nargs="*", default=["float16"],
                   help="dtypes whose other launch shapes are timed too (default: float16)")
    p.add_argument("--steps", nargs="*", metavar="SIZE:DTYPE:BATCH",
                   help="decode steps to profile (default: every size and dtype at batch 1 and 8)")
    p.add_argument("--chain", action="store_true",
                   help="only the chain of empty / row hand-off kernels (decode_step_chain-<device>.json)")
    p.add_argument("--replot", metavar="JSON", help="only redraw the picture from a results file")
    p.add_argument("--out", default="decode_step", metavar="NAME",
                   help="results file NAME-<device>.json (default decode_step); a part of the run for --merge")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="only write decode_step-<device>.json and its picture from the parts' results files")
    p.add_argument("--carveout-sweep", nargs="*", metavar="SIZE:DTYPE:BATCH",
                   help="only the step with every kernel's split of L1 and shared memory set alike, at several "
                        "splits (into decode_step_carveout-<device>.json)")
    args = p.parse_args()
    if args.replot:
        rows = json.loads(open(args.replot).read())["rows"]
        # the picture beside its file: <name>-<device>.json -> <name>-<device>.png
        name, _, device = re.sub(r"\.json$", "", args.replot.rsplit("/", 1)[-1]).rpartition("-")
        print(plot(*_profile_rows(rows), device, name or "decode_step"))
        return
    if args.merge:
        path = merge(args.merge)
        print(f"wrote {path}")
        doc = json.loads(path.read_text())
        print(f"wrote {plot(*_profile_rows(doc['rows']), device_slug(doc['device']))}")
        return
    print(banner())
    ceiling = copy_ceiling_GBps()
    pdl_ok = _build.pdl_supported()
    print(f"copy ceiling {ceiling:.0f} GB/s; programmatic dependent launch: {pdl_ok}")
    if args.carveout_sweep is not None:
        cases = [(c.split(":")[0], c.split(":")[1], int(c.split(":")[2])) for c in args.carveout_sweep or
                 ("gpt2:float16:1", "gpt2:float16:8", "gpt2-xl:float16:1")]
        print(write_results("decode_step_carveout", carveout_sweep(cases, ceiling, pdl_ok),
                            {"copy_GBps": round(ceiling, 1)}))
        return
    if args.chain:
        print(write_results("decode_step_chain", chain_floor(pdl_ok), {"copy_GBps": round(ceiling, 1)}))
        return
    rows = []
    if not args.skip_gemv:
        sizes = args.gemv_sizes or (["gpt2"] if args.quick else ["gpt2", "gpt2-xl"])
        dtypes = args.gemv_dtypes or (["float16"] if args.quick else list(DTYPES))
        rows += bench_gemv(sizes, dtypes, ceiling, pdl_ok, set(args.sweep_dtypes), args.gemv_batches)
    summaries = []
    if not args.skip_profile:
        if args.steps:
            cases = [(c.split(":")[0], c.split(":")[1], int(c.split(":")[2])) for c in args.steps]
        elif args.quick:
            cases = [("gpt2", "float16", 1), ("gpt2", "float16", 8)]
        else:
            cases = [(size, dtype, b) for size in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
                     for dtype in DTYPES for b in (1, 8)]
        step_rows, summaries = bench_steps(cases, ceiling, args.replays, pdl_ok)
        rows += step_rows
    path = write_results(args.out, rows + summaries, {"copy_GBps": round(ceiling, 1)})
    print(f"wrote {path}")
    if summaries and args.out == "decode_step":
        print(f"wrote {plot([r for r in rows if r['bench'] == 'decode_step_kernel'], summaries)}")


if __name__ == "__main__":
    main()
