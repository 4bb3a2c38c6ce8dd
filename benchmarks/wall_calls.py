"""Wall time a token of consecutive 512-token generate calls (GPT-2 float16, batch 1, random
weights): after an 8-token warm-up call (another session bucket), again, with Python's garbage
collector off, after a CUPTI trace of one call, and after decode_step's profile of the step.
What a warm-up must be before the wall time of a call is measured (decode_step's
wall_per_token).

    python -m benchmarks.wall_calls gpt2 gpt2-large [--pause 1.0]

``--pause S``: S seconds of idle GPU before each call, and the GPU's SM and memory clocks
(nvidia-smi) just before it. Prints one line of us a token per series.
"""

from __future__ import annotations

import argparse
import gc
import subprocess
import time

import cupy as cp

from benchmarks import decode_step as D
from benchmarks.common import banner, copy_ceiling_GBps, random_model
from cupy_kernels import _build


def clocks() -> str:
    out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return out.stdout.strip().replace(" ", "")


def calls(model, tag: str, n: int = 4, new: int = 512, pause: float = 0.0) -> None:
    out = []
    for _ in range(n):
        cp.cuda.runtime.deviceSynchronize()
        if pause:
            time.sleep(pause)
            out.append(clocks())
        t0 = time.perf_counter()
        model.generate(D.PROMPT, new)
        cp.cuda.runtime.deviceSynchronize()
        out.append(f"{(time.perf_counter() - t0) / new * 1e6:8.2f}")
    print(f"{tag:40s}", " ".join(out), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("sizes", nargs="+")
    p.add_argument("--pause", type=float, default=0.0)
    args = p.parse_args()
    print(banner())
    for size in args.sizes:
        model = random_model(size)
        model.generate(D.PROMPT, 8)
        calls(model, f"{size} fresh, after warm 8", pause=args.pause)
        calls(model, f"{size} again", pause=args.pause)
        if not args.pause:
            gc.disable()
            calls(model, f"{size} gc off")
            gc.enable()
            print("gpu/token", D.traced_per_token(model, 1), flush=True)
            calls(model, f"{size} after one trace")
            D.profile_step(model, 1, copy_ceiling_GBps(), 20, _build.pdl_supported())
            calls(model, f"{size} after profile_step")
            gc.collect()
            calls(model, f"{size} after gc.collect")
            gc.disable()
            calls(model, f"{size} after profile, gc off")
            gc.enable()
        del model
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
