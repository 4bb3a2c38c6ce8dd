"""The screened LM head (linear_argmax's screen=): the tokens of the exact product, whatever
the weights, with the tiles it skips provably below each row's largest value."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled")]

cp = pytest.importorskip("cupy")
import cupy_kernels as K  # noqa: E402
from cupy_kernels import _build  # noqa: E402
from gpu_util import DTYPES, poisoned, rand  # noqa: E402

L = importlib.import_module("cupy_kernels.linear")  # (the package's `linear` is the function)

HALVES = [d for d in DTYPES if np.dtype(d).itemsize == 2]


def _rows(rng, B, C, dtype, scale=1.0):
    """A residual stream x [B, C] and its row statistics, as the decode step leaves them."""
    x, _ = rand(rng, (B, C), dtype)
    w, _ = rand(rng, (C, C), dtype, scale / np.sqrt(C))
    res, _ = rand(rng, (B, C), dtype, scale)
    stats = cp.full((B, -(-C // 16), 2), np.nan, dtype=np.float32)
    K.linear(x, w, residual=res, out=res, stats_out=stats)
    return res, stats


def _head(rng, N, C, dtype, rows=None):
    """A folded LM head [N, C] (u, c) from random weights, or from the given float32 rows."""
    w = cp.asarray(rows).astype(dtype) if rows is not None else rand(rng, (N, C), dtype, 1.0 / np.sqrt(C))[0]
    lw = (1 + 0.1 * cp.asarray(rng.standard_normal(C))).astype(dtype)  # (a LayerNorm's weight)
    lb, _ = rand(rng, (C,), dtype, 0.1)
    wf, _, u, c = K.fold_layernorm(w, None, lw, lb)
    return wf, u, c


def _exact_logits(res, stats, wf, u, c):
    return K.linear(res, wf, ln_fold=(stats, u, c, 1e-5), out_dtype=np.float32)


def _same_tokens(res, stats, wf, u, c):
    fold = (stats, u, c, 1e-5)
    screen = K.quantize_rows(wf)
    exact = K.linear_argmax(res, wf, ln_fold=fold)
    got = cp.full(res.shape[0], -7, dtype=np.int32)
    K.linear_argmax(res, wf, ln_fold=fold, screen=screen, out=got)
    assert got.get().tolist() == exact.get().tolist()
    return screen, got


def _bounds(keys) -> np.ndarray:
    """linear.cu's order keys (uint32, key_bound) as float32."""
    k = (keys.astype(np.uint64) + 0x007FFFFF).astype(np.uint32)
    return np.where(k & 0x80000000, k & 0x7FFFFFFF, ~k).astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_quantize_rows(dtype):
    rng = np.random.default_rng(0)
    w, wh = rand(rng, (37, 72), dtype, 0.3)
    w[3] = 0
    w[5, 7] = np.inf
    w[6, 1] = np.nan
    q, scale = K.quantize_rows(w)
    assert q.dtype == np.uint8 and q.shape == (3, 3 * 512) and scale.dtype == np.float32 and scale.shape == (37,)
    # the layout the 8-bit pass reads: tile i, chunk c, lane 4 g + t: rows 16 i + g and + 8, columns 32 c + 8 t ..
    qt = q.get().reshape(3, 3, 8, 4, 2, 8)
    full = np.full((48, 96), 128, np.uint8)
    for i, c, g, t, h in np.ndindex(3, 3, 8, 4, 2):
        full[16 * i + 8 * h + g, 32 * c + 8 * t:32 * c + 8 * t + 8] = qt[i, c, g, t, h]
    assert (full[37:] == 128).all() and (full[:, 72:] == 128).all()  # zero past N and K
    assert np.array_equal(K.unpack_rows(q, 37, 72).get(), full[:37, :72])
    qh, sh = full[:37, :72].astype(np.float64) - 128, scale.get().astype(np.float64)
    wh[3] = 0
    finite = [i for i in range(37) if i not in (5, 6)]
    assert np.isnan(sh[[5, 6]]).all() and sh[3] == 1 and (qh[3] == 0).all()
    err = np.abs(wh[finite] - sh[finite, None] * qh[finite])
    assert (err <= sh[finite, None] * (0.5 + 1e-6)).all()
    assert (np.abs(qh) <= 127).all()


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("B,C,N", [(1, 768, 50257), (3, 1600, 5000), (8, 776, 1000), (2, 64, 77), (5, 72, 129)])
def test_screen_gives_the_exact_tokens(B, C, N, dtype):
    """The same tokens as the exact product; every tile it skips is below the row's largest
    logit in every row (float32 logits of the exact product), and it does skip."""
    rng = np.random.default_rng(B + C + N)
    res, stats = _rows(rng, B, C, dtype)
    wf, u, c = _head(rng, N, C, dtype)
    screen, _ = _same_tokens(res, stats, wf, u, c)
    tiles = -(-N // 16)
    hi, bounds = L._screen_pass(res, screen, (stats, u, c, 1e-5), B, N, C)
    bound = _bounds(bounds.get())  # each row's best lower bound
    on = (~(hi.get() < bound[:, None])).any(axis=0)  # the tiles the list kernel computes
    assert 1 <= on.sum() <= tiles
    logits = _exact_logits(res, stats, wf, u, c).get()
    best = logits.max(axis=1)
    padded = np.full((B, tiles * 16), -np.inf)
    padded[:, :N] = logits
    tile_max = padded.reshape(B, tiles, 16).max(axis=2)
    assert (tile_max[:, ~on] < best[:, None]).all()
    assert on[np.argmax(logits, axis=1) // 16].all()
    assert (best >= bound).all()  # lower bounds of the largest
    if B == 1 and N >= 5000:
        assert on.mean() < 0.1, f"{on.sum()} of {tiles} tiles computed exactly"


@pytest.mark.parametrize("dtype", HALVES, ids=str)
# (2, 64, 70001): 4,376 tiles, more partials a row than one round of the argmax kernel takes
@pytest.mark.parametrize("B,C,N", [(1, 768, 50257), (2, 1600, 5000), (8, 776, 1000), (3, 72, 129), (2, 64, 70001)])
def test_screen_advances_embeds_and_replays(B, C, N, dtype):
    """With advance= and embed=: the exact product's tokens, the positions moved on once, the
    next step's embedding with the bits of embedding(stats_out=); also where a computed tile's
    partial is NaN; and a recorded launch replayed with every logit 64 lower each time, which
    a row bound left from the launch before would skip whole (the argmax kernel sets them back)."""
    rng = np.random.default_rng(7 * B + C + N)
    P = 64
    res, stats = _rows(rng, B, C, dtype)
    wf, u, c = _head(rng, N, C, dtype)
    wte, _ = rand(rng, (N, C), dtype)
    wpe, _ = rand(rng, (P, C), dtype)
    start = rng.integers(0, P - 1, B).astype(np.int32)
    start[-1] = P - 1  # moved to P: wpe's last row
    sets = -(-C // 16)

    def run(w):
        fold, screen = (stats, u, c, 1e-5), K.quantize_rows(w)
        exact = K.linear_argmax(res, w, ln_fold=fold)
        expect_x, expect_stats = poisoned((B, C), dtype), cp.full((B, sets, 2), np.nan, dtype=np.float32)
        K.embedding(exact, wte, wpe, cp.asarray(np.minimum(start + 1, P - 1)), out=expect_x, stats_out=expect_stats)
        positions, got = cp.asarray(start), cp.full(B, -7, dtype=np.int32)
        x_out, x_stats = poisoned((B, C), dtype), cp.full((B, sets, 2), np.nan, dtype=np.float32)
        K.linear_argmax(res, w, ln_fold=fold, screen=screen, out=got, advance=positions,
                        embed=(wte, wpe, x_out, x_stats))
        assert got.get().tolist() == exact.get().tolist()
        assert positions.get().tolist() == (start + 1).tolist()
        assert cp.array_equal(x_out, expect_x) and cp.array_equal(x_stats, expect_stats)
        return screen

    screen = run(wf)
    nan = wf.copy()
    nan[16 * (N // 32), 3] = np.nan  # the first row of a tile: its partial is NaN in every row of x
    run(nan)
    shift = c.copy()  # the folded bias, lowered before each replay
    positions, got = cp.asarray(start), cp.full(B, -7, dtype=np.int32)
    with _build.recording() as plan:
        K.linear_argmax(res, wf, ln_fold=(stats, u, shift, 1e-5), screen=screen, out=got, advance=positions)
    for r in range(3):
        shift -= 64
        got.fill(-7)
        plan.replay()
        assert got.get().tolist() == K.linear_argmax(res, wf, ln_fold=(stats, u, shift, 1e-5)).get().tolist()
        assert positions.get().tolist() == (start + 1 + r).tolist()


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_screen_near_ties_and_ties(dtype):
    """Rows that differ by a few units in the last place from a few base rows, and exact
    copies across tiles: the first index of the largest value, as the exact product."""
    rng = np.random.default_rng(5)
    B, C, N = 4, 768, 3000
    base = rng.standard_normal((5, C)) / np.sqrt(C)
    rows = base[np.arange(N) % 5] * (1 + 1e-3 * rng.integers(0, 3, (N, 1)))
    rows[::7] = base[0]  # exact copies of one row in many tiles
    res, stats = _rows(rng, B, C, dtype)
    wf, u, c = _head(rng, N, C, dtype, rows)
    _same_tokens(res, stats, wf, u, c)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_screen_with_values_that_are_not_finite(dtype):
    """A row of W with an infinity or a NaN, a row of x with a NaN, a bfloat16 row past
    float16's range: the exact product's tokens."""
    rng = np.random.default_rng(9)
    B, C, N = 3, 768, 2000
    res, stats = _rows(rng, B, C, dtype)
    wf, u, c = _head(rng, N, C, dtype)
    _same_tokens(res, stats, wf, u, c)
    wf[1234, 5] = np.inf
    wf[77, 9] = np.nan
    _same_tokens(res, stats, wf, u, c)
    res2 = res.copy()
    res2[1, 3] = np.nan
    _same_tokens(res2, stats, wf, u, c)
    if np.dtype(dtype) != np.float16:
        res3 = res.copy()
        res3[2, 10] = 1e6  # (float16's largest is 65504)
        _same_tokens(res3, stats, wf, u, c)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_screen_with_a_nan_in_a_late_tile(dtype):
    """A NaN in the first row of a tile past the argmax kernel's first round of partials: the
    screen computes every tile, so the token is the exact product's (whose argmax keeps a NaN
    partial only where it meets it before a larger value)."""
    rng = np.random.default_rng(13)
    B, C, N = 2, 768, 50257
    res, stats = _rows(rng, B, C, dtype)
    wf, u, c = _head(rng, N, C, dtype)
    wf[16 * 3000, 7] = np.nan
    _same_tokens(res, stats, wf, u, c)
    if np.dtype(dtype) != np.float16:  # (a bfloat16 row whose largest value is below 2^-100: scale NaN)
        wf[16 * 3000, 7] = 0
        wf[500] *= 2.0 ** -110
        _, scale = K.quantize_rows(wf)
        assert np.isnan(scale[500].get())
        _same_tokens(res, stats, wf, u, c)


def test_screen_checks():
    rng = np.random.default_rng(2)
    res, stats = _rows(rng, 2, 64, np.float16)
    wf, u, c = _head(rng, 40, 64, np.float16)
    fold = (stats, u, c, 1e-5)
    q, scale = K.quantize_rows(wf)
    for bad in [(q[:, :32], scale), (q, scale[:20]), (q.astype(np.int8), scale), (q, scale.astype(np.float16)),
                (q,), (q, scale, 1.0)]:
        with pytest.raises((ValueError, TypeError)):
            K.linear_argmax(res, wf, ln_fold=fold, screen=bad)
    with pytest.raises(ValueError, match="ln_fold"):
        K.linear_argmax(res, wf, screen=(q, scale))
    with pytest.raises(ValueError, match="logits"):
        K.linear_argmax(res, wf, ln_fold=fold, screen=(q, scale), logits=cp.empty((2, 40), np.float32))
    big, big_stats = _rows(rng, 9, 64, np.float16)
    with pytest.raises(ValueError, match="1 to 8 rows"):
        K.linear_argmax(big, wf, ln_fold=(big_stats, u, c, 1e-5), screen=(q, scale))
    with pytest.raises(TypeError):
        K.quantize_rows(cp.ones((4, 8), np.float64))
    # the model is still usable after the errors
    assert cp.array_equal(K.linear_argmax(res, wf, ln_fold=fold, screen=(q, scale)),
                          K.linear_argmax(res, wf, ln_fold=fold))
