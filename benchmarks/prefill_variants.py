"""A-B of prefill variants: a warm prefill of short prompts, and a warm one-token call.

    python -m benchmarks.prefill_variants gpt2:float16 gpt2-xl:float16 \
        --variant base --variant "gemm:SHORT_PROMPT=0"

Each case (size:dtype) makes one model (random weights, seed 0). For each prompt set (by
default one prompt of 8 tokens, one of 16, 4, 64 and 256 of 8 prefilled together; ``--sets``
picks others of PROMPT_SETS, e.g. ``--sets 256x8,512x8,1x512``) and each variant, the prefill
runs as ``generate`` runs it: into a KV cache of its own, on a stream of its own (the recorded
forward's CUDA graph, ``gpt2_cupy.model._forward``), warm, the best of 20 timed on the host
around device synchronizations; then a warm ``generate(prompt, max_new_tokens=1)`` of the
8-token prompt (in a fresh engine per variant). Each prefill is also timed on the GPU alone
(``<set>_gpu_ms``: its launches queued behind a waiting kernel, the best of 5), which shows
how much of the host-timed call is the host's. Rounds alternate the variants' order. A
variant is ``name`` or ``name:CONST=value[;...]`` as in :mod:`benchmarks.step_variants`,
in effect while it runs. Writes benchmarks/results/<--name>-<device>.json
(prefill_variants by default).
"""

from __future__ import annotations

import argparse
import statistics

import cupy as cp
import numpy as np

from benchmarks.common import banner, best_host_seconds, gpu_seconds_behind_wait, random_model, write_results
from benchmarks.step_variants import _owner, parse_command_line

ROUNDS = 3
REPEATS = 20
GPU_REPEATS = 5
PROMPT_SETS = {"1x8": (8,), "1x16": (16,), "4x8": (8,) * 4, "64x8": (8,) * 64, "128x8": (8,) * 128,
               "256x8": (8,) * 256, "512x8": (8,) * 512, "1x100": (100,), "1x512": (512,), "1x1000": (1000,),
               "4x300": (300,) * 4, "16x500": (500,) * 16}
DEFAULT_SETS = ("1x8", "1x16", "4x8", "64x8", "256x8")


def parse_case(text: str) -> tuple[str, str]:
    from gpt2_cupy import SIZES

    size, _, dtype = text.partition(":")
    if size not in SIZES or dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"case {text!r} is not size:dtype (sizes {sorted(SIZES)}; float16, bfloat16, float32)")
    return size, dtype


def _measure(model, prompts: dict) -> dict:
    """Seconds: each prompt set's prefill alone, and a one-token call of the 8-token prompt."""
    from gpt2_cupy.model import KVCache

    stream = cp.cuda.Stream(non_blocking=True)
    out = {}
    for key, rows in prompts.items():
        kv = KVCache(model.config, len(rows), max(r.size for r in rows) + 1, model.dtype)
        last = cp.empty((len(rows), model.config.n_embd), dtype=model.dtype)

        def prefill():
            with stream:
                model._prefill(rows, kv, list(range(len(rows))), last)

        out[key] = best_host_seconds(prefill, REPEATS)
        out[f"{key}_gpu"] = gpu_seconds_behind_wait(prefill, stream, GPU_REPEATS, 4 * out[key] + 0.02)
    model._engine = None  # (a fresh engine: the call's session is recorded under this variant)
    first = prompts["1x8"][0].tolist()
    out["one_token_call"] = best_host_seconds(lambda: model.generate(first, 1), REPEATS)
    return out


def run_case(size: str, dtype: str, variants: list[tuple[str, dict]], sets=DEFAULT_SETS) -> list[dict]:
    model = random_model(size, dtype)
    rng = np.random.default_rng(0)
    prompts = {k: [rng.integers(0, 50257, n) for n in PROMPT_SETS[k]] for k in dict.fromkeys(("1x8",) + tuple(sets))}
    names = [n for n, _ in variants]
    times = {n: [] for n in names}
    for r in range(ROUNDS):
        for name, settings in variants if r % 2 == 0 else variants[::-1]:
            owners = {k: _owner(k) for k in settings}
            saved = {k: getattr(mod, attr) for k, (mod, attr) in owners.items()}
            try:
                for k, v in settings.items():
                    setattr(*owners[k], v)
                times[name].append(_measure(model, prompts))
            finally:
                for k, v in saved.items():
                    setattr(*owners[k], v)
    rows = []
    for name, settings in variants:
        row = {"bench": "prefill_variants", "model": size, "dtype": dtype, "variant": name,
               "settings": {k: repr(v) for k, v in settings.items()}, "rounds": ROUNDS, "repeats": REPEATS}
        for key in list(prompts) + [f"{k}_gpu" for k in prompts] + ["one_token_call"]:
            row[f"{key}_ms"] = round(statistics.median(t[key] for t in times[name]) * 1e3, 4)
            row[f"{key}_rounds_ms"] = [round(t[key] * 1e3, 4) for t in times[name]]
        rows.append(row)
        sets = "  ".join(f"{k} {row[f'{k}_ms']:8.3f} ({row[f'{k}_gpu_ms']:.3f}) ms" for k in prompts)
        print(f"{size} {dtype} {name:12s} {sets}  one_token_call {row['one_token_call_ms']:.3f} ms", flush=True)
    return rows


def parse_sets(text: str) -> tuple[str, ...]:
    """``--sets``: comma-separated keys of PROMPT_SETS, each once."""
    sets = tuple(dict.fromkeys(text.split(",")))
    unknown = [k for k in sets if k not in PROMPT_SETS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown prompt sets {unknown} (known: {', '.join(PROMPT_SETS)})")
    return sets


def main():
    def options(parser):
        parser.add_argument("--sets", type=parse_sets, default=DEFAULT_SETS,
                            help=f"prompt sets, comma-separated, of {', '.join(PROMPT_SETS)}")

    cases, variants, name, args = parse_command_line(__doc__, "prefill_variants", "size:dtype, e.g. gpt2:float16",
                                                     parse_case, options)
    print(banner(), flush=True)
    rows = []
    for size, dtype in cases:
        rows += run_case(size, dtype, variants, args.sets)
        write_results(name, rows, {})
    print(f"wrote {write_results(name, rows, {})}")


if __name__ == "__main__":
    main()
