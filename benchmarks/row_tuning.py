"""Exploration behind the row kernels' fixed choices: vectors per thread (U) and where the
row is kept (registers or shared memory), for layernorm and softmax, in one run.

    python -m benchmarks.row_tuning

Writes benchmarks/results/row_tuning-<device>.json (rows: bench, dtype, rows, cols, u,
in_regs, us, GBps). The wrappers' defaults cite what it measured.
"""

from __future__ import annotations

import importlib
import itertools

import cupy as cp
import numpy as np

from benchmarks.common import banner, copy_ceiling_GBps, time_gpu, write_results
from cupy_kernels import _build

layernorm = importlib.import_module("cupy_kernels.layernorm")  # the modules, not the functions
softmax = importlib.import_module("cupy_kernels.softmax")

CASES = [(16384, 4096), (65536, 768), (8, 1024)]
US = (2, 4, 8)
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": _build.BFLOAT16}


def main():
    print(banner())
    ceiling = copy_ceiling_GBps()
    for c, u, regs in itertools.product(_build.CTYPES.values(), US, (True, False)):
        _build.declare("layernorm.cu", [layernorm._name(c, _build.vec_widths(c)[1], False, regs, u)])
    for c, u, regs in itertools.product(_build.CTYPES.values(), US, (True, False)):
        _build.declare("softmax.cu", [softmax._name(c, _build.vec_widths(c)[1], regs, u)])
    rows_out = []
    for (rows, cols), (dname, dtype) in itertools.product(CASES, DTYPES.items()):
        x = cp.random.standard_normal((rows, cols), dtype=np.float32).astype(dtype)
        w = cp.random.standard_normal(cols, dtype=np.float32).astype(dtype)
        out = cp.empty_like(x)
        nbytes = 2 * x.nbytes
        for u, regs in itertools.product(US, (True, False)):
            if regs and _build.cdiv(cols, 16 // x.itemsize) > 1024 * u:
                continue
            for bench, fn in (
                ("layernorm", lambda: layernorm._launch(out, None, x, None, None, w, w, 1e-5, u=u, in_regs=regs)),
                ("softmax", lambda: softmax._launch(out, x, 1, False, 1.0, u=u, in_regs=regs)),
            ):
                us = time_gpu(fn)["us"]
                rows_out.append({"bench": bench, "dtype": dname, "rows": rows, "cols": cols, "u": u,
                                 "in_regs": regs, "us": round(us, 2), "GBps": round(nbytes / us / 1e3, 1)})
                print(f"{bench:9s} {dname:8s} {rows:6d}x{cols:<5d} U={u} {'regs  ' if regs else 'shared'} "
                      f"{us:8.2f} us {nbytes / us / 1e3:6.0f} GB/s ({nbytes / us / 1e3 / ceiling:.0%})", flush=True)
    print(write_results("row_tuning", rows_out, {"copy_GBps": round(ceiling, 1)}))


if __name__ == "__main__":
    main()
