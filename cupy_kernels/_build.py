"""Run-time compilation of ``src_cu/`` through NVRTC: the only place a ``RawModule`` is made.

Each kernel module declares its template specializations at import time with
:func:`declare`; :func:`kernel` returns one of them, compiled on first use (one NVRTC
call per specialization, cached by file, name and options: a model pays only for the
few of a family's dozens of specializations it launches). The compiled text starts with a hash of ``src_cu/*.cuh``, because CuPy's
on-disk cache is keyed by source text and options and would otherwise miss header edits.

:func:`compile_for_arch` compiles the same text with the same options through
``cupy.cuda.nvrtc`` directly, which needs no GPU: the CPU test suite uses it to prove
that every declared specialization compiles for each supported architecture.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
from pathlib import Path
from typing import NamedTuple

import numpy

try:  # bfloat16 as a numpy dtype; CuPy >= 14 understands it when ml_dtypes is present
    import ml_dtypes

    BFLOAT16 = numpy.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a dependency
    BFLOAT16 = None


def _find_src_dir() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "src_cu", here.parent / "src_cu"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"src_cu/ with common.cuh not found next to {here}")


SRC_DIR = _find_src_dir()

# numpy dtype -> C++ storage type; every kernel family is instantiated from this table.
CTYPES: dict[numpy.dtype, str] = {
    numpy.dtype(numpy.float32): "float",
    numpy.dtype(numpy.float16): "__half",
}
if BFLOAT16 is not None:
    CTYPES[BFLOAT16] = "__nv_bfloat16"

# The architectures the CPU test compiles every specialization for.
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")

_declared: dict[str, list[str]] = {}
_declared_keys: set[tuple[str, str]] = set()  # (source, name) of every declared specialization
_pdl: set[tuple[str, str]] = set()  # specializations that call griddep_wait() first (common.cuh)
_cooperative: set[tuple[str, str]] = set()  # specializations whose blocks must all be resident at once


def declare(source: str, name_expressions, pdl: bool = False, cooperative: bool = False) -> None:
    """Register template specializations of ``src_cu/<source>`` (call at import).

    ``pdl``: the kernels call ``griddep_wait()`` before touching anything an earlier
    kernel wrote, so a captured plan may launch them with programmatic dependent launch.
    ``cooperative``: the kernels synchronize across blocks, so every launch of them goes
    through the driver's ``cuLaunchKernelEx`` as a cooperative launch (all blocks resident)."""
    if not (SRC_DIR / source).is_file():
        raise FileNotFoundError(f"no kernel source {SRC_DIR / source}")
    names = _declared.setdefault(source, [])
    for name in name_expressions:
        if name not in names:
            names.append(name)
            _declared_keys.add((source, name))
        if pdl:
            _pdl.add((source, name))
        if cooperative:
            _cooperative.add((source, name))


def declared() -> dict[str, tuple[str, ...]]:
    """Every declared specialization, by source file."""
    return {source: tuple(names) for source, names in _declared.items()}


def ctype(dtype) -> str:
    """The C++ storage type for a numpy/CuPy dtype, or TypeError."""
    dtype = numpy.dtype(dtype)
    try:
        return CTYPES[dtype]
    except KeyError:
        supported = ", ".join(str(d) for d in CTYPES)
        raise TypeError(f"unsupported dtype {dtype}; supported: {supported}") from None


@functools.cache
def _headers_hash() -> str:
    digest = hashlib.sha256()
    for header in sorted(SRC_DIR.glob("*.cuh")):
        digest.update(header.name.encode())
        digest.update(header.read_bytes())
    return digest.hexdigest()[:16]


def source_text(source: str) -> str:
    """The text handed to NVRTC: a header hash line, then the file."""
    return f"// src_cu headers {_headers_hash()}\n" + (SRC_DIR / source).read_text()


@functools.cache
def _cuda_include_dirs() -> tuple[str, ...]:
    """Directories holding cuda_fp16.h / cuda_bf16.h (pip wheels or a CUDA toolkit)."""
    candidates = []
    try:
        import nvidia

        for base in nvidia.__path__:
            base = Path(base)
            candidates += [base / "cuda_runtime" / "include", *sorted(base.glob("cu*/include"))]
    except ImportError:
        pass
    for var in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(var):
            candidates.append(Path(os.environ[var]) / "include")
    candidates.append(Path("/usr/local/cuda/include"))
    found = [str(c) for c in candidates if (c / "cuda_fp16.h").is_file()]
    return tuple(dict.fromkeys(found))


