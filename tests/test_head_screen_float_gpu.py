"""The screened LM head of float32 rows (linear_argmax's screen= with ln=): the tokens of the
exact product, whatever the weights and the row, with the blocks it skips provably below the
row's largest value."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled")]

cp = pytest.importorskip("cupy")
import cupy_kernels as K  # noqa: E402
from cupy_kernels import _build  # noqa: E402
from gpu_util import rand  # noqa: E402

L = importlib.import_module("cupy_kernels.linear")  # (the package's `linear` is the function)
EPS = 1e-5
BLOCK = 32  # rows of W a block of the exact product (the LM head's tile (4, 2) in 8 warps)


def _row(rng, C, mean=0.0, scale=1.0):
    x, _ = rand(rng, (1, C), np.float32, scale)
    return x + np.float32(mean)


def _ln(rng, C):
    lw = (1 + 0.1 * cp.asarray(rng.standard_normal(C))).astype(np.float32)
    lb, _ = rand(rng, (C,), np.float32, 0.1)
    return lw, lb


def _same_token(x, w, ln, bias=None):
    """The screened token against the exact one; returns (hi, bound, on) of the screen."""
    screen = K.quantize_rows(w)
    exact = K.linear_argmax(x, w, bias, ln=ln)
    got = cp.full(1, -7, dtype=np.int32)
    K.linear_argmax(x, w, bias, ln=ln, screen=screen, out=got)
    assert got.get().tolist() == exact.get().tolist()
    hi, bounds = L._screen_pass_float(x, screen, bias, ln, w.shape[0], w.shape[1])
    bound = _bounds(bounds.get())[0]
    return hi.get(), bound, ~(hi.get() < bound)


def _bounds(keys) -> np.ndarray:
    """linear.cu's order keys (uint32, key_bound) as float32."""
    k = (keys.astype(np.uint64) + 0x007FFFFF).astype(np.uint32)
    return np.where(k & 0x80000000, k & 0x7FFFFFFF, ~k).astype(np.uint32).view(np.float32)


def test_quantize_rows_float32():
    rng = np.random.default_rng(0)
    w, wh = rand(rng, (37, 72), np.float32, 0.3)
    w[3] = 0
    w[5, 7] = np.inf
    w[6, 1] = np.nan
    wh[3] = 0
    q, scale = K.quantize_rows(w)
    assert q.dtype == np.uint8 and q.shape == (37, 72) and q.flags.c_contiguous
    assert scale.dtype == np.float32 and scale.shape == (37,)
    qh, sh = q.get().astype(np.float64) - 128, scale.get().astype(np.float64)
    finite = [i for i in range(37) if i not in (5, 6)]
    assert np.isnan(sh[[5, 6]]).all() and sh[3] == 1 and (qh[3] == 0).all() and (qh[[5, 6]] == 0).all()
    err = np.abs(wh[finite] - sh[finite, None] * qh[finite])
    assert (err <= sh[finite, None] * (0.5 + 2.0 ** -16)).all()
    assert (np.abs(qh) <= 127).all() and (np.abs(qh[finite]).max(axis=1) == 127).sum() == len(finite) - 1


@pytest.mark.parametrize("C,N", [(768, 50257), (1600, 50257), (1024, 16411), (8, 16384), (2048, 20000),
                                 (776, 17000), (40, 16400), (1280, 16390)])
