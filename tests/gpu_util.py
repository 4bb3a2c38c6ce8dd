"""Helpers of the GPU test modules: random inputs rounded to the storage dtype, poisoned
outputs, and the relative-error check against a float64 reference."""

from __future__ import annotations

import cupy as cp
import numpy as np

from cupy_kernels import _build

DTYPES = [np.float32, np.float16, _build.BFLOAT16]
# max |out - ref| / max |ref| allowed: float32 arithmetic, then rounding to the storage type
TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3, _build.BFLOAT16: 1.6e-2}


def rand(rng, shape, dtype, scale=1.0):
    """Random values already rounded to ``dtype``; returns (gpu array, float64 host copy)."""
    host = (rng.standard_normal(shape) * scale).astype(np.float32)
    dev = cp.asarray(host).astype(dtype)
    return dev, dev.astype(cp.float32).get().astype(np.float64)


def poisoned(shape, dtype):
    return cp.full(shape, np.nan, dtype=np.float32).astype(dtype)


def check(out, expect, dtype, tol=None):
    got = out.astype(cp.float32).get().astype(np.float64)
    assert np.isfinite(got).all(), "unwritten (poisoned) or non-finite outputs"
    scale = max(np.abs(expect).max(), 1e-30)
    err = np.abs(got - expect).max() / scale
    assert err <= (tol or TOL[np.dtype(dtype)]), f"relative error {err:.3g}"