def options() -> tuple[str, ...]:
    """NVRTC options shared by the run-time path and :func:`compile_for_arch`."""
    includes = (SRC_DIR.as_posix(), *_cuda_include_dirs())
    # -default-device: unannotated functions (generic lambdas among them) are device code
    return ("-std=c++17", "-default-device", *(f"-I{d}" for d in includes))


@functools.cache
def _module(source: str, names: tuple[str, ...], opts: tuple[str, ...]):
    import cupy

    return cupy.RawModule(code=source_text(source), options=opts, name_expressions=names)


_kernels: dict[tuple[int, str, str], object] = {}  # (device, source, name) -> its RawKernel, once loaded


def kernel(source: str, name_expression: str):
    """The ``cupy.RawKernel`` for one declared specialization (a recorder while recording).
    Each is looked up once per device (a launch's host time matters: a prefill runs
    hundreds of them)."""
    import cupy

    key = (source, name_expression)
    if key not in _declared_keys:
        listing = "\n  ".join(_declared.get(source, ())) or "(none)"
        raise KeyError(f"{name_expression} is not a declared specialization of {source}; declared:\n  {listing}")
    kern = _kernels.get((cupy.cuda.runtime.getDevice(), *key))
    if kern is None:
        kern = _module(source, (name_expression,), options()).get_function(name_expression)
        _kernels[(cupy.cuda.runtime.getDevice(), *key)] = kern
    if key in _cooperative:
        return _Cooperative(kern) if _plan is None else _Recorder(kern, _plan, False, True)
    return kern if _plan is None else _Recorder(kern, _plan, key in _pdl)


# ---------------------------------------------------------------------------------------
# launch plans: record the launches a block of wrapper calls makes, replay them later
# ---------------------------------------------------------------------------------------
class Launch(NamedTuple):
    kernel: object  # cupy.RawKernel
    grid: tuple
    block: tuple
    args: tuple
    shared_mem: int
    pdl: bool = False  # may start before the previous kernel ends (it waits in griddep_wait)
    cooperative: bool = False  # all blocks resident at once (cuLaunchKernelEx, cooperative)


class Plan(list):
    """Recorded launches. ``replay()`` issues them again on the current stream without
    any of the wrappers' Python checks: the arrays they point to must stay alive and keep
    their shapes (preallocated buffers).

    ``replay(pdl=True)`` launches the kernels declared ``pdl`` through the driver's
    ``cuLaunchKernelEx`` with programmatic stream serialization (sm_90 and later): such a
    kernel starts while the one before it finishes, and requests its weights meanwhile.
    Meant for stream capture, where the edges become programmatic edges of the CUDA graph;
    a launch this way costs more host time than a plain one."""

    def replay(self, pdl: bool = False) -> None:
        for launch in self:
            if launch.cooperative:
                _launch_ex(launch, pdl=False, cooperative=True)
            elif pdl and launch.pdl:
                _launch_ex(launch, pdl=True)
            else:
                launch.kernel(launch.grid, launch.block, launch.args, shared_mem=launch.shared_mem)


def capture(stream, *plans: Plan, pdl: bool = False):
    """The launches of ``plans``, in order, as a CUDA graph captured on ``stream`` (not the
    legacy stream), with programmatic dependent launch where ``pdl`` (Plan.replay)."""
    stream.begin_capture()
    try:
        with stream:
            for plan in plans:
                plan.replay(pdl=pdl)
    finally:
        graph = stream.end_capture()
    return graph


class _Recorder:
    def __init__(self, kern, plan: Plan, pdl: bool, cooperative: bool = False):
        self.raw, self._plan, self._pdl, self._cooperative = kern, plan, pdl, cooperative

    def __call__(self, grid, block, args, shared_mem=0):
        self._plan.append(Launch(self.raw, tuple(grid), tuple(block), tuple(args), shared_mem, self._pdl,
                                 self._cooperative))


class _Cooperative:
    """A kernel declared cooperative, called like a RawKernel."""

    def __init__(self, kern):
        self.raw = kern

    def __call__(self, grid, block, args, shared_mem=0):
        _launch_ex(Launch(self.raw, tuple(grid), tuple(block), tuple(args), shared_mem, False, True), pdl=False,
                   cooperative=True)


