"""Run-time compilation: every declared specialization compiles through NVRTC for each
supported architecture (no GPU needed), with the same text and options as at run time."""

from __future__ import annotations

import pytest

import cupy_kernels  # noqa: F401  (declares every specialization)
from cupy_kernels import _build

SOURCES = sorted(_build.declared())
# float16 and bfloat16 only
TENSOR_CORE_SOURCES = {"flash_attention.cu", "gemm.cu", "decode_step.cu", "fixed_attention.cu"}
FLOAT32_SOURCES = {"flash_attention_tf32.cu"}  # float32 only: templated on head dim, not on the dtype
BYTE_SOURCES = {"read_floor.cu"}  # reads bytes, whatever their dtype: templated on the loads in flight


def test_every_kernel_file_declares_specializations():
    on_disk = sorted(p.name for p in _build.SRC_DIR.glob("*.cu"))
    assert SOURCES == on_disk
    for source, names in _build.declared().items():
        assert names, source
        # every dtype of the table (the 16-bit ones for tensor-core families) is instantiated
        # in every family that is templated on it
        if any("<" in n for n in names) and source not in FLOAT32_SOURCES | BYTE_SOURCES:
            first_args = {n.split("<", 1)[1].split(",")[0].strip(" >") for n in names if "<" in n}
            wanted = set(_build.CTYPES.values()) - ({"float"} if source in TENSOR_CORE_SOURCES else set())
            assert wanted <= first_args, (source, wanted - first_args)


# Kernels that use local memory, knowingly, and the most bytes (stack frame or spill stores)
# each may use. The fused decode step (off by default, gpt2_cupy/model.py's fused_step), at 168
# registers with the functions it calls: 236 bytes of spill stores and a 192-byte frame on
# sm_90, 256 and 176 before it. decode_attention's kernels of a quantized cache (int8 / fp8 rows,
# one head a block of 128 threads), and on sm_80 those of 4 trips ahead in 512 threads: 8-24
# bytes at 96 and 128 registers; in the one read as SASS (sm_90,
# decode_attention_kernel<__half, signed char, 64, 1, 128, 1>), a value stored before the
# kernel's wait and read after its loop, once a block. (ptxas_report counts the spills of the
# functions a kernel calls, and no longer takes a later function's line for the kernel's own:
# these were not seen before.)
def local_memory_allowed(source: str, name: str, arch: str) -> int:
    if source == "decode_step.cu":
        return 256
    if source == "decode_attention.cu" and (", signed char," in name or ", __nv_fp8_e4m3," in name
                                            or (arch == "sm_80" and name.endswith(", 4, 512, 1>"))):
        return 24
    return 0


@pytest.mark.parametrize("arch", _build.ARCHS)
@pytest.mark.parametrize("source", SOURCES)
def test_compiles_for_arch_without_spills(source, arch):
    report = _build.compile_for_arch(source, arch)
    assert set(report) == set(_build.declared()[source])
    assert all(r["lowered"].startswith("_Z") or "kernel" in r["lowered"] for r in report.values())
    # ptxas's resource report: no local memory (spills, or register arrays indexed at run time)
    assert all("registers" in r and "spills" in r for r in report.values()), report
    local = {name: (r["stack"], r["spills"], r["registers"]) for name, r in report.items()
             if max(r["stack"], r["spills"]) > local_memory_allowed(source, name, arch)}
    assert not local, f"stack bytes, spill bytes, registers: {local}"


def test_ptxas_report_counts_the_spills_of_called_functions():
    """A kernel's spills include those of the functions listed under it in the log, and a later
    function's line does not replace the kernel's own stack frame."""
    log = """ptxas info    : Compiling entry function '_Z4mainPf' for 'sm_90'
ptxas info    : Function properties for _Z4mainPf
ptxas         .     64 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 64 bytes cumulative stack size, 880 bytes smem
ptxas info    : Function properties for _Z6calleev
ptxas         .     0 bytes stack frame, 12 bytes spill stores, 12 bytes spill loads
ptxas info    : Compiling entry function '_Z5cleanPf' for 'sm_90'
ptxas info    : Function properties for _Z5cleanPf
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 880 bytes smem
"""
    report = _build.ptxas_report(log, {"_Z4mainPf": "main", "_Z5cleanPf": "clean"})
    assert report["main"] == {"lowered": "_Z4mainPf", "stack": 64, "spills": 20, "registers": 128}
    assert report["clean"] == {"lowered": "_Z5cleanPf", "stack": 0, "spills": 0, "registers": 40}


def test_bfloat16_is_in_the_dtype_table():
    assert "__nv_bfloat16" in _build.CTYPES.values()


def test_undeclared_specialization_is_a_clear_error():
    with pytest.raises(KeyError, match="not a declared specialization"):
        _build.kernel("softmax.cu", "softmax_kernel<double, 1>")


def test_declare_unknown_source_raises():
    with pytest.raises(FileNotFoundError):
        _build.declare("no_such_family.cu", ["x"])


def test_header_hash_is_in_the_compiled_text(monkeypatch):
    text = _build.source_text("softmax.cu")
    assert text.splitlines()[0] == f"// src_cu headers {_build._headers_hash()}"
    assert "softmax_kernel" in text
    # a header edit changes the text NVRTC (and CuPy's cache) sees
    monkeypatch.setattr(_build, "_headers_hash", lambda: "0123456789abcdef")
    assert _build.source_text("softmax.cu") != text


def test_options_find_half_precision_headers():
    opts = _build.options()
    assert "-std=c++17" in opts
    assert any(o.startswith("-I") and o.endswith("src_cu") for o in opts)
    assert len(opts) >= 3, "no include directory with cuda_fp16.h found"


