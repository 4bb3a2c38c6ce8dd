"""Products for many rows of x on tensor cores (the prefill): ``y = x W^T (+ bias, GELU)``,
float16 / bfloat16, whose numbers for a row do not depend on the other rows.

Kernel: ``src_cu/gemm.cu``. Tests: ``tests/test_gemm_gpu.py``. Benchmark: ``benchmarks/gemm.py``.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import cupy
import numpy

from . import _build, _checks
from ._build import i32

_SRC = "gemm.cu"


class GemmTiles(NamedTuple):
    """A block's tile of y and its warps (gemm.cu: GemmTiles). BK is 64."""

    bm: int
    bn: int
    wm: int  # warps along M ...
    wn: int  # ... and along N; each warp owns a (bm / wm) x (bn / wn) tile
    stages: int  # shared tiles in the cp.async ring

    def c_type(self) -> str:
        return f"GemmTiles<{self.bm}, {self.bn}, {self.wm}, {self.wn}, {self.stages}>"

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wn

    @property
    def smem_bytes(self) -> int:
        return self.stages * (self.bm + self.bn) * 64 * 2


# Every tile shape gives the same bits (gemm.cu); which one a product gets is speed alone.
# Measured on an H100 (benchmarks/results/gemm-h100.json, float16, TFLOP/s at M = 8000 / 16384,
# GPT-2 XL's shapes; cuBLAS's wgmma kernels 620-750 in the same run, mma.sync's peak ~630):
#   128 x 128, 4 warps of 64 x 64     270-348   chosen: the most work per ldmatrix
#   128 x 128, 8 warps of 64 x 32     260-334
#   128 x 256, 8 warps of 64 x 64     233-328   (one block an SM: 144 KiB; over sm_86's 99)
#   64 x 64, 4 warps of 32 x 32       262-293   but 1.3-2.1x the others at M = 500 where the
#                                               128 x 128 grid fills under 3/4 of the SMs' two
#                                               block slots (XL's q|k|v: 216 against 168)
# A few rows of x (a short prompt) read W about once, so what counts there is how many blocks
# stream it: tiles 16 columns of W wide wherever their grid fits the SMs at once (gemm_tiles).
TILES = {
    "128x128w4": GemmTiles(128, 128, 2, 2, 3),  # 96 KiB: two blocks an SM
    "128x128w8": GemmTiles(128, 128, 2, 4, 3),
    "128x256w8": GemmTiles(128, 256, 2, 4, 3),
    "64x64w4": GemmTiles(64, 64, 2, 2, 4),  # 64 KiB
    "64x16w4": GemmTiles(64, 16, 4, 1, 8),  # 80 KiB
    "16x16w1": GemmTiles(16, 16, 1, 1, 16),  # 64 KiB
}
_BIG, _SMALL = "128x128w4", "64x64w4"


def _name(c_type: str, tiles: GemmTiles, bias: bool, gelu: bool) -> str:
    return f"gemm_kernel<{c_type}, {tiles.c_type()}, {str(bias).lower()}, {str(gelu).lower()}>"


DTYPES = tuple(d for d in _build.CTYPES if d != numpy.float32)
_build.declare(
    _SRC,
    [_name(_build.ctype(d), t, b, g) for d, t, (b, g) in itertools.product(
        DTYPES, TILES.values(), ((False, False), (True, False), (True, True), (False, True)))],
)


