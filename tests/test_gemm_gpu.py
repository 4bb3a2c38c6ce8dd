"""gemm (the prefill's products on tensor cores) against float64 numpy, on GPT-2's shapes and
awkward ones, in float16 and bfloat16; a row's bits do not depend on the rows computed with it
or on the tile shape. Outputs are poisoned (NaN) before each launch."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled")]

cp = pytest.importorskip("cupy")
import cupy_kernels as K  # noqa: E402
from cupy_kernels import _build  # noqa: E402
from cupy_kernels import reference as ref  # noqa: E402
from cupy_kernels.gemm import TILES  # noqa: E402
from gpu_util import check, poisoned, rand  # noqa: E402

HALVES = [np.float16, _build.BFLOAT16]
CASES = [  # M, N, K, epilogue
    (1, 768, 768, "none"),
    (7, 2304, 768, "bias"),
    (500, 6400, 1600, "gelu"),  # GPT-2 XL's MLP up for one 500-token prompt
    (1823, 781, 776, "bias"),  # N odd: column pairs stored one by one
    (129, 1600, 6400, "none"),
    (64, 50257, 768, "none"),  # the LM head
    (3, 5, 8, "gelu"),
    (257, 130, 72, "bias"),  # K not a multiple of the 64-column k tile
]


def _case(rng, M, N, K_, epi, dtype):
    x, xh = rand(rng, (M, K_), dtype)
    w, wh = rand(rng, (N, K_), dtype, 1.0 / np.sqrt(K_))
    b, bh = rand(rng, (N,), dtype)
    kw = {} if epi == "none" else {"bias": b}
    expect = ref.linear(xh, wh, None if epi == "none" else bh)
    if epi == "gelu":
        kw["gelu"] = True
        expect = ref.gelu_tanh(expect)
    return x, w, kw, expect


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("M,N,K_,epi", CASES)
def test_gemm(M, N, K_, epi, dtype):
    rng = np.random.default_rng(M + N + K_)
    x, w, kw, expect = _case(rng, M, N, K_, epi, dtype)
    out = poisoned((M, N), dtype)
    K.gemm(x, w, out=out, **kw)
    check(out, expect, dtype)
    # the last rows alone, and the first: the same bits as among all M rows
    for rows in (slice(M - 1, M), slice(0, min(M, 37)), slice(M // 3, M)):
        part = K.gemm(x[rows], w, **kw)
        assert cp.array_equal(part, out[rows])


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_gemm_every_tile_gives_the_same_bits(dtype):
    rng = np.random.default_rng(3)
    x, w, kw, expect = _case(rng, 333, 1000, 1600, "gelu", dtype)
    outs = []
    for name in [n for n, t in TILES.items() if t.smem_bytes <= _build.smem_optin()]:
        out = poisoned((333, 1000), dtype)
        K.gemm(x, w, out=out, tiles=name, **kw)
        check(out, expect, dtype)
        outs.append(out)
    assert all(cp.array_equal(o, outs[0]) for o in outs[1:])


def test_gemm_bad_inputs_raise():
    rng = np.random.default_rng(0)
    x, _ = rand(rng, (4, 64), np.float16)
    w, _ = rand(rng, (32, 64), np.float16)
    with pytest.raises(TypeError, match="float16 and bfloat16"):
        K.gemm(x.astype(np.float32), w.astype(np.float32))
    with pytest.raises(TypeError, match="weight has dtype"):
        K.gemm(x, w.astype(_build.BFLOAT16))
    with pytest.raises(ValueError, match="does not take rows of 64"):
        K.gemm(x, w[:, :56].copy())
    with pytest.raises(ValueError, match="multiple of 8"):
        K.gemm(x[:, :60].copy(), w[:, :60].copy())
    with pytest.raises(ValueError, match="16-byte boundary"):
        K.gemm(cp.empty(4 * 64 + 1, np.float16)[1:].reshape(4, 64), w)
    with pytest.raises(ValueError, match="bias must have shape"):
        K.gemm(x, w, cp.zeros(31, np.float16))
    with pytest.raises(ValueError, match="C-contiguous"):
        K.gemm(x, cp.empty((64, 32), np.float16).T)
    buf = cp.zeros(4 * 64, np.float16)
    with pytest.raises(ValueError, match="overlap"):
        K.gemm(buf.reshape(4, 64), w, out=buf[128:].reshape(4, 32))
    with pytest.raises(ValueError, match="unknown tiles"):
        K.gemm(x, w, tiles="1x1")
    assert K.gemm(x[:0], w).shape == (0, 32)  # no rows: nothing to launch