def test_ctype_rejects_other_dtypes():
    import numpy

    with pytest.raises(TypeError, match="unsupported dtype"):
        _build.ctype(numpy.float64)


def test_plan_records_instead_of_launching():
    launched = []

    class FakeKernel:
        def __call__(self, *a, **k):
            launched.append(a)

    with _build.recording() as plan:
        rec = _build._Recorder(FakeKernel(), _build._plan, False)
        rec((2,), (32,), (1, 2))
        with pytest.raises(RuntimeError, match="already recording"):
            with _build.recording():
                pass
    assert launched == [] and len(plan) == 1 and plan[0].grid == (2,) and not plan[0].pdl
    plan.replay()
    assert launched == [((2,), (32,), (1, 2))]
    plan.replay(pdl=True)  # a kernel not declared pdl keeps the plain launch
    assert len(launched) == 2


def test_decode_step_kernels_are_declared_for_programmatic_launch():
    """The kernels of the decode step wait (griddep_wait) before reading what the kernel
    before them wrote; the others are launched plainly."""
    declared = _build.declared()
    for source in ("linear.cu", "embedding.cu", "kv_cache.cu", "decode_attention.cu"):
        assert all((source, n) in _build._pdl for n in declared[source]), source
    assert ("sampling.cu", "argmax_partials_kernel") in _build._pdl
    assert ("sampling.cu", "argmax_kernel<float>") not in _build._pdl
    for source in ("linear.cu", "embedding.cu", "kv_cache.cu", "decode_attention.cu"):
        text = _build.source_text(source)
        assert text.count("griddep_wait();") >= 1, source


@pytest.mark.parametrize("sms,smem", [(132, 232448), (108, 166912), (84, 101376)])  # H100, A100, sm_86
def test_every_tensor_core_launch_shape_is_declared(sms, smem):
    """The wrapper's choice of n-tiles, loads per batch and LayerNorm placement names a
    declared specialization for every size it may meet (tensor cores: K % 8 == 0)."""
    import importlib

    lin = importlib.import_module("cupy_kernels.linear")
    declared = set(_build.declared()["linear.cu"])
    epis = [("__half", "store"), ("__half", "gelu"), ("__half", "residual"), ("__half", "qkv_cache"),
            ("float", "store"), ("float", "argmax")]
    for B in [*range(1, 21), 33, 64, 65, 100, 255, 256]:
        for N in (37, 768, 2304, 3072, 4800, 6400, 50257):
            for K in (8, 72, 768, 776, 1024, 1280, 1600, 3072, 4096, 6400):
                for tile in (None, *lin.MMA_TILES):
                    for ln, fold in ((False, False), (True, False), (False, True)):
                        for out, epi in epis:
                            if epi == "residual" and out == "float" or ((ln or fold) and epi == "residual"):
                                continue
                            logits = out == "float" and epi in ("store", "argmax")
                            nt, u, kw, xin, smem_bytes, _, mt = lin._mma_plan(B, N, K, ln, tile, None, sms, smem,
                                                                              fold, logits)
                            assert 1 <= kw <= lin.MMA_MAX_WARPS and smem_bytes <= smem
                            assert xin == lin.X_LN_FOLD if fold else xin in (lin.X_PLAIN, lin.X_LN)
                            assert xin != lin.X_LN or B <= 8 * nt
                            assert mt == 1 or logits
                            name = lin._mma_name("__half", out if out == "float" else "__half", nt, u, xin, epi, mt)
                            assert name in declared, (B, N, K, tile, ln, fold, name)


def test_decode_step_constants_mirror_decode_step_cu():
    """The wrapper's copies of decode_step.cu's constants (the ring's slots, the widest row, the
    timeline's stages) hold the kernel's values."""
    import importlib
    import re

    ds = importlib.import_module("cupy_kernels.decode_step")
    text = _build.source_text("decode_step.cu")
    pairs = {"MAX_STAGES": "MAX_STAGES", "MAX_C": "STEP_MAX_C", "HEAD_DIM": "HEAD_DIM", "STAGE_TRACE": "STAGE_TRACE"}
    for py, cu in pairs.items():
        found = re.findall(rf"constexpr int {cu} = (\d+);", text)
        assert found == [str(getattr(ds, py))], (py, cu, found)
    (stage,) = re.findall(r"constexpr int STAGE_BYTES = ([^;]+);", text)
    consts = {c: int(v) for c, v in re.findall(r"constexpr int (STAGE_CHUNKS|STAGE_PAD) = (\d+);", text)}
    assert eval(stage, {}, consts) == ds.STAGE_BYTES, (stage, consts)


def test_linear_constants_mirror_linear_cu():
    """The wrapper's copies of linear.cu's compile-time constants (block shapes, shared-memory
    strides, the streamed LM head's chunks a warp) hold the kernel's values."""
    import importlib
    import re

    lin = importlib.import_module("cupy_kernels.linear")
    text = _build.source_text("linear.cu")
    pairs = {"MMA_MAX_WARPS": "MMA_MAX_WARPS", "MMA_NARROW_WARPS": "MMA_NARROW_WARPS",
             "MMA_RED_STRIDE": "RED_STRIDE", "STREAM_CHUNKS": "STREAM_CHUNKS",
             "STREAM_RED_STRIDE": "STREAM_RED_STRIDE"}
    for py, cu in pairs.items():
        found = re.findall(rf"constexpr int {cu} = (\d+);", text)
        assert found == [str(getattr(lin, py))], (py, cu, found)