def cooperative_supported() -> bool:
    """Whether this process can make cooperative launches: a device that supports them, and
    NVIDIA's ``cuda.bindings`` (cuda-python) for ``cuLaunchKernelEx``."""
    import cupy

    if not cupy.cuda.Device().attributes.get("CooperativeLaunch", 0):
        return False
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def pdl_supported() -> bool:
    """Whether this process can launch with programmatic dependent launch: a device of
    compute capability 9.0 or later, and NVIDIA's ``cuda.bindings`` (cuda-python)."""
    import cupy

    if int(cupy.cuda.Device().compute_capability) < 90:
        return False
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return False
    return True


def _c_arg(a):
    """A kernel argument as the ctypes value CuPy would pass (arrays as pointers, Python
    ints as 64-bit: the wrappers use them only for null pointers)."""
    import ctypes

    import cupy

    if isinstance(a, cupy.ndarray):
        return ctypes.c_void_p(a.data.ptr)
    if isinstance(a, numpy.generic):
        kinds = {numpy.dtype(numpy.int32): ctypes.c_int32, numpy.dtype(numpy.uint32): ctypes.c_uint32,
                 numpy.dtype(numpy.int64): ctypes.c_int64, numpy.dtype(numpy.uint64): ctypes.c_uint64,
                 numpy.dtype(numpy.float32): ctypes.c_float, numpy.dtype(numpy.float64): ctypes.c_double}
        if a.dtype in kinds:
            return kinds[a.dtype](a.item())
    elif isinstance(a, bool):
        return ctypes.c_bool(a)
    elif isinstance(a, int):
        return ctypes.c_int64(a)
    elif isinstance(a, float):
        return ctypes.c_double(a)
    raise TypeError(f"no programmatic-launch packing for a kernel argument of type {type(a).__name__}")


def _launch_ex(launch: Launch, pdl: bool, cooperative: bool = False) -> None:
    """``launch`` through the driver's cuLaunchKernelEx on the current stream, with
    programmatic stream serialization (``pdl``) and / or as a cooperative launch."""
    import ctypes

    import cupy
    from cuda.bindings import driver

    values = [_c_arg(a) for a in launch.args]
    params = (ctypes.c_void_p * max(1, len(values)))(*[ctypes.addressof(v) for v in values])
    grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
    block = tuple(launch.block) + (1,) * (3 - len(launch.block))
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = launch.shared_mem
    config.hStream = driver.CUstream(cupy.cuda.get_current_stream().ptr)
    attrs = []
    if pdl:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    if cooperative:
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        attr.value.cooperative = 1
        attrs.append(attr)
    config.attrs = attrs
    config.numAttrs = len(attrs)
    (err,) = driver.cuLaunchKernelEx(config, driver.CUfunction(launch.kernel.kernel.ptr), ctypes.addressof(params), 0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLaunchKernelEx of {launch.kernel.name}: {err}")


_plan: Plan | None = None


@contextlib.contextmanager
def recording():
    """Within the block, wrapper calls record their launches into the yielded Plan instead
    of launching (inputs are still checked, once)."""
    global _plan
    if _plan is not None:
        raise RuntimeError("already recording a launch plan")
    _plan = Plan()
    try:
        yield _plan
    finally:
        _plan = None


def compile_for_arch(source: str, arch: str) -> dict[str, dict]:
    """Compile every declared specialization of ``source`` for ``arch`` without a GPU.

    Returns, per name expression, its lowered (mangled) name and ptxas's resource report:
    ``registers``, ``stack`` (stack frame bytes) and ``spills`` (spill store bytes, with those of
    the functions it calls).
    Raises RuntimeError with the NVRTC log on failure.
    """
    from cupy.cuda import nvrtc

    names = _declared.get(source, ())
    prog = nvrtc.createProgram(source_text(source), source, [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(prog, name)
        try:
            nvrtc.compileProgram(prog, [*options(), f"-arch={arch}", "--ptxas-options=-v"])
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"{source} for {arch}:\n{nvrtc.getProgramLog(prog)}") from err
        if not nvrtc.getCUBIN(prog):
            raise RuntimeError(f"{source} for {arch}: NVRTC produced no cubin")
        by_lowered = {nvrtc.getLoweredName(prog, name): name for name in names}
        return ptxas_report(nvrtc.getProgramLog(prog), by_lowered)
    finally:
        nvrtc.destroyProgram(prog)


def ptxas_report(log: str, by_lowered: dict[str, str]) -> dict[str, dict]:
    """Per name expression (``by_lowered``: lowered name -> name), from ptxas's ``-v`` log:
    ``lowered``, ``registers``, ``stack`` (the entry's stack frame bytes) and ``spills`` (spill
    store bytes of the entry and of the functions it calls, which the log lists under it)."""
    report = {name: {"lowered": lowered} for lowered, name in by_lowered.items()}
    current = entry = own = None  # (own: the lines read now are the entry's, not a function it calls)
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)'", line):
            current, entry = report.get(by_lowered.get(m.group(1))), m.group(1)
            if current is not None:
                current["stack"] = current["spills"] = 0
        elif m := re.search(r"Function properties for (\S+)", line):
            own = m.group(1) == entry
        elif current is not None and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line)):
            if own:
                current["stack"] = int(m.group(1))
            current["spills"] += int(m.group(2))
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["registers"] = int(m.group(1))
    return report


