"""Every kernel against its float64 numpy reference, on the GPU, in each storage dtype,
on GPT-2's shapes and awkward ones. Outputs are poisoned (NaN) before each launch, so an
element the kernel forgot to write fails the comparison."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled")]

cp = pytest.importorskip("cupy")
import cupy_kernels as K  # noqa: E402
from cupy_kernels import _build  # noqa: E402
from cupy_kernels import reference as ref  # noqa: E402
from gpu_util import DTYPES, check, poisoned, rand  # noqa: E402

ROWS_COLS = [(1, 768), (7, 1024), (64, 1600), (1823, 781), (3, 1), (2, 50257)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,cols", ROWS_COLS)
def test_layernorm(rows, cols, dtype):
    rng = np.random.default_rng(rows * 7 + cols)
    x, xh = rand(rng, (rows, cols), dtype, 3.0)
    w, wh = rand(rng, (cols,), dtype)
    b, bh = rand(rng, (cols,), dtype)
    out = poisoned((rows, cols), dtype)
    K.layernorm(x, w, b, out=out)
    check(out, ref.layernorm(xh, wh, bh), dtype)
    if cols * np.dtype(dtype).itemsize % 16 == 0:  # rows of whole vectors (an unaligned row splits by its address)
        # a row's bits do not depend on the rows normalized with it (more or fewer than the SMs)
        assert cp.array_equal(K.layernorm(x[-1:], w, b)[0], out[-1])
        many = cp.concatenate([x] * max(1, 300 // rows))
        assert cp.array_equal(K.layernorm(many, w, b)[-1], out[-1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,cols", ROWS_COLS[:4])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layernorm_residual(rows, cols, dtype, with_bias):
    rng = np.random.default_rng(rows + cols)
    x, xh = rand(rng, (rows, cols), dtype)
    y, yh = rand(rng, (rows, cols), dtype)
    pb, pbh = rand(rng, (cols,), dtype) if with_bias else (None, None)
    w, wh = rand(rng, (cols,), dtype)
    b, bh = rand(rng, (cols,), dtype)
    out, s = poisoned((rows, cols), dtype), poisoned((rows, cols), dtype)
    K.layernorm_residual(x, y, w, b, proj_bias=pb, out=out, sum_out=s)
    s_ref, out_ref = ref.layernorm_residual(xh, yh, wh, bh, bias=pbh)
    check(s, s_ref, dtype)
    # the kernel normalizes the sum as stored (rounded to dtype), like a framework would
    check(out, ref.layernorm(s.astype(cp.float32).get(), wh, bh), dtype)
    # in place on the residual stream
    s2, out2 = K.layernorm_residual(x, y, w, b, proj_bias=pb, sum_out=x)
    assert s2 is x
    check(x, s_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,cols", [(1, 3072), (7, 4096), (1023, 781), (5, 6400)])
def test_bias_gelu_and_bias_add(rows, cols, dtype):
    rng = np.random.default_rng(cols)
    x, xh = rand(rng, (rows, cols), dtype, 2.0)
    b, bh = rand(rng, (cols,), dtype)
    out = poisoned((rows, cols), dtype)
    K.bias_gelu(x, b, out=out)
    check(out, ref.bias_gelu(xh, bh), dtype)
    out = poisoned((rows, cols), dtype)
    K.bias_add(x, b, out=out)
    check(out, ref.bias_add(xh, bh), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,causal", [((4, 1024), False), ((1823, 781), False), ((2, 50257), False),
                                          ((3, 12, 7, 7), True), ((2, 5, 9), True), ((1, 1023, 1023), True)])
def test_softmax(shape, causal, dtype):
    rng = np.random.default_rng(sum(shape))
    x, xh = rand(rng, shape, dtype, 4.0)
    out = poisoned(shape, dtype)
    K.softmax(x, scale=0.125, causal=causal, out=out)
    check(out, ref.softmax(xh, scale=0.125, causal=causal), dtype)


def check_row_sets(stats, rows):
    """Row statistics sets (linear's stats_out) against float64: each 16 columns' mean and sum
    of squared deviations, of the rows as stored; returns those rows in float64."""
    y = rows.astype(cp.float32).get().astype(np.float64)
    assert stats.shape == (y.shape[0], -(-y.shape[1] // 16), 2)
    for j in range(stats.shape[1]):
        part = y[:, 16 * j:16 * j + 16]
        mean = part.mean(axis=1)
        scale = np.abs(part).max() + 1e-30
        np.testing.assert_allclose(stats[:, j, 0].get(), mean, rtol=0, atol=1e-6 * scale)
        np.testing.assert_allclose(stats[:, j, 1].get(), ((part - mean[:, None]) ** 2).sum(axis=1), rtol=1e-5,
                                   atol=1e-9 * scale**2)
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,C", [(1, 768), (7, 1600), (1024, 768), (5, 781)])
def test_embedding(n, C, dtype):
    rng = np.random.default_rng(n + C)
    V, P = 50257, 1024
    wte, wteh = rand(rng, (V, C), dtype)
    wpe, wpeh = rand(rng, (P, C), dtype)
    ids_h = rng.integers(0, V, n).astype(np.int32)
    pos_h = rng.integers(0, P, n).astype(np.int32)
    out = poisoned((n, C), dtype)
    K.embedding(cp.asarray(ids_h), wte, wpe, cp.asarray(pos_h), out=out)
    check(out, ref.embedding(ids_h, wteh, wpeh, pos_h), dtype)


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
@pytest.mark.parametrize("n,C", [(1, 768), (7, 1600), (3, 776), (64, 1024)])
def test_embedding_stats(n, C, dtype):
    """stats_out: each 16 columns' mean and sum of squared deviations of the rows as stored
    (C = 776: a last set of 8), against float64, and bit for bit what a product's residual
    epilogue leaves for the same rows (y = x + 0 W^T + 0); a row's bits alone."""
    rng = np.random.default_rng(n * C)
    V, P = 1000, 1024
    wte, _ = rand(rng, (V, C), dtype)
    wpe, _ = rand(rng, (P, C), dtype)
    ids = cp.asarray(rng.integers(0, V, n).astype(np.int32))
    pos = cp.asarray(rng.integers(0, P, n).astype(np.int32))
    sets = -(-C // 16)
    plain = poisoned((n, C), dtype)
    K.embedding(ids, wte, wpe, pos, out=plain)
    out, stats = poisoned((n, C), dtype), cp.full((n, sets, 2), np.nan, dtype=np.float32)
    K.embedding(ids, wte, wpe, pos, out=out, stats_out=stats)
    assert cp.array_equal(out, plain)
    check_row_sets(stats, out)
    res, by_product = out.copy(), cp.full((n, sets, 2), np.nan, dtype=np.float32)
    K.linear(cp.zeros((n, 64), dtype), cp.zeros((C, 64), dtype), cp.zeros(C, dtype), residual=res, out=res,
             stats_out=by_product)
    assert cp.array_equal(res, out)
    assert cp.array_equal(stats, by_product)
    alone = cp.full((1, sets, 2), np.nan, dtype=np.float32)
    K.embedding(ids[n - 1:], wte, wpe, pos[n - 1:], out=poisoned((1, C), dtype), stats_out=alone)
    assert cp.array_equal(alone[0], stats[n - 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,T,H,D", [(1, 1, 12, 64), (2, 7, 12, 64), (1, 63, 4, 64), (1, 65, 2, 128),
                                     (1, 1023, 12, 64), (2, 1025, 2, 128), (8, 130, 3, 64)])
def test_causal_attention_strided_qkv(B, T, H, D, dtype):
    """q, k, v are thirds of a fused [B, T, 3, H, D] buffer: strided views, no copies."""
    rng = np.random.default_rng(T * H + D)
    qkv, qkvh = rand(rng, (B, T, 3, H, D), dtype)
    q, k, v = (qkv[:, :, j] for j in range(3))
    out = poisoned((B, T, H, D), dtype)
    K.causal_attention(q, k, v, out=out)
    expect = ref.causal_attention(*(qkvh[:, :, j].transpose(0, 2, 1, 3) for j in range(3)))  # [B, H, T, D]
    check(out, expect.transpose(0, 2, 1, 3), dtype)


def test_causal_attention_unaligned_scalar_path():
    """A view whose rows are not 16-byte aligned takes the scalar (VEC = 1) path."""
    rng = np.random.default_rng(0)
    base, baseh = rand(rng, (1, 9, 3 * 2 * 64 + 1), np.float32)
    qkv = base[:, :, 1:].reshape(1, 9, 3, 2, 64)
    qkvh = baseh[:, :, 1:].reshape(1, 9, 3, 2, 64)
    out = poisoned((1, 9, 2, 64), np.float32)
    K.causal_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], out=out)
    expect = ref.causal_attention(*(qkvh[:, :, j].transpose(0, 2, 1, 3) for j in range(3)))
    check(out, expect.transpose(0, 2, 1, 3), np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_append(dtype):
    rng = np.random.default_rng(5)
    B, T, H, D, S = 3, 5, 4, 64, 16
    kc = poisoned((4, H, S, D), dtype)
    vc = poisoned((4, H, S, D), dtype)
    qkv, qkvh = rand(rng, (B, T, 3, H, D), dtype)
    start_h = np.array([0, 3, 11], dtype=np.int32)
    slots_h = np.array([2, 0, 3], dtype=np.int32)
    lens = cp.zeros(B, dtype=np.int32)
    K.kv_append(kc, vc, qkv[:, :, 1], qkv[:, :, 2], cp.asarray(start_h), slots=cp.asarray(slots_h), seq_lens=lens)
    assert lens.get().tolist() == (start_h + T).tolist()
    kh, vh = kc.astype(cp.float32).get(), vc.astype(cp.float32).get()
    for b in range(B):
        rows = slice(start_h[b], start_h[b] + T)
        np.testing.assert_array_equal(kh[slots_h[b], :, rows], qkvh[b, :, 1].transpose(1, 0, 2))
        np.testing.assert_array_equal(vh[slots_h[b], :, rows], qkvh[b, :, 2].transpose(1, 0, 2))
    # rows nothing wrote are still poisoned: the kernel wrote only where it should
    assert np.isnan(kh[1]).all() and np.isnan(kh[2, :, :0]).all() and np.isnan(kh[2, :, T:]).all()
    pos = cp.asarray(start_h)
    K.kv_advance(pos, 2)
    assert pos.get().tolist() == (start_h + 2).tolist()


@pytest.mark.parametrize("kv", [None, "int8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_append_negative_slot_writes_nothing(dtype, kv):
    """A negative slot (a padding row of a recorded prefill) writes no cache row, scale or
    length; the rows beside it are written as usual."""
    rng = np.random.default_rng(6)
    B, T, H, D, S = 3, 2, 4, 64, 8
    storage = K.kv_storage_dtype(kv, dtype)
    kc, vc = (poisoned((3, H, S, D), dtype) if kv is None else cp.zeros((3, H, S, D), storage) for _ in range(2))
    scales = {} if kv is None else {"k_scale": cp.full((3, H, S), np.nan, np.float32),
                                    "v_scale": cp.full((3, H, S), np.nan, np.float32)}
    qkv, qkvh = rand(rng, (B, T, 3, H, D), dtype)
    start = cp.asarray([1, 4, 6], dtype=np.int32)
    lens = cp.zeros(B, dtype=np.int32)
    K.kv_append(kc, vc, qkv[:, :, 1], qkv[:, :, 2], start, slots=cp.asarray([2, -1, 0], dtype=np.int32),
                seq_lens=lens, **scales)
    assert lens.get().tolist() == [3, 0, 8]
    if kv is None:
        kh = kc.astype(cp.float32).get()
        np.testing.assert_array_equal(kh[2, :, 1:3], qkvh[0, :, 1].transpose(1, 0, 2))
        np.testing.assert_array_equal(kh[0, :, 6:8], qkvh[2, :, 1].transpose(1, 0, 2))
        written = np.zeros(kh.shape[:3], bool)
        written[2, :, 1:3] = written[0, :, 6:8] = True
        assert np.isnan(kh[~written]).all()
    else:
        ks = scales["k_scale"].get()
        assert np.isfinite(ks[2, :, 1:3]).all() and np.isfinite(ks[0, :, 6:8]).all()
        assert np.isnan(ks[1]).all() and np.isnan(ks[0, :, :6]).all() and np.isnan(ks[2, :, 3:]).all()


LINEAR_CASES = [  # (B, N, K, variant): GPT-2 small / XL decode shapes, batches, awkward sizes
    (1, 2304, 768, "ln"), (1, 768, 768, "residual"), (1, 3072, 768, "ln_gelu"), (1, 768, 3072, "residual"),
    (1, 50257, 768, "ln_logits"), (1, 4800, 1600, "ln"), (1, 1600, 6400, "residual"), (1, 6400, 1600, "ln_gelu"),
    (3, 2304, 768, "ln"), (5, 3072, 768, "gelu"), (8, 768, 3072, "residual"), (2, 50257, 768, "logits"),
    (9, 37, 781, "ln_gelu"), (17, 129, 1600, "residual"), (4, 1000, 768, "store"), (7, 101, 72, "ln_logits"),
    # batches: passes of 64 rows of x, the LayerNorm ahead of the product past 16 rows
    (17, 2304, 768, "ln"), (64, 3072, 768, "ln_gelu"), (255, 768, 3072, "residual"), (33, 1000, 1600, "ln_logits"),
    (100, 200, 776, "gelu"),
    # the LM head past 32 rows: two m-tiles a block, the last one's second tile partly / wholly past N
    (64, 50257, 768, "logits"), (40, 50241, 72, "ln_logits"), (100, 50257, 768, "ln_logits"),
    # GPT-2 XL's LM head, rows past one n-tile
    (24, 50257, 1600, "logits"),
    # GPT-2 medium's rows of 1,024 values (4 warps of 8 chunks: MMA_ROW_WARPS), its LM head past 16 rows
    (1, 3072, 1024, "ln"), (8, 1024, 1024, "residual"), (3, 4096, 1024, "ln_gelu"), (40, 50257, 1024, "logits"),
]


def _linear_case(rng, B, N, K_, variant, dtype):
    """Inputs, keyword arguments and the float64 expectation of one linear case."""
    x, xh = rand(rng, (B, K_), dtype)
    w, wh = rand(rng, (N, K_), dtype, 1.0 / np.sqrt(K_))
    b, bh = rand(rng, (N,), dtype)
    kw, xin = {}, xh
    if variant.startswith("ln"):
        lw, lwh = rand(rng, (K_,), dtype)
        lb, lbh = rand(rng, (K_,), dtype)
        kw["ln"] = (lw, lb, 1e-5)
        xin = ref.layernorm(xh, lwh, lbh, 1e-5)
    expect = ref.linear(xin, wh, bh)
    if variant.endswith("gelu"):
        kw["gelu"] = True
        expect = ref.gelu_tanh(expect)
    if variant.endswith("logits"):
        kw["out_dtype"] = np.float32
    if variant == "residual":
        res, resh = rand(rng, (B, N), dtype)
        kw["residual"] = res
        expect = expect + resh
    return x, w, b, kw, expect


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,N,K_,variant", LINEAR_CASES)
def test_linear(B, N, K_, variant, dtype):
    rng = np.random.default_rng(N + K_ + B)
    x, w, b, kw, expect = _linear_case(rng, B, N, K_, variant, dtype)
    out_dtype = kw.get("out_dtype", dtype)
    out = poisoned((B, N), out_dtype)
    x_before = x.copy()
    K.linear(x, w, b, out=out, **kw)
    check(out, expect, dtype)
    assert cp.array_equal(x, x_before), "x must not be modified"
    # a row gives the same bits alone as in the batch
    last = {k: (v[B - 1:] if k == "residual" else v) for k, v in kw.items()}
    alone = K.linear(x[B - 1:], w, b, **last)
    assert cp.array_equal(alone[0], out[B - 1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_residual_in_place(dtype):
    """out = residual: the residual stream updated in place, as the decode step does."""
    rng = np.random.default_rng(5)
    x, w, b, kw, expect = _linear_case(rng, 3, 768, 3072, "residual", dtype)
    res = kw["residual"]
    K.linear(x, w, b, residual=res, out=res)
    check(res, expect, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,K_", [(1000, 1600), (200, 4104)])  # (K = 4104: 16 warps on tensor cores)
def test_linear_every_tile_gives_the_same_bits(N, K_, dtype):
    """Every launch shape computes the same bits: on CUDA cores each lane visits its columns
    in increasing order whatever the tile (the LayerNorm's sums follow the block width, which
    the shape alone fixes); on tensor cores each warp chains its chunks in order whatever the
    rows of x per pass, and the LayerNorm gives the same bits in the prologue and ahead of it."""
    rng = np.random.default_rng(11 + K_)
    x, w, b, kw, expect = _linear_case(rng, 21, N, K_, "ln_gelu", dtype)
    mma = np.dtype(dtype).itemsize == 2
    shapes = ([{"tile": t} for t in K.linear_tiles(dtype)] if mma else
              [{"tile": t, "warps": wp} for t in K.linear_tiles(dtype) for wp in (4, 8)])
    outs = []
    for shape in shapes:
        out = poisoned((21, N), dtype)
        K.linear(x, w, b, out=out, **shape, **kw)
        check(out, expect, dtype)
        outs.append(out)
    assert all(cp.array_equal(o, outs[0]) for o in outs[1:])
    # a row alone (LayerNorm in the prologue) and in batches of every size (ahead of it past 16 rows)
    for rows in (slice(20, 21), slice(14, 21), slice(0, 21)):
        assert cp.array_equal(K.linear(x[rows], w, b, **kw)[-1], outs[0][20])
    plain = [K.linear(x, w, b, **shape) for shape in shapes]
    assert all(cp.array_equal(o, plain[0]) for o in plain[1:])


@pytest.mark.parametrize("dtype", [d for d in DTYPES if np.dtype(d).itemsize == 2], ids=str)
@pytest.mark.parametrize("B,N,K_,variant", [
    (1, 768, 3072, "residual"), (1, 1600, 6400, "residual"), (5, 100, 1032, "gelu"), (8, 37, 4104, "store"),
    (3, 1000, 2056, "residual")])
def test_linear_w_ahead_gives_the_same_bits(B, N, K_, variant, dtype):
    """One n-tile with W a batch ahead (a block an SM): the bits of the plain kernel, with the
    row statistics of a residual product too; uneven chunks a warp (K = 1032, 4104), more tiles
    than SMs (N = 1000 at 132 SMs takes the plain kernel by default). W ahead takes blocks of at
    most 8 warps: rows that take 16 by default (K > 3840) are run at 8 here."""
    rng = np.random.default_rng(B * N + K_)
    x, w, b, kw, expect = _linear_case(rng, B, N, K_, variant, dtype)
    lin = importlib.import_module("cupy_kernels.linear")
    if lin._mma_warps(K_) > lin.MMA_NARROW_WARPS:
        kw["warps"] = lin.MMA_NARROW_WARPS
    res = kw.pop("residual", None)
    outs, stats = [], []
    for ahead in (None, False, True):
        out = poisoned((B, N), dtype)
        st = None
        if res is not None:  # the residual stream updated in place, its statistics beside it
            out[...] = res
            st = poisoned((B, -(-N // 16), 2), np.float32)
            kw.update(residual=out, stats_out=st)
        K.linear(x, w, b, out=out, ahead=ahead, **kw)
        check(out, expect, dtype)
        outs.append(out)
        stats.append(st)
    assert all(cp.array_equal(o, outs[0]) for o in outs)
    if res is not None:
        assert not cp.isnan(stats[0]).any()
        assert all(cp.array_equal(s, stats[0]) for s in stats)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if np.dtype(d).itemsize == 2], ids=str)
@pytest.mark.parametrize("B,N,K_,variant", [
    (1, 2304, 768, "ln"), (1, 3072, 768, "gelu"), (1, 768, 3072, "residual"), (5, 1000, 1600, "ln_gelu"),
    (1, 1600, 6400, "residual"), (70, 17000, 72, "logits"), (20, 20000, 72, "store"), (33, 17000, 72, "logits")])
def test_linear_pace_keeps_the_bits(B, N, K_, variant, dtype):
    """pace=: blocks requesting their weights one after another give the unpaced bits, which
    match the reference, on every kernel it reaches (LayerNorm prologue, W ahead at K = 6400,
    two m-tiles of float logits at 70 rows, several n-tiles at 20 rows); a slow pace as well;
    and every trigger= point. (33 rows of logits: the streamed LM head, which takes neither.)"""
    rng = np.random.default_rng(B + N + K_)
    x, w, b, kw, expect = _linear_case(rng, B, N, K_, variant, dtype)
    out_dtype = kw.get("out_dtype", dtype)
    res = kw.pop("residual", None)
    outs = []
    for pace, trigger in ((None, "start"), (3000, "start"), (40.5, "start"), (None, "requested"), (None, "waited"),
                          (3000, "waited")):
        out = poisoned((B, N), out_dtype)
        if res is not None:
            out[...] = res
            kw["residual"] = out
        K.linear(x, w, b, out=out, pace=pace, trigger=trigger, **kw)
        check(out, expect, dtype)
        outs.append(out)
    assert all(cp.array_equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("B,N,K_,variant", [(1, 2304, 768, "ln"), (3, 768, 3072, "residual"), (2, 50, 70, "gelu")])
def test_linear_cuda_core_triggers_keep_the_bits(B, N, K_, variant):
    """trigger= on the CUDA-core product (float32 rows; K = 70: the element-wise path): each
    point gives the bits of "start", which match the reference."""
    rng = np.random.default_rng(B + N + K_)
    x, w, b, kw, expect = _linear_case(rng, B, N, K_, variant, np.float32)
    res = kw.pop("residual", None)
    outs = []
    for trigger in ("start", "requested", "waited"):
        out = poisoned((B, N), np.float32)
        if res is not None:
            out[...] = res
            kw["residual"] = out
        K.linear(x, w, b, out=out, trigger=trigger, **kw)
        check(out, expect, np.float32)
        outs.append(out)
    assert all(cp.array_equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,D,S_max,tile", [(1, 12, 64, 40, None), (3, 25, 64, 7, None), (9, 2, 128, 5, None),
                                              (20, 12, 64, 9, None), (70, 2, 64, 9, 8)])
def test_linear_qkv_into_the_cache(B, H, D, S_max, tile, dtype):
    """kv_cache=: the q|k|v product as usual, and its k, v parts in the caches at each row's
    position, as kv_append would put them; seq_lens = positions + 1; other rows untouched.
    (70 rows at 8 n-tiles of C = 128: blocks of one warp for 64 rows of x each.)"""
    if tile is not None and dtype == np.float32:
        pytest.skip("n-tiles: tensor cores (16-bit) only")
    rng = np.random.default_rng(B * H)
    C = H * D
    x, w, b, kw, expect = _linear_case(rng, B, 3 * C, C, "ln", dtype)
    k_cache, v_cache = poisoned((B + 1, H, S_max, D), dtype), poisoned((B + 1, H, S_max, D), dtype)
    positions = cp.asarray(rng.integers(0, S_max, B), dtype=np.int32)
    seq_lens = cp.zeros(B, dtype=np.int32)
    out = poisoned((B, 3 * C), dtype)
    K.linear(x, w, b, out=out, kv_cache={"k_cache": k_cache, "v_cache": v_cache, "positions": positions,
                                         "seq_lens": seq_lens}, tile=tile, **kw)
    check(out, expect, dtype)
    ref_k, ref_v = poisoned((B + 1, H, S_max, D), dtype), poisoned((B + 1, H, S_max, D), dtype)
    qkv = out.reshape(B, 1, 3, H, D)
    K.kv_append(ref_k, ref_v, qkv[:, :, 1], qkv[:, :, 2], positions)
    assert cp.array_equal(cp.isnan(k_cache.astype(cp.float32)), cp.isnan(ref_k.astype(cp.float32)))
    written = ~cp.isnan(ref_k.astype(cp.float32))
    assert cp.array_equal(k_cache[written], ref_k[written]) and cp.array_equal(v_cache[written], ref_v[written])
    assert seq_lens.get().tolist() == (positions.get() + 1).tolist()


FOLD_CASES = [  # (B, K of the residual product, C its outputs, N of the product normalizing them)
    (1, 3072, 768, 2304), (3, 1600, 1600, 4800), (8, 776, 1000, 129), (64, 768, 768, 3072), (255, 72, 40, 77),
    (33, 72, 768, 50257),  # the LM head: 64 rows of x a block, over 48 KiB of shared memory with the static
    (64, 72, 768, 50257), (17, 40, 768, 17011),  # (W streamed through shared memory: linear_mma_stream_kernel)
]


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
@pytest.mark.parametrize("B,K1,C,N", FOLD_CASES)
def test_linear_layernorm_folded(B, K1, C, N, dtype):
    """stats_out: each 16 outputs' mean and sum of squared deviations, of the rows as stored;
    ln_fold: the next product's LayerNorm folded into its weight (fold_layernorm) and its
    epilogue (GELU, argmax and q|k|v-into-the-cache epilogues alike), against LN(y) W^T + b
    in float64 with the unfolded parameters; a row's bits alone, in any batch, every tile."""
    rng = np.random.default_rng(B + K1 + C)
    x, w, b, kw, expect_y = _linear_case(rng, B, C, K1, "residual", dtype)
    res = kw["residual"]
    res_alone = res[B - 1:].copy()
    stats = cp.full((B, -(-C // 16), 2), np.nan, dtype=np.float32)
    K.linear(x, w, b, residual=res, out=res, stats_out=stats)
    check(res, expect_y, dtype)
    y = check_row_sets(stats, res)
    alone = cp.full((1, stats.shape[1], 2), np.nan, dtype=np.float32)
    K.linear(x[B - 1:], w, b, residual=res_alone, out=res_alone, stats_out=alone)
    assert cp.array_equal(alone[0], stats[B - 1])

    w2, w2h = rand(rng, (N, C), dtype, 1.0 / np.sqrt(C))
    b2, b2h = rand(rng, (N,), dtype)
    lw, lwh = rand(rng, (C,), dtype)
    lb, lbh = rand(rng, (C,), dtype)
    wf, bf, u, c = K.fold_layernorm(w2, b2, lw, lb)
    assert wf.dtype == w2.dtype and bf.dtype == w2.dtype and u.dtype == c.dtype == np.float32
    np.testing.assert_allclose(c.get(), w2h @ lbh + b2h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(u.get(), wf.astype(cp.float64).sum(axis=1).get(), rtol=1e-5, atol=1e-5)
    check(wf, w2h * lwh, dtype)
    fold = (stats, u, c, 1e-5)
    pre = ref.linear(ref.layernorm(y, lwh, lbh, 1e-5), w2h, b2h)
    outs = []
    for tile in (None, *K.linear_tiles(dtype)):
        out = poisoned((B, N), dtype)
        K.linear(res, wf, ln_fold=fold, gelu=True, out=out, tile=tile)
        check(out, ref.gelu_tanh(pre), dtype)
        outs.append(out)
    assert all(cp.array_equal(o, outs[0]) for o in outs[1:])
    last = (stats[B - 1:].copy(), u, c, 1e-5)
    assert cp.array_equal(K.linear(res[B - 1:], wf, ln_fold=last, gelu=True)[0], outs[0][B - 1])
    # one warp more combining the rows' statistics (blocks of one n-tile): the same bits
    out = poisoned((B, N), dtype)
    K.linear(res, wf, ln_fold=fold, gelu=True, out=out, stats_warp=True)
    assert cp.array_equal(out, outs[0])
    with _build.recording() as plan:  # ... from blocks of one warp more where a block takes one n-tile (8 rows)
        K.linear(res, wf, ln_fold=fold, gelu=True)
        K.linear(res, wf, ln_fold=fold, gelu=True, stats_warp=True)
    one_tile = plan[0].grid[1] == -(-B // 8)
    assert plan[1].block[0] == plan[0].block[0] + (32 if one_tile else 0) and plan[1].grid == plan[0].grid
    assert cp.array_equal(K.linear(res[B - 1:], wf, ln_fold=last, gelu=True, stats_warp=True)[0], outs[0][B - 1])
    # the same function as the unfolded product after a LayerNorm without parameters
    ones, zeros = cp.ones(C, dtype), cp.zeros(C, dtype)
    check(K.linear(res, wf, bf, ln=(ones, zeros, 1e-5)), pre, dtype)
    # the LM head's argmax
    logits = poisoned((B, N), np.float32)
    tokens = K.linear_argmax(res, wf, ln_fold=fold, logits=logits)
    check(logits, pre, dtype)
    assert tokens.get().tolist() == np.argmax(logits.get(), axis=1).tolist()
    assert cp.array_equal(K.linear_argmax(res, wf, ln_fold=fold), tokens)
    # ... and a row's logits alone, from the plain float32 store (one n-tile and m-tile)
    assert cp.array_equal(K.linear(res[B - 1:], wf, ln_fold=last, out_dtype=np.float32)[0], logits[B - 1])
    assert cp.array_equal(K.linear(res, wf, ln_fold=fold, out_dtype=np.float32), logits)
    assert cp.array_equal(K.linear(res, wf, ln_fold=fold, out_dtype=np.float32, stats_warp=True), logits)
    # q|k|v into the cache
    if N % 3 == 0 and (N // 3) % 64 == 0:
        H, S_max = N // 3 // 64, 9
        k_cache, v_cache = poisoned((B, H, S_max, 64), dtype), poisoned((B, H, S_max, 64), dtype)
        positions = cp.asarray(rng.integers(0, S_max, B), dtype=np.int32)
        out = poisoned((B, N), dtype)
        K.linear(res, wf, ln_fold=fold, out=out, kv_cache={
            "k_cache": k_cache, "v_cache": v_cache, "positions": positions, "seq_lens": cp.zeros(B, np.int32)})
        check(out, pre, dtype)
        qkv = out.reshape(B, 3, H, 64)
        at = positions.get()
        for i in range(B):
            assert cp.array_equal(k_cache[i, :, int(at[i])], qkv[i, 1])
            assert cp.array_equal(v_cache[i, :, int(at[i])], qkv[i, 2])
        # ... with the statistics warp: the same bits, in the output and the caches
        k2, v2, out2 = k_cache.copy(), v_cache.copy(), poisoned((B, N), dtype)
        lens = cp.zeros(B, np.int32)
        for i in range(B):
            k2[i, :, int(at[i])] = v2[i, :, int(at[i])] = np.nan
        K.linear(res, wf, ln_fold=fold, out=out2, stats_warp=True, kv_cache={
            "k_cache": k2, "v_cache": v2, "positions": positions, "seq_lens": lens})
        assert cp.array_equal(out2, out) and cp.array_equal(lens, positions + 1)
        assert cp.array_equal(k2, k_cache, equal_nan=True) and cp.array_equal(v2, v_cache, equal_nan=True)


def test_linear_folded_layernorm_bad_inputs_raise():
    x = cp.ones((2, 64), np.float16)
    w = cp.ones((32, 64), np.float16)
    ln = (cp.ones(64, np.float16), cp.zeros(64, np.float16), 1e-5)
    st = cp.zeros((2, 4, 2), np.float32)
    u, c = cp.zeros(32, np.float32), cp.zeros(32, np.float32)
    with pytest.raises(ValueError, match="pass neither ln nor bias"):
        K.linear(x, w, ln=ln, ln_fold=(st, u, c, 1e-5))
    with pytest.raises(ValueError, match="pass neither ln nor bias"):
        K.linear(x, w, cp.zeros(32, np.float16), ln_fold=(st, u, c, 1e-5))
    with pytest.raises(TypeError, match="ln_fold must be a tuple"):
        K.linear(x, w, ln_fold=st)
    with pytest.raises(ValueError, match="pass residual too"):
        K.linear(x, w, stats_out=cp.zeros((2, 2, 2), np.float32))
    with pytest.raises(ValueError, match="ln_fold stats"):
        K.linear(x, w, ln_fold=(cp.zeros((2, 3, 2), np.float32), u, c, 1e-5))
    with pytest.raises(TypeError, match="float32"):
        K.linear(x, w, ln_fold=(st.astype(np.float16), u, c, 1e-5))
    with pytest.raises(ValueError, match="C-contiguous and 16-byte aligned"):
        K.linear(x, w, ln_fold=(cp.zeros((4, 2, 2), np.float32).transpose(1, 0, 2), u, c, 1e-5))
    with pytest.raises(ValueError, match="16-byte aligned"):
        K.linear(x, w, ln_fold=(cp.zeros(18, np.float32)[2:].reshape(2, 4, 2), u, c, 1e-5))  # 8 bytes in
    with pytest.raises(ValueError, match="ln_fold u"):
        K.linear(x, w, ln_fold=(st, u[:16], c, 1e-5))
    with pytest.raises(ValueError, match="ln_fold eps"):
        K.linear(x, w, ln_fold=(st, u, c, -1.0))
    with pytest.raises(TypeError, match="tensor-core"):
        K.linear(x.astype(np.float32), w.astype(np.float32), ln_fold=(st, u, c, 1e-5))
    with pytest.raises(ValueError, match="pass neither"):
        K.linear_argmax(x, w, ln=ln, ln_fold=(st, u, c, 1e-5))
    # nothing was launched half-way: a correct call still works
    assert K.linear(x, w, ln_fold=(st, u, c, 1e-5)).shape == (2, 32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,N,K_,ln", [(1, 50257, 768, True), (3, 50257, 1600, True), (2, 1000, 768, False),
                                       (9, 77, 781, True), (48, 50241, 776, False)])
def test_linear_argmax(B, N, K_, ln, dtype):
    rng = np.random.default_rng(N + B)
    x, w, b, kw, expect = _linear_case(rng, B, N, K_, "ln_logits" if ln else "logits", dtype)
    kw.pop("out_dtype")
    logits = poisoned((B, N), np.float32)
    tokens = cp.full(B, -7, dtype=np.int32)
    K.linear_argmax(x, w, b, logits=logits, out=tokens, **kw)
    check(logits, expect, dtype)
    # the first index of each row's largest logit, as written
    assert tokens.get().tolist() == np.argmax(logits.get(), axis=1).tolist()
    assert cp.array_equal(K.linear_argmax(x, w, b, **kw), tokens)  # without writing logits
    assert cp.array_equal(K.linear_argmax(x[B - 1:], w, b, **kw)[0], tokens[B - 1])
    start = rng.integers(0, 1000, B).astype(np.int32)
    positions = cp.asarray(start)
    assert cp.array_equal(K.linear_argmax(x, w, b, advance=positions, **kw), tokens)  # advance: positions + 1
    assert positions.get().tolist() == (start + 1).tolist()


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
@pytest.mark.parametrize("B,C", [(1, 768), (3, 1600), (8, 776)])
def test_linear_argmax_embeds_the_next_tokens(B, C, dtype):
    """embed=: the argmax's launch also writes each row's embedding of its token at its moved
    position, with the row statistics: the bits embedding(stats_out=) leaves for those tokens
    and positions; a position moved past wpe's rows reads its last row; x_out may be x."""
    rng = np.random.default_rng(B * C)
    V, P = 5003, 64
    x, _ = rand(rng, (B, C), dtype)
    w, _ = rand(rng, (V, C), dtype, 1.0 / np.sqrt(C))
    wte, _ = rand(rng, (V, C), dtype)
    wpe, _ = rand(rng, (P, C), dtype)
    start = rng.integers(0, P - 1, B).astype(np.int32)
    start[-1] = P - 1  # moved to P: wpe's last row
    tokens = K.linear_argmax(x, w)
    sets = -(-C // 16)
    expect_x, expect_stats = poisoned((B, C), dtype), cp.full((B, sets, 2), np.nan, dtype=np.float32)
    K.embedding(tokens, wte, wpe, cp.asarray(np.minimum(start + 1, P - 1)), out=expect_x, stats_out=expect_stats)
    positions = cp.asarray(start)
    got, x_out, stats = cp.full(B, -7, dtype=np.int32), poisoned((B, C), dtype), cp.full((B, sets, 2), np.nan,
                                                                                          dtype=np.float32)
    K.linear_argmax(x, w, out=got, advance=positions, embed=(wte, wpe, x_out, stats))
    assert cp.array_equal(got, tokens)
    assert positions.get().tolist() == (start + 1).tolist()
    assert cp.array_equal(x_out, expect_x) and cp.array_equal(stats, expect_stats)
    own, stats = x.copy(), cp.full((B, sets, 2), np.nan, dtype=np.float32)  # the product's own x
    K.linear_argmax(own, w, out=got, advance=cp.asarray(start), embed=(wte, wpe, own, stats))
    assert cp.array_equal(got, tokens)
    assert cp.array_equal(own, expect_x) and cp.array_equal(stats, expect_stats)


def test_linear_argmax_embed_checks():
    """embed= needs the positions it embeds at, 16-bit rows of 16-byte vectors of x's dtype and
    outputs of the rows' shapes: each refused before anything runs."""
    h = np.float16
    x, w = cp.ones((2, 64), h), cp.ones((100, 64), h)
    wte, wpe = cp.ones((100, 64), h), cp.ones((10, 64), h)
    x_out, stats = cp.zeros((2, 64), h), cp.zeros((2, 4, 2), np.float32)
    positions, tokens = cp.zeros(2, np.int32), cp.full(2, -7, np.int32)
    bad = [(ValueError, "advance", dict(embed=(wte, wpe, x_out, stats))),
           (TypeError, "embed must be", dict(advance=positions, embed=(wte, wpe, x_out))),
           (ValueError, "columns", dict(advance=positions, embed=(wte, cp.ones((10, 32), h), x_out, stats))),
           (TypeError, "dtype", dict(advance=positions, embed=(wte.astype(np.float32), wpe, x_out, stats))),
           (ValueError, "x_out", dict(advance=positions, embed=(wte, wpe, cp.zeros((3, 64), h), stats))),
           (ValueError, "stats_out", dict(advance=positions, embed=(wte, wpe, x_out, cp.zeros((2, 8, 2), np.float32)))),
           (ValueError, "at least one row", dict(advance=positions, embed=(wte, wpe[:0], x_out, stats)))]
    for error, match, kw in bad:
        with pytest.raises(error, match=match):
            K.linear_argmax(x, w, out=tokens, **kw)
    with pytest.raises(TypeError, match="16-byte vectors"):  # float32 rows
        f = np.float32
        K.linear_argmax(x.astype(f), w.astype(f), out=tokens, advance=positions,
                        embed=(wte.astype(f), wpe.astype(f), x_out.astype(f), stats))
    assert positions.get().tolist() == [0, 0] and tokens.get().tolist() == [-7, -7]  # nothing ran


@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)
@pytest.mark.parametrize("B", [17, 40, 64])
def test_linear_streamed_lm_head(B, dtype):
    """Float logits of a tall weight for 17 to 64 rows (linear_mma_stream_kernel, W through a
    shared-memory ring): against float64, and the bits of linear_mma_kernel (n-tiles asked
    for) and of each row alone; the argmax, its partials one a block."""
    import importlib

    lin = importlib.import_module("cupy_kernels.linear")
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    N, K_ = 16 * lin.MMA_WIDE_BLOCKS * sms + 5, 768  # tall enough, and a last tile of 5 rows
    assert lin._mma_stream(B, N, K_, None, lin.X_PLAIN, True, lin._mma_warps(K_), sms, lin._build.smem_optin())
    assert not lin._mma_stream(B, N, K_, 8, lin.X_PLAIN, True, lin._mma_warps(K_), sms, lin._build.smem_optin())
    rng = np.random.default_rng(B)
    x, w, b, kw, expect = _linear_case(rng, B, N, K_, "logits", dtype)
    out = poisoned((B, N), np.float32)
    K.linear(x, w, b, out=out, **kw)
    check(out, expect, dtype)
    assert cp.array_equal(K.linear(x, w, b, tile=8, **kw), out)  # linear_mma_kernel
    for r in (0, B - 1):
        assert cp.array_equal(K.linear(x[r:r + 1], w, b, **kw)[0], out[r])
    tokens = cp.full(B, -7, dtype=np.int32)
    K.linear_argmax(x, w, b, out=tokens)
    assert tokens.get().tolist() == np.argmax(out.get(), axis=1).tolist()
    # a bias not 16-byte aligned takes linear_mma_kernel, with the same bits
    b_off = cp.empty(N + 1, dtype=b.dtype)[1:]
    b_off[...] = b
    assert cp.array_equal(K.linear(x, w, b_off, **kw), out)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=str)
def test_linear_argmax_ties_keep_the_first_index(dtype):
    """Equal logits in many blocks: the smallest index wins, as numpy's argmax."""
    rng = np.random.default_rng(3)
    N, K_ = 5000, 768
    base = rng.standard_normal((7, K_)).astype(dtype)
    w = cp.asarray(base[np.arange(N) % 7])  # row n repeats row n % 7
    x = cp.asarray(rng.standard_normal((4, K_)).astype(dtype))
    shapes = ([{"tile": t} for t in K.linear_tiles(dtype)] if np.dtype(dtype).itemsize == 2 else
              [{"tile": t, "warps": wp} for t in K.linear_tiles(dtype) for wp in (4, 8)])
    for shape in shapes:
        got = K.linear_argmax(x, w, **shape).get()
        with_logits = K.linear_argmax(x, w, **shape, logits=cp.empty((4, N), np.float32))
        assert got.tolist() == with_logits.get().tolist()
        logits = K.linear(x, w, out_dtype=np.float32).get()
        assert got.tolist() == np.argmax(logits, axis=1).tolist()
        assert (got < 7).all()


def test_linear_bad_inputs_raise():
    x = cp.ones((2, 64), np.float32)
    w = cp.ones((10, 64), np.float32)
    ln = (cp.ones(64, np.float32), cp.zeros(64, np.float32), 1e-5)
    with pytest.raises(ValueError, match="input features"):
        K.linear(x, cp.ones((10, 32), np.float32))
    with pytest.raises(ValueError, match="ln weight"):
        K.linear(x, w, ln=(ln[0][:32], ln[1], 1e-5))
    with pytest.raises(TypeError, match="ln bias"):
        K.linear(x, w, ln=(ln[0], ln[1].astype(np.float16), 1e-5))
    with pytest.raises(TypeError, match="tuple"):
        K.linear(x, w, ln=ln[0])
    with pytest.raises(ValueError, match="eps"):
        K.linear(x, w, ln=(ln[0], ln[1], float("nan")))
    with pytest.raises(ValueError, match="exclude each other"):
        K.linear(x, w, residual=cp.ones((2, 10), np.float32), gelu=True)
    cache = cp.zeros((2, 2, 8, 16), np.float32)
    kv = {"k_cache": cache, "v_cache": cache.copy(), "positions": cp.zeros(2, np.int32),
          "seq_lens": cp.zeros(2, np.int32)}
    w96 = cp.ones((96, 64), np.float32)
    with pytest.raises(ValueError, match="pass ln"):
        K.linear(x, w96, kv_cache=kv)
    with pytest.raises(ValueError, match="3 C"):
        K.linear(x, w, ln=ln, kv_cache=kv)
    with pytest.raises(TypeError, match="quantized"):
        K.linear(x, w96, ln=ln, kv_cache={**kv, "k_cache": cache.astype(np.int8)})
    with pytest.raises(TypeError, match="positions"):
        K.linear(x, w96, ln=ln, kv_cache={**kv, "positions": cp.zeros(2, np.int64)})
    with pytest.raises(ValueError, match="H \\* D"):
        K.linear(x, cp.ones((48, 64), np.float32), ln=ln, kv_cache=kv)
    with pytest.raises(ValueError, match="residual"):
        K.linear(x, w, residual=cp.ones((2, 11), np.float32))
    with pytest.raises(ValueError, match="overlap x"):
        K.linear(x, cp.ones((64, 64), np.float32), out=x)
    with pytest.raises(ValueError, match="tile"):
        K.linear(x, w, tile=(3, 3))
    with pytest.raises(ValueError, match="warps"):
        K.linear(x, w, warps=5)
    with pytest.raises(TypeError, match="out_dtype"):
        K.linear(x.astype(np.float16), w.astype(np.float16), out_dtype=np.float64)
    with pytest.raises(TypeError, match="pace"):
        K.linear(x, w, pace=1000)  # float32: CUDA cores
    xh, wh = x.astype(np.float16), w.astype(np.float16)
    for bad in (0, -5, float("nan"), float("inf"), 2e6):
        with pytest.raises(ValueError, match="pace"):
            K.linear(xh, wh, pace=bad)
    for bad in ("fast", True, [1000]):
        with pytest.raises(TypeError, match="pace"):
            K.linear(xh, wh, pace=bad)
    for bad in ("late", 1, True, None):
        with pytest.raises(ValueError, match="trigger must be one of"):
            K.linear(xh, wh, trigger=bad)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="stats_warp must be a bool"):
            K.linear(xh, wh, stats_warp=bad)
    with pytest.raises(ValueError, match="too slow"):
        K.linear(cp.ones((1, 70000), np.float16), cp.ones((16, 70000), np.float16), pace=1)
    with pytest.raises(ValueError, match="tile"):  # tensor cores take n-tiles per pass
        K.linear(xh, wh, tile=(2, 4))
    with pytest.raises(ValueError, match="warps"):
        K.linear(xh, wh, warps=17)
    with pytest.raises(ValueError, match="tensor cores"):
        K.linear(x, w, ahead=True)
    with pytest.raises(ValueError, match="plain x"):
        K.linear(xh, wh, ln=(ln[0].astype(np.float16), ln[1].astype(np.float16), 1e-5), ahead=True)
    with pytest.raises(ValueError, match="at most 8 rows"):
        K.linear(cp.ones((20, 64), np.float16), wh, tile=2, ahead=True)
    with pytest.raises(ValueError, match="at most 8 warps"):  # (K > 3840: 16 warps)
        K.linear(cp.ones((1, 4096), np.float16), cp.ones((16, 4096), np.float16), ahead=True)
    with pytest.raises(ValueError, match="at most 8 warps"):
        K.linear(xh, wh, warps=9, ahead=True)
    with pytest.raises(TypeError, match="logits"):
        K.linear_argmax(x, w, logits=cp.empty((2, 10), np.float16))
    with pytest.raises(ValueError, match="out"):
        K.linear_argmax(x, w, out=cp.empty(3, np.int32))
    with pytest.raises(TypeError, match="advance"):
        K.linear_argmax(x, w, advance=cp.zeros(2, np.int64))
    with pytest.raises(ValueError, match="advance"):
        K.linear_argmax(x, w, advance=cp.zeros(3, np.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,V", [(1, 50257), (4, 1000), (3, 1)])
def test_argmax(B, V, dtype):
    rng = np.random.default_rng(V)
    x, xh = rand(rng, (B, V), dtype)
    if V > 10:  # ties: the first index wins
        x[0, 3] = x[0, 7] = 100
        xh[0, 3] = xh[0, 7] = 100
    out = cp.full(B, -5, dtype=np.int32)
    K.argmax(x, out=out)
    assert out.get().tolist() == np.argmax(xh, axis=1).tolist()


@pytest.mark.parametrize("B", [1, 5, 300])
def test_publish_tokens_into_the_pinned_ring(B):
    """publish_tokens: each call's tokens land in row slot[0] of the pinned ring, written by
    the GPU, and slot[0] moves on modulo the ring's rows; the other rows keep their values."""
    import cupyx

    rng = np.random.default_rng(B)
    ring = cupyx.empty_pinned((3, B), dtype=np.int32)
    ring[...] = -7
    slot = cp.asarray([1], dtype=np.int32)
    sent = [rng.integers(0, 50257, B).astype(np.int32) for _ in range(4)]
    for toks in sent:
        K.publish_tokens(cp.asarray(toks), ring, slot)
    cp.cuda.Device().synchronize()
    assert ring[1].tolist() == sent[3].tolist() and ring[2].tolist() == sent[1].tolist()
    assert ring[0].tolist() == sent[2].tolist() and int(slot.get()[0]) == 2


def test_publish_tokens_rejects_bad_arguments():
    """Pageable host memory, a ring of the wrong width or dtype, a slot that is not int32 [1]:
    TypeError before any launch."""
    import cupyx

    toks, slot = cp.arange(4, dtype=np.int32), cp.zeros(1, dtype=np.int32)
    with pytest.raises(TypeError, match="pinned"):
        K.publish_tokens(toks, np.zeros((2, 4), dtype=np.int32), slot)
    with pytest.raises(TypeError, match="ring"):
        K.publish_tokens(toks, cupyx.empty_pinned((2, 5), dtype=np.int32), slot)
    with pytest.raises(TypeError, match="ring"):
        K.publish_tokens(toks, cupyx.empty_pinned((2, 4), dtype=np.int64), slot)
    with pytest.raises(TypeError, match="slot"):
        K.publish_tokens(toks, cupyx.empty_pinned((2, 4), dtype=np.int32), cp.zeros(2, dtype=np.int32))
    with pytest.raises(TypeError, match="tokens"):
        K.publish_tokens(toks.astype(np.int64), cupyx.empty_pinned((2, 4), dtype=np.int32), slot)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 50, None), (1.3, None, 0.9),
                                                     (1.0, 40, 0.8), (0.5, 1, None), (1.0, None, 0.01)])
def test_sample_matches_reference(temperature, top_k, top_p, dtype):
    """Same uniform numbers (Philox, checked against the reference) -> same tokens."""
    rng = np.random.default_rng(11)
    B, V = 6, 50257
    x, xh = rand(rng, (B, V), dtype, 3.0)
    seed = 0x1234_5678_9ABC
    offsets = cp.asarray(np.array([0, 1, 2**32 + 5, 7, 7, 123456], dtype=np.uint64))
    start = offsets.get()
    out = cp.full(B, -1, dtype=np.int32)
    K.sample(x, seed=seed, offset=offsets, temperature=temperature, top_k=top_k, top_p=top_p, out=out)
    got = out.get()
    assert offsets.get().tolist() == (start + 1).tolist()
    for b in range(B):
        u = ref.sample_uniform(seed, int(start[b]), b)
        probs = ref.sampling_probs(xh[b], temperature, top_k, top_p)
        assert probs[got[b]] > 0, f"row {b}: token {got[b]} is outside the kept set"
        cdf = np.cumsum(probs)
        lo = cdf[got[b]] - probs[got[b]]
        # the kernel's fixed-point masses and float32 exp differ from float64 by ~1e-6
        assert lo - 1e-5 <= u <= cdf[got[b]] + 1e-5, f"row {b}: u={u} outside [{lo}, {cdf[got[b]]}]"
        if lo + 1e-5 < u < cdf[got[b]] - 1e-5:
            assert got[b] == ref.sample(xh[b], u, temperature, top_k, top_p)


def test_sample_distribution_and_determinism():
    """Over many draws the frequencies follow the reference distribution; a seed repeats."""
    rng = np.random.default_rng(3)
    V, N = 20, 4096
    logits_h = rng.standard_normal(V).astype(np.float32) * 0.7
    x = cp.asarray(np.tile(logits_h, (N, 1)))
    out = K.sample(x, seed=99, offset=0, temperature=0.8, top_k=12, top_p=0.9)
    counts = np.bincount(out.get(), minlength=V) / N
    probs = ref.sampling_probs(logits_h, 0.8, 12, 0.9)
    assert (probs > 0).sum() >= 6, "the test needs a distribution with several tokens kept"
    assert (counts[probs == 0] == 0).all()
    assert np.abs(counts - probs).max() < 0.03
    again = K.sample(x, seed=99, offset=0, temperature=0.8, top_k=12, top_p=0.9)
    assert cp.array_equal(out, again)
    other = K.sample(x, seed=100, offset=0, temperature=0.8, top_k=12, top_p=0.9)
    assert not cp.array_equal(out, other)


@pytest.mark.parametrize("words_a,words_b", [(1, None), (1001, 7), (3, 40000), (0, 5)])
@pytest.mark.parametrize("blocks,threads", [(1, 32), (5, 256), (264, 1024)])
def test_read_floor_reads_every_word_once(words_a, words_b, blocks, threads):
    rng = np.random.default_rng(words_a + blocks)
    a = rng.integers(0, 2**32, 4 * words_a, dtype=np.uint32)
    b = None if words_b is None else rng.integers(0, 2**32, 4 * words_b, dtype=np.uint32)
    out = cp.full(blocks, 0xDEADBEEF, np.uint32)  # poisoned: every block writes its word
    K.read_floor(cp.asarray(a), None if b is None else cp.asarray(b).view(np.float16), blocks=blocks,
                 threads=threads, out=out)
    want = np.bitwise_xor.reduce(np.concatenate([a] + ([] if b is None else [b])), initial=np.uint32(0))
    assert np.bitwise_xor.reduce(out.get(), initial=np.uint32(0)) == want
    assert (out.get() != 0xDEADBEEF).all()


@pytest.mark.parametrize("loads", [4, 8])
@pytest.mark.parametrize("words,blocks,threads,hops", [(1, 1, 32, 0), (40001, 7, 96, 5), (3, 264, 1024, 37)])
def test_read_under_load_reads_every_word_and_follows_the_chase(words, blocks, threads, loads, hops):
    rng = np.random.default_rng(words + blocks + loads)
    a = rng.integers(0, 2**32, 4 * words, dtype=np.uint32)
    chase = rng.permutation(1000).astype(np.uint32)
    out = cp.full(blocks, 0xDEADBEEF, np.uint32)
    lat = cp.full(2, 2**64 - 1, np.uint64)  # poisoned
    K.read_under_load(cp.asarray(a), cp.asarray(chase), blocks=blocks, threads=threads, loads=loads, hops=hops,
                      delay_ns=1000, out=out, lat=lat)
    assert np.bitwise_xor.reduce(out.get(), initial=np.uint32(0)) == np.bitwise_xor.reduce(a, initial=np.uint32(0))
    assert (out.get() != 0xDEADBEEF).all()
    j = 0
    for _ in range(hops):
        j = int(chase[j])
    ns, end = lat.get()
    assert end == j
    assert (ns > 0) == (hops > 0) and ns < 10**7


def test_read_under_load_bad_inputs_raise():
    a, chase = cp.zeros(64, np.uint8), cp.zeros(4, np.uint32)
    with pytest.raises(ValueError, match="chase"):
        K.read_under_load(a, chase.astype(np.int32), blocks=1)
    with pytest.raises(ValueError, match="chase"):
        K.read_under_load(a, chase[:0], blocks=1)
    with pytest.raises(ValueError, match="loads"):
        K.read_under_load(a, chase, blocks=1, loads=5)
    with pytest.raises(ValueError, match="hops"):
        K.read_under_load(a, chase, blocks=1, hops=-1)
    with pytest.raises(ValueError, match="delay_ns"):
        K.read_under_load(a, chase, blocks=1, delay_ns=-5)
    with pytest.raises(ValueError, match="blocks"):
        K.read_under_load(a, chase, blocks=0)
    with pytest.raises(ValueError, match="16-byte"):
        K.read_under_load(a[4:], chase, blocks=1)


def test_read_floor_bad_inputs_raise():
    x = cp.zeros(12, np.uint8)
    with pytest.raises(ValueError, match="16-byte"):
        K.read_floor(x, blocks=1)
    with pytest.raises(ValueError, match="16-byte"):
        K.read_floor(cp.zeros(20, np.uint8)[4:], blocks=1)
    with pytest.raises(ValueError, match="threads"):
        K.read_floor(cp.zeros(16, np.uint8), blocks=1, threads=48)
    with pytest.raises(ValueError, match="blocks"):
        K.read_floor(cp.zeros(16, np.uint8), blocks=0)


def test_dlpack_inputs_from_torch():
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 768, device="cuda")
    w = torch.randn(768, device="cuda")
    b = torch.randn(768, device="cuda")
    out = K.layernorm(x, w, b)
    assert isinstance(out, cp.ndarray)
    expect = torch.nn.functional.layer_norm(x.double(), (768,), w.double(), b.double())
    check(out, expect.cpu().numpy(), np.float32)


def test_bad_inputs_raise_before_launch():
    x = cp.ones((4, 768), dtype=np.float32)
    w = cp.ones(768, dtype=np.float32)
    with pytest.raises(TypeError, match="weight"):
        K.layernorm(x, w.astype(np.float16), w)
    with pytest.raises(ValueError, match="weight"):
        K.layernorm(x, w[:700], w)
    with pytest.raises(ValueError, match="C-contiguous"):
        K.layernorm(x.T, w[:4], w[:4])
    with pytest.raises(TypeError, match="x"):
        K.layernorm(x.astype(np.int32), w, w)
    with pytest.raises(ValueError, match="head_dim"):
        q = cp.ones((1, 4, 2, 32), dtype=np.float32)
        K.causal_attention(q, q, q)
    with pytest.raises(TypeError, match="ids"):
        K.embedding(cp.zeros(3, dtype=np.int64), cp.ones((10, 8), np.float32), cp.ones((10, 8), np.float32),
                    cp.zeros(3, dtype=np.int32))
    ids, half = cp.zeros(3, dtype=np.int32), cp.ones((10, 16), np.float16)
    with pytest.raises(TypeError, match="stats_out"):  # float32 rows
        K.embedding(ids, cp.ones((10, 16), np.float32), cp.ones((10, 16), np.float32), ids,
                    stats_out=cp.zeros((3, 1, 2), np.float32))
    with pytest.raises(ValueError, match="stats_out"):  # sets of 16 columns: [3, 1, 2]
        K.embedding(ids, half, half, ids, stats_out=cp.zeros((3, 2, 2), np.float32))
    with pytest.raises(TypeError, match="stats_out"):
        K.embedding(ids, half, half, ids, stats_out=cp.zeros((3, 1, 2), np.float16))
    with pytest.raises(ValueError, match="temperature"):
        K.sample(x, seed=1, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        K.sample(x, seed=1, top_p=1.5)
    with pytest.raises(ValueError, match="out"):
        K.bias_gelu(x, w, out=cp.empty((4, 767), np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_row_kernels_with_differently_aligned_arrays(dtype):
    """x starts 1 element past an allocation, out does not: rows of the two arrays are
    aligned differently, so the kernels must fall back to element-wide loads."""
    rng = np.random.default_rng(9)
    rows, cols = 37, 1024
    base, baseh = rand(rng, (rows * cols + 1,), dtype)
    x, xh = base[1:].reshape(rows, cols), baseh[1:].reshape(rows, cols)
    w, wh = rand(rng, (cols,), dtype)
    b, bh = rand(rng, (cols,), dtype)
    out = poisoned((rows, cols), dtype)
    K.layernorm(x, w, b, out=out)
    check(out, ref.layernorm(xh, wh, bh), dtype)
    out = poisoned((rows, cols), dtype)
    K.softmax(x, scale=0.3, out=out)
    check(out, ref.softmax(xh, scale=0.3), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_with_unaligned_layernorm_parameters(dtype):
    """LayerNorm parameters that start 1 element past an allocation: the product must not
    read them as 16-byte vectors (element-wise path), and still computes the same numbers."""
    rng = np.random.default_rng(13)
    B, N, K_ = 3, 300, 768
    x, xh = rand(rng, (B, K_), dtype)
    w, wh = rand(rng, (N, K_), dtype, 1.0 / np.sqrt(K_))
    base, baseh = rand(rng, (2 * K_ + 1,), dtype)
    lw, lb = base[1:K_ + 1], base[K_ + 1:]
    expect = ref.linear(ref.layernorm(xh, baseh[1:K_ + 1], baseh[K_ + 1:], 1e-5), wh)
    out = poisoned((B, N), dtype)
    K.linear(x, w, ln=(lw, lb, 1e-5), out=out)
    check(out, expect, dtype)
    logits = poisoned((B, N), np.float32)
    tokens = K.linear_argmax(x, w, ln=(lw, lb, 1e-5), logits=logits)
    check(logits, expect, dtype)
    assert tokens.get().tolist() == np.argmax(logits.get(), axis=1).tolist()
