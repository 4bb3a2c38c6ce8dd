"""A-B of decode-step variants on one session's buffers.

    python -m benchmarks.step_variants gpt2:float16:1 gpt2-xl:float16:1 \
        --variant base --variant "deep:DECODE_AHEAD_WIDTH=768" --variant "chunks:DECODE_SPLIT_KEYS=256"

Rebuilding a session (new decode buffers and KV cache) moved GPT-2 small's step by up to 2%
on the H100 (208.7-211.9 us, benchmarks/results/late_release_one_process-h100.log), as much
as many changes measured. Here each case (size:dtype:batch) makes one model (random weights,
seed 0) and one session by a 512-token greedy call; then the step is recorded once per
variant over that session's buffers and captured as a CUDA graph with programmatic dependent
launch. Four rounds, in alternating order, swap each variant's graphs into the session and
time a 512-token call (wall time a token, the median of two; its steps run in the session's
graph for calls that read every step, ``gpt2_cupy.engine.STEPS_PER_GRAPH_FIXED_LENGTH`` steps a
launch) and a sweep of 512 steps from
8 cached keys (us a step: the lengths such a call runs, without the host; 512 / n launches of
the session's graph of n steps, ``gpt2_cupy.engine.STEPS_PER_GRAPH``). The spread of one
variant's rounds is about 0.2%.

A variant may also set ``layers=n`` (a bound, timing only: its tokens are wrong): its step is
recorded with layer i reading layer (i mod n)'s weights, so that n layers' weights are all the
step's blocks read; with n = 1 a layer's weights can stay in L2 from one layer to the next
(14.2 MB for GPT-2 small in 16 bits, 25.2 MB for medium; the H100's L2 holds 50 MB, the
H200's 60 MiB).

A variant is ``name`` or ``name:CONST=value[;CONST=value...]``: constants (Python literals)
in effect while its step is recorded, restored after: CONST of gpt2_cupy.model, or
module.CONST of another module of gpt2_cupy or cupy_kernels (e.g.
``cupy_kernels.linear.MMA_CHUNKS_PER_WARP=3``: what a launch's shape is chosen from, read when
the step is recorded). The first variant is the reference of the ratios. Writes
benchmarks/results/<--name>-<device>.json (step_variants by default).
"""

from __future__ import annotations

import argparse
import ast
import gc
import importlib
import statistics
import time

import cupy as cp
import numpy as np

from benchmarks.common import banner, random_model, write_results
from benchmarks.decode_step import PROMPT

ROUNDS = 4
NEW = 512
START = 8  # cached keys at the sweep's first replay (the prompt's length)


def _owner(key: str):
    """(module, attribute) of a setting's key: CONST (gpt2_cupy.model) or module.CONST."""
    module, _, attr = key.rpartition(".")
    module = module or "gpt2_cupy.model"
    if not attr.isupper() or module.split(".")[0] not in ("gpt2_cupy", "cupy_kernels"):
        return None, attr
    try:
        mod = importlib.import_module(module)  # (the module itself, where a package attribute shadows it)
    except ImportError:
        return None, attr
    return (mod, attr) if hasattr(mod, attr) else (None, attr)


def parse_variant(text: str, layers: bool = False) -> tuple[str, dict]:
    """``name[:CONST=value;...]`` -> (name, {key: value}), each key CONST (gpt2_cupy.model)
    or module.CONST (a module of gpt2_cupy or cupy_kernels) and each value a Python literal;
    with ``layers``, also ``layers=n`` (a count of at least 1)."""
    name, _, sets = text.partition(":")
    if not name:
        raise ValueError(f"variant {text!r} has no name")
    settings = {}
    for item in filter(None, (s.strip() for s in sets.split(";"))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if layers and key == "layers":
            if not value.strip().isdigit() or int(value) < 1:
                raise ValueError(f"variant {name!r}: layers={value.strip()!r} is not a count of at least 1")
            settings[key] = int(value)
            continue
        if not eq or _owner(key)[0] is None:
            raise ValueError(f"variant {name!r}: {item!r} is not CONST=value for a constant of gpt2_cupy.model, "
                             f"nor module.CONST=value for one of another gpt2_cupy or cupy_kernels module")
        try:
            settings[key] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError) as err:
            raise ValueError(f"variant {name!r}: the value of {key} is not a Python literal: {value!r}") from err
    return name, settings


def parse_case(text: str) -> tuple[str, str, int]:
    from gpt2_cupy import SIZES

    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in SIZES or parts[1] not in ("float32", "float16", "bfloat16") \
            or not parts[2].isdigit() or int(parts[2]) < 1:
        raise ValueError(f"case {text!r} is not size:dtype:batch (sizes {', '.join(SIZES)}; float32, float16 or "
                         f"bfloat16; a batch of at least 1)")
    return parts[0], parts[1], int(parts[2])


def _call_us(model, prompts) -> float:
    cp.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    model.generate(prompts, NEW)
    cp.cuda.runtime.deviceSynchronize()
    return (time.perf_counter() - t0) / NEW * 1e6


# what a variant sets in the session (Session.set_steps_per_graph and the recorded step)
_STATE = ("step", "step_lead", "step_next", "per_graph", "per_graph_fixed", "slots", "pinned", "slot", "publish", "graph",
          "graph_many", "graph_fixed", "events", "_event_of", "_next_slot")


