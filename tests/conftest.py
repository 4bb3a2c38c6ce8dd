"""Test configuration: tests marked ``gpu`` run only where CuPy sees a CUDA device."""

from __future__ import annotations

import pytest


def _gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver, no device, no CuPy
        return False


HAS_GPU = _gpu_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU visible to CuPy")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def compiled():
    """Every declared kernel specialization compiled once per session, before the GPU tests
    that ask for it: a compile error is one clear failure, and no test times NVRTC."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    import cupy_kernels  # noqa: F401  (declares every specialization)
    from cupy_kernels import _build

    jobs = [(source, name) for source, names in _build.declared().items() for name in names]
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # NVRTC runs outside the GIL
        list(pool.map(lambda job: _build.kernel(*job), jobs))