def gemm_tiles(M: int, N: int, sms: int, smem_sm: int = 228 * 1024) -> str:
    """The tile shape for an M x N product on ``sms`` SMs of ``smem_sm`` bytes of shared memory:
    64 x 16 tiles where their grid fits the SMs at once, else (up to 16 rows) 16 x 16 ones where
    theirs does; past that, 128 x 128 tiles, or 64 x 64 ones where the 128 x 128 grid would fill
    under 3/4 of two blocks an SM.
    Measured on an H100 (benchmarks/results/gemm_short-h100.json and gemm_mid-h100.json, cold L2,
    float16 TFLOP/s, 64 x 16 / 16 x 16 / 64 x 64): GPT-2 XL at M = 8, q|k|v (N = 4800: 300 blocks
    of 64 x 16, over the 264 that fit) 6.6 / 10.6 / 9.8, MLP up (400 blocks, over 396 of 16 x 16
    too) 8.6 / 9.4 / 12.2, attention out 4.5 / 3.6 / 3.4, MLP down 6.8 / 6.3 / 4.6; GPT-2 small at
    M = 8 q|k|v 3.7 / 3.3 / 3.5, MLP down 2.8 / 2.4 / 2.0; at M = 64 XL's q|k|v 59.2 / 31.3 / 75.7
    and MLP down 55.7 / 27.9 / 36.9, GPT-2 small's MLP down 22.6 / 18.8 / 15.6; at M = 128 XL's MLP
    down (200 blocks) 87.7 / 37.7 / 72.6, at 256 (400 blocks) 94.0 / 46.1 / 145.2; GPT-2 small's
    attention out at 256 (192 blocks) 39.2 / 21.9 / 37.0, its MLP up at 128 (384 blocks) 50.1 /
    25.0 / 70.3. In the two files' 96 cases (8, 64, 128 and 256 rows, 4 shapes and 2 epilogues, 2
    sizes, 2 dtypes) it takes a 16-column tile exactly where one is the fastest."""

    def one_wave(name: str) -> bool:  # (shared memory bounds these tiles' blocks an SM, 1 KiB a block kept)
        t = TILES[name]
        return _build.cdiv(M, t.bm) * _build.cdiv(N, t.bn) <= smem_sm // (t.smem_bytes + 1024) * sms

    if one_wave("64x16w4"):
        return "64x16w4"
    if M <= 16 and one_wave("16x16w1"):
        return "16x16w1"
    return _BIG if 2 * _build.cdiv(M, 128) * _build.cdiv(N, 128) >= 3 * sms else _SMALL


def gemm(x, weight, bias=None, *, gelu: bool = False, out=None, tiles: str | None = None):
    """``y = x @ weight.T (+ bias)``, then GELU (tanh form) when ``gelu``.

    x: [M, K]; weight: [N, K] (out, in); bias: [N] or None; all float16 or all bfloat16,
    C-contiguous, K a multiple of 8 and every pointer 16-byte aligned. float32 accumulation;
    bias and GELU in float32, one rounding to the storage dtype. Each output's bits depend
    on K alone (sequential k, no split-K): a row gets the same numbers whatever rows it is
    computed with, and whatever ``tiles`` (a key of :data:`TILES`; chosen by shape when None).
    Returns y [M, N] in x's dtype (``out`` if given).
    """
    x = _checks.float_array(x, "x", ndim=2)
    weight = _checks.float_array(weight, "weight", ndim=2)
    _checks.same_dtype(x, "x", weight=weight)
    if x.dtype not in DTYPES:
        raise TypeError(f"gemm runs float16 and bfloat16 on tensor cores, got {x.dtype}")
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"weight {weight.shape} does not take rows of {K} (x is {x.shape})")
    if K == 0 or K % 8:
        raise ValueError(f"K = {K}: gemm needs a positive multiple of 8 (16-byte rows)")
    for name, a in (("x", x), ("weight", weight)):
        if a.data.ptr % 16:
            raise ValueError(f"{name} must start on a 16-byte boundary")
    if bias is not None:
        bias = _checks.float_array(bias, "bias", ndim=1)
        _checks.same_dtype(x, "x", bias=bias)
        _checks.check_shape(bias, "bias", (N,))
    out = _checks.output(out, "out", (M, N), x.dtype)
    if N % 2 == 0 and out.data.ptr % 4:
        raise ValueError("out must start on a 4-byte boundary (pairs of columns are stored at once)")
    if any(_checks.overlaps(out, a) for a in (x, weight)):
        raise ValueError("out must not overlap x or weight")
    if tiles is None:
        dev = cupy.cuda.Device().id
        tiles = gemm_tiles(M, N, _build.sm_count(dev), _build.smem_per_sm(dev))
    if tiles not in TILES:
        raise ValueError(f"unknown tiles {tiles!r}; choose one of {', '.join(TILES)}")
    if TILES[tiles].smem_bytes > _build.smem_optin():
        raise ValueError(f"tiles {tiles!r} need {TILES[tiles].smem_bytes} bytes of shared memory; this GPU "
                         f"gives a block {_build.smem_optin()}")
    if M * N == 0:
        return out
    if _build.cdiv(M, TILES[tiles].bm) > 65535:
        raise ValueError(f"M = {M} rows need more than 65535 blocks of {TILES[tiles].bm}")
    t = TILES[tiles]
    kern = _build.kernel(_SRC, _name(_build.ctype(x.dtype), t, bias is not None, bool(gelu)))
    _build.set_smem(kern, t.smem_bytes)
    kern((_build.cdiv(N, t.bn), _build.cdiv(M, t.bm)), (t.threads,),
         (out, x, weight, 0 if bias is None else bias, i32(M), i32(N), i32(K)), shared_mem=t.smem_bytes)
    return out