def test_float_screen_gives_the_exact_token(C, N):
    """The exact product's token; every block it skips is below the row's largest logit (the
    exact product's float32 logits), the bound is a lower bound of it, and it does skip."""
    rng = np.random.default_rng(C + N)
    x = _row(rng, C, scale=3.0)
    w, _ = rand(rng, (N, C), np.float32, 1.0 / np.sqrt(C))
    ln = (*_ln(rng, C), EPS)
    bias = rand(rng, (N,), np.float32, 0.5)[0] if C == 1024 else None
    hi, bound, on = _same_token(x, w, ln, bias)
    blocks = -(-N // BLOCK)
    assert hi.shape == (blocks,) and 1 <= on.sum()
    logits = K.linear(x, w, bias, ln=ln, out_dtype=np.float32).get()[0]
    best = logits.max()
    padded = np.full(blocks * BLOCK, -np.inf)
    padded[:N] = logits
    block_max = padded.reshape(blocks, BLOCK).max(axis=1)
    assert (block_max[~on] < best).all()
    assert on[np.argmax(logits) // BLOCK]
    assert best >= bound and (block_max <= hi).all()  # bounds, both ways
    if C >= 768:
        assert on.mean() < 0.1, f"{on.sum()} of {blocks} blocks computed exactly"


def test_float_screen_hard_rows():
    """Rows whose LayerNorm is ill-conditioned (a large mean over a small spread, all equal),
    near ties and exact copies of a row of W across blocks, values that are not finite: the
    exact product's token."""
    rng = np.random.default_rng(5)
    C, N = 768, 20000
    base = rng.standard_normal((5, C)) / np.sqrt(C)
    rows = base[np.arange(N) % 5] * (1 + 1e-6 * rng.integers(0, 3, (N, 1)))
    rows[::7] = base[0]  # exact copies of one row in many blocks
    w = cp.asarray(rows.astype(np.float32))
    ln = (*_ln(rng, C), EPS)
    for x in (_row(rng, C), _row(rng, C, mean=1000.0, scale=1e-2), _row(rng, C, mean=3e4, scale=1e-3),
              cp.full((1, C), 2.5, np.float32)):
        _same_token(x, w, ln)
    w2, _ = rand(rng, (N, C), np.float32, 1.0 / np.sqrt(C))
    x = _row(rng, C)
    _same_token(x, w2, ln)
    w2[1234, 5] = np.inf
    w2[77, 9] = np.nan
    _same_token(x, w2, ln)
    x2 = x.copy()
    x2[0, 3] = np.nan
    _same_token(x2, w2, ln)
    x3 = x.copy()
    x3[0, 10] = 1e30
    _same_token(x3, w2, ln)


def test_float_screen_at_float32s_ends():
    """A NaN in the first row of a late block (the argmax keeps a NaN partial only where it meets
    it first, so the screen computes every block), a row whose largest value is below 2^-100
    (no bound: its scale is NaN), rows whose sums come near float32's largest and past it: the
    exact product's token."""
    rng = np.random.default_rng(12)
    C, N = 768, 50257
    ln = (*_ln(rng, C), EPS)
    x = _row(rng, C)
    w, _ = rand(rng, (N, C), np.float32, 1.0 / np.sqrt(C))
    nan = w.copy()
    nan[BLOCK * 1400, 5] = np.nan
    _same_token(x, nan, ln)
    tiny = w.copy()
    tiny[333] *= np.float32(2.0 ** -110)
    _, scale = K.quantize_rows(tiny)
    assert np.isnan(scale[333].get()) and not np.isnan(scale[:333].get()).any()
    _same_token(x, tiny, ln)
    y = K.linear(x, cp.eye(C, dtype=np.float32), ln=ln).get()[0]  # the row as normalized
    big = w.copy()
    big[64] = cp.asarray((3e38 * np.sign(y) / np.abs(y).sum()).astype(np.float32))  # near the largest float
    big[2000] = big[64] * np.float32(1.25)  # past it: the exact sum is infinite
    big[3000] = big[64] * np.float32(0.999)
    _same_token(x, big, ln)
    big[2000] = w[2000]
    _same_token(x, big, ln)


def test_float_screen_advances_and_replays():
    """With advance=: the exact token and the position moved on once; a recorded launch
    replayed with the row changed each time gets each time's exact token (the bound of the
    launch before, which would skip every block, is set back by the argmax kernel)."""
    rng = np.random.default_rng(8)
    C, N = 768, 50257
    w, _ = rand(rng, (N, C), np.float32, 1.0 / np.sqrt(C))
    ln = (*_ln(rng, C), EPS)
    screen = K.quantize_rows(w)
    x = _row(rng, C)
    positions, got = cp.asarray([5], dtype=np.int32), cp.full(1, -7, dtype=np.int32)
    K.linear_argmax(x, w, ln=ln, screen=screen, out=got, advance=positions)
    assert got.get().tolist() == K.linear_argmax(x, w, ln=ln).get().tolist()
    assert positions.get().tolist() == [6]
    with _build.recording() as plan:  # (recorded, not run)
        K.linear_argmax(x, w, ln=ln, screen=screen, out=got, advance=positions)
    for r in range(4):
        x[...] = _row(rng, C, scale=1.0 + r)
        got.fill(-7)
        plan.replay()
        assert got.get().tolist() == K.linear_argmax(x, w, ln=ln).get().tolist()
        assert positions.get().tolist() == [7 + r]


def test_float_screen_checks():
    rng = np.random.default_rng(2)
    C, N = 64, 16384
    x = _row(rng, C)
    w, _ = rand(rng, (N, C), np.float32, 0.1)
    ln = (*_ln(rng, C), EPS)
    q, scale = K.quantize_rows(w)
    for bad in [(q[:, :32], scale), (q, scale[:20]), (q.astype(np.int8), scale), (q, scale.astype(np.float16)),
                (q[::2], scale), (q,), (q, scale, 1.0)]:
        with pytest.raises((ValueError, TypeError)):
            K.linear_argmax(x, w, ln=ln, screen=bad)
    with pytest.raises(ValueError, match="ln"):
        K.linear_argmax(x, w, screen=(q, scale))
    with pytest.raises(ValueError, match="logits"):
        K.linear_argmax(x, w, ln=ln, screen=(q, scale), logits=cp.empty((1, N), np.float32))
    with pytest.raises(ValueError, match="one row"):
        K.linear_argmax(cp.concatenate([x, x]), w, ln=ln, screen=(q, scale))
    small, _ = rand(rng, (1000, C), np.float32, 0.1)
    with pytest.raises(ValueError, match="LM head's tile"):
        K.linear_argmax(x, small, ln=ln, screen=K.quantize_rows(small))
    odd, _ = rand(rng, (N, 36), np.float32, 0.1)
    with pytest.raises(ValueError, match="multiple of 8"):
        K.linear_argmax(_row(rng, 36), odd, ln=(*_ln(rng, 36), EPS), screen=K.quantize_rows(odd))
    assert K.screens_float(50257, 768) and K.screens_float(50257, 1600)
    assert not K.screens_float(1000, 768) and not K.screens_float(50257, 36) and not K.screens_float(50257, 4096)
    # still usable after the errors
    assert cp.array_equal(K.linear_argmax(x, w, ln=ln, screen=(q, scale)), K.linear_argmax(x, w, ln=ln))