# ---------------------------------------------------------------------------------------
# helpers for wrappers: typed scalars, launch geometry
# ---------------------------------------------------------------------------------------
def i32(x) -> numpy.int32:
    return numpy.int32(x)


def i64(x) -> numpy.int64:
    return numpy.int64(x)


def f32(x) -> numpy.float32:
    return numpy.float32(x)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _smem_optin(device_id: int) -> int:
    import cupy

    return cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerBlockOptin"]


def smem_optin() -> int:
    """Bytes of dynamic shared memory one block may have on the current device (opt-in)."""
    import cupy

    return _smem_optin(cupy.cuda.Device().id)


@functools.cache
def smem_per_sm(device_id: int) -> int:
    """Bytes of shared memory an SM of the device holds, for all of its blocks."""
    import cupy

    return cupy.cuda.Device(device_id).attributes["MaxSharedMemoryPerMultiprocessor"]


@functools.cache
def peak_memory_GBps(device_id: int) -> float | None:
    """The device's peak DRAM bandwidth in GB/s (two transfers a memory clock across the
    memory bus: 2 x 2,619 MHz x 5,120 bits = 3,352 for an H100 SXM, 2 x 3,201 MHz x 6,016 bits
    = 4,814 for the H200 of benchmarks/results/pace_share_peak-h200.txt), or None where the
    driver does not give the clock or the bus width."""
    import cupy

    attributes = cupy.cuda.Device(device_id).attributes
    clock_khz, bus_bits = attributes.get("MemoryClockRate", 0), attributes.get("GlobalMemoryBusWidth", 0)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9


@functools.cache
def sm_count(device_id: int) -> int:
    import cupy

    return cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]


def row_smem(cols: int, name: str) -> int:
    """Shared memory for a row of ``cols`` float32 values, or ValueError past the device's limit."""
    import cupy

    nbytes = 4 * (cols + 3)  # + the 16-byte alignment shift of SharedRow (row.cuh)
    limit = _smem_optin(cupy.cuda.Device().id)
    if nbytes > limit:
        raise ValueError(f"{name} rows of {cols} elements exceed this GPU's {limit // 4} (shared memory)")
    return nbytes


_smem_allowed: dict[tuple[int, int], tuple] = {}  # (device, id) -> (kernel, dynamic shared memory allowed so far)


def set_smem(kern, nbytes: int) -> None:
    """Allow ``kern`` to use ``nbytes`` of dynamic shared memory (above 48 KiB with its static
    shared memory needs opt-in). The driver is asked once per kernel and size reached."""
    import cupy

    kern = getattr(kern, "raw", kern)
    key = (cupy.cuda.runtime.getDevice(), id(kern))
    known = _smem_allowed.get(key)
    if known is not None and known[0] is kern and known[1] >= nbytes:
        return
    if nbytes + kern.shared_size_bytes > 48 * 1024 and kern.max_dynamic_shared_size_bytes < nbytes:
        kern.max_dynamic_shared_size_bytes = nbytes
    _smem_allowed[key] = (kern, nbytes)  # (the reference keeps the id from being reused)


def vec_widths(c_type: str) -> tuple[int, int]:
    """The two vector widths a kernel is specialized for: scalar, and 16 bytes of ``c_type``."""
    return (1, 4 if c_type == "float" else 8)


def row_threads(cols: int, vec: int, per_thread: int = 1, most: int = 1024) -> int:
    """Threads for a one-block-per-row kernel: ``per_thread`` VEC-wide chunks each, 32 to ``most``."""
    return min(most, max(32, 32 * cdiv(cdiv(cols, vec * per_thread), 32)))