def _sweep_us(session) -> float:
    """A step's time over NEW steps of the session's graphs from START cached keys (median of 3)."""
    n = session.per_graph
    graph = session.graph_many if n > 1 else session.graph
    times = []
    with session.stream:
        for _ in range(3):
            session.cache.positions.set(np.full(session.batch, START, np.int32))
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(session.stream)
            for _ in range(NEW // n):
                graph.launch(session.stream)
            stop.record(session.stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / NEW)
    session._next_slot = -1  # (the replays moved the read-back slot on: the next call sets it again)
    return statistics.median(times)


def run_case(size: str, dtype: str, batch: int, variants: list[tuple[str, dict]]) -> list[dict]:
    import gpt2_cupy.engine as E

    model = random_model(size, dtype)
    prompts = [PROMPT] * batch if batch > 1 else PROMPT
    model.generate(prompts, NEW)  # the session every variant's step runs on
    (session,) = [s for pool in model.engine._sessions.values() for s in pool]
    if session.graph is None:
        raise RuntimeError("the session has no CUDA graph")
    kept = {}
    blocks = model.blocks
    for name, settings in variants:
        owners = {k: _owner(k) for k in settings if k != "layers"}
        saved = {k: getattr(mod, attr) for k, (mod, attr) in owners.items()}
        try:
            for k, (mod, attr) in owners.items():
                setattr(mod, attr, settings[k])
            if "layers" in settings:  # (a bound: layer i reads layer i mod n's weights)
                model.blocks = [blocks[i % settings["layers"]] for i in range(len(blocks))]
            session.step = model.record_step(session.cache, session.buf, None)
            if NEW % E.STEPS_PER_GRAPH:
                raise ValueError(f"variant {name!r}: {NEW} steps are not a whole number of graphs of "
                                 f"{E.STEPS_PER_GRAPH}")
            session.set_steps_per_graph(E.STEPS_PER_GRAPH)
            session.prepare_fixed_length()  # (the calls' graph: captured here, not in a timed call)
        finally:
            model.blocks = blocks
            for k, v in saved.items():
                setattr(*owners[k], v)
        kept[name] = {a: getattr(session, a) for a in _STATE}
    names = [n for n, _ in variants]
    calls, sweeps = {n: [] for n in names}, {n: [] for n in names}
    current = names[-1]
    for r in range(ROUNDS):
        for n in names if r % 2 == 0 else names[::-1]:
            session.stream.synchronize()
            kept[current] = {a: getattr(session, a) for a in _STATE}
            for a, v in kept[n].items():
                setattr(session, a, v)
            current = n
            calls[n].append(statistics.median(_call_us(model, prompts) for _ in range(2)))
            sweeps[n].append(_sweep_us(session))
    ref_call, ref_sweep = statistics.median(calls[names[0]]), statistics.median(sweeps[names[0]])
    rows = []
    for name, settings in variants:
        call, sweep = statistics.median(calls[name]), statistics.median(sweeps[name])
        rows.append({"bench": "step_variants", "model": size, "dtype": dtype, "batch": batch, "variant": name,
                     "settings": {k: repr(v) for k, v in settings.items()}, "steps_per_graph": kept[name]["per_graph"],
                     "steps_per_graph_fixed_length": kept[name]["per_graph_fixed"],
                     "call_us_per_token": round(call, 2), "call_rounds": [round(v, 2) for v in calls[name]],
                     "sweep_us": round(sweep, 2), "sweep_rounds": [round(v, 2) for v in sweeps[name]],
                     "call_ratio": round(call / ref_call, 4), "sweep_ratio": round(sweep / ref_sweep, 4)})
        print(f"{size} {dtype} B={batch} {name:16s} call {call:9.1f} us/token ({call / ref_call:.3f}x)  "
              f"sweep {sweep:9.2f} us ({sweep / ref_sweep:.3f}x)  rounds {' '.join(f'{v:.1f}' for v in sweeps[name])}",
              flush=True)
    del model, session, kept
    gc.collect()
    return rows


def parse_command_line(doc: str, name: str, case_help: str, case_of, options=None, layers: bool = False) -> tuple:
    """(cases, variants, results name, all parsed arguments) of a variants benchmark's command
    line: cases parsed by ``case_of``, then ``--variant`` (repeated; the first is the
    reference; ``layers=n`` accepted where ``layers``) and ``--name``; ``options(parser)`` adds
    the benchmark's own arguments."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if options is not None:
        options(p)
    p.add_argument("cases", nargs="+", help=case_help)
    p.add_argument("--variant", action="append", required=True,
                   help="name[:CONST=value;...] (constants of gpt2_cupy.model, or module.CONST); repeat; the first "
                        "is the reference")
    p.add_argument("--name", default=name, help="results file name (without -<device>.json)")
    args = p.parse_args()
    try:
        cases = [case_of(c) for c in args.cases]
        variants = [parse_variant(v, layers) for v in args.variant]
    except ValueError as err:
        p.error(str(err))
    if len({n for n, _ in variants}) != len(variants):
        p.error("variant names must differ")
    return cases, variants, args.name, args


def main():
    cases, variants, name, _ = parse_command_line(__doc__, "step_variants", "size:dtype:batch, e.g. gpt2:float16:1",
                                               parse_case, layers=True)
    print(banner(), flush=True)
    rows = []
    for size, dtype, batch in cases:
        rows += run_case(size, dtype, batch, variants)
        write_results(name, rows, {})  # (after every case: a run cut short keeps what it measured)
    print(f"wrote {write_results(name, rows, {})}")


if __name__ == "__main__":
    main()
