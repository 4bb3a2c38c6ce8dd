"""fixed_attention (the decode step's attention for caches of the model's dtype) against float64
numpy, on the GPU: lengths 1, 15, 16, 17, 333 and the full 1,024 rows mixed in one batch; the
same bits for every block width, with and without the rows requested before the wait
(positions), for a sequence alone and in a batch, and for q as a strided view of q|k|v rows;
float32 values from 1e-30 to 1e30, whose fixed point follows them. Cache rows past each length
and the outputs are poisoned (NaN) before the launch."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled")]

cp = pytest.importorskip("cupy")
import cupy_kernels as K  # noqa: E402
from cupy_kernels import reference as ref  # noqa: E402
from cupy_kernels.fixed_attention import THREADS  # noqa: E402
from gpu_util import DTYPES, check, poisoned, rand  # noqa: E402


def make(rng, lens, H, S, dtype, scale=2.0):
    """q [B, H, 64], caches [B, H, S, 64] with rows >= lens[b] poisoned, their float64 values."""
    B = len(lens)
    q, qh = rand(rng, (B, H, 64), dtype, scale)
    k, kh = rand(rng, (B, H, S, 64), dtype)
    v, vh = rand(rng, (B, H, S, 64), dtype)
    for b, n in enumerate(lens):
        k[b, :, n:] = poisoned(k[b, :, n:].shape, dtype)
        v[b, :, n:] = poisoned(v[b, :, n:].shape, dtype)
    return q, k, v, qh, kh, vh


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H,S,lens", [(12, 1024, [1, 17, 1024, 333]), (25, 40, [16, 15, 40, 7, 9, 8]), (3, 1, [1])])
def test_fixed_attention_matches_float64_with_the_same_bits_at_every_width(dtype, H, S, lens):
    rng = np.random.default_rng(len(lens) * H + S)
    q, k, v, qh, kh, vh = make(rng, lens, H, S, dtype)
    seq = cp.asarray(np.array(lens, np.int32))
    expect = ref.decode_attention(qh, kh, vh, lens)
    outs = []
    for threads in THREADS:
        out = poisoned(q.shape, dtype)
        K.fixed_attention(q, k, v, seq, threads=threads, out=out)
        check(out, expect, dtype)
        outs.append(out)
        # the decode step's form: the rows below positions = lens - 1 requested before the wait
        early = poisoned(q.shape, dtype)
        K.fixed_attention(q, k, v, seq, threads=threads, positions=seq - 1, out=early)
        assert cp.array_equal(early, out)
        # ... and letting the next kernel start before its wait (a decode step at batch 1)
        early = poisoned(q.shape, dtype)
        K.fixed_attention(q, k, v, seq, threads=threads, positions=seq - 1, trigger_early=True, out=early)
        assert cp.array_equal(early, out)
    for out in outs[1:]:
        assert cp.array_equal(out, outs[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fixed_attention_a_sequence_alone_equals_it_in_a_batch(dtype):
    rng = np.random.default_rng(5)
    lens = [7, 300, 64, 1, 999]
    q, k, v, *_ = make(rng, lens, 12, 1024, dtype)
    seq = cp.asarray(np.array(lens, np.int32))
    batch = K.fixed_attention(q, k, v, seq, threads=128)
    for b in range(len(lens)):
        for threads in THREADS:
            alone = K.fixed_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], seq[b:b + 1], threads=threads)
            assert cp.array_equal(alone[0], batch[b]), (b, threads)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=str)
def test_fixed_attention_q_from_qkv_rows(dtype):
    """q as the decode step passes it: the first third of each q|k|v row (a batch stride of 3 C)."""
    rng = np.random.default_rng(9)
    lens = [5, 200, 33]
    B, H = len(lens), 12
    _, k, v, *_ = make(rng, lens, H, 256, dtype)
    qkv, _ = rand(rng, (B, 3, H, 64), dtype)
    seq = cp.asarray(np.array(lens, np.int32))
    got = K.fixed_attention(qkv[:, 0], k, v, seq, threads=256)
    want = K.fixed_attention(cp.ascontiguousarray(qkv[:, 0]), k, v, seq, threads=512)
    assert cp.array_equal(got, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=str)
def test_fixed_attention_non_finite_rows_give_nan(dtype):
    """A NaN or infinity in a row a sequence reads makes that (sequence, head) NaN, not a finite
    number (an infinite score as well: softmax over it is NaN in float64 too)."""
    rng = np.random.default_rng(2)
    lens = [50, 50]
    q, k, v, *_ = make(rng, lens, 4, 64, dtype)
    v[1, 2, 30, 5] = np.nan
    k[0, 3, 10, 0] = np.nan
    k[1, 0, 20] = cp.where(q[1, 0] > 0, np.inf, -np.inf)  # a score of +inf
    out = K.fixed_attention(q, k, v, cp.asarray(np.array(lens, np.int32)), threads=128).astype(cp.float32).get()
    bad = np.isnan(out).any(axis=2)
    assert bad[1, 2] and bad[0, 3] and bad[1, 0]
    bad[1, 2] = bad[0, 3] = bad[1, 0] = False
    assert not bad.any() and np.isfinite(out[~np.isnan(out).any(axis=2)]).all()


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1e4, 1e30], ids=lambda s: f"{s:g}")
def test_fixed_attention_float32_values_of_any_size(scale):
    """float32 values far from 1: the fixed point follows the tiles' sums, so tiny values keep
    their digits and huge ones do not overflow its integers; the same bits at every width.
    (One sequence's values scaled by 1e-6 against another's: each takes its own point.)"""
    rng = np.random.default_rng(int(np.log10(scale)) + 40)
    lens = [1, 9, 333, 1024]
    q, k, v, qh, kh, _ = make(rng, lens, 6, 1024, np.float32, scale=0.5)
    v *= np.float32(scale)
    v[1] *= np.float32(1e-6)
    seq = cp.asarray(np.array(lens, np.int32))
    expect = ref.decode_attention(qh, kh, v.get().astype(np.float64), lens)
    outs = []
    for threads in THREADS:
        out = poisoned(q.shape, np.float32)
        K.fixed_attention(q, k, v, seq, threads=threads, out=out)
        for b in range(len(lens)):  # each sequence against its own magnitude
            check(out[b], expect[b], np.float32)
        outs.append(out)
    for out in outs[1:]:
        assert cp.array_equal(out, outs[0])


def test_fixed_attention_bad_inputs_raise():
    q = cp.zeros((2, 4, 64), np.float16)
    kc = cp.zeros((2, 4, 16, 64), np.float16)
    seq = cp.ones(2, np.int32)
    with pytest.raises(TypeError, match="supported"):
        K.fixed_attention(q.astype(np.float64), kc, kc, seq)
    with pytest.raises(TypeError, match="k_cache must be float32 like q"):
        K.fixed_attention(q.astype(np.float32), kc, kc, seq)
    with pytest.raises(ValueError, match=r"\[B, H, 64\]"):
        K.fixed_attention(cp.zeros((2, 4, 32), np.float16), kc, kc, seq)
    with pytest.raises(TypeError, match="k_cache must be"):
        K.fixed_attention(q, kc.astype(np.float32), kc, seq)
    with pytest.raises(ValueError, match="v_cache must have shape"):
        K.fixed_attention(q, kc, cp.zeros((2, 3, 16, 64), np.float16), seq)
    with pytest.raises(ValueError, match="differ"):
        K.fixed_attention(q, kc, cp.zeros((2, 4, 8, 64), np.float16), seq)
    big = cp.zeros((1, 1, 1025, 64), np.float16)
    with pytest.raises(ValueError, match="1 to 1024 rows"):
        K.fixed_attention(q[:1, :1], big, big, seq[:1])
    with pytest.raises(TypeError, match="seq_lens must be int32"):
        K.fixed_attention(q, kc, kc, seq.astype(np.int64))
    with pytest.raises(ValueError, match="seq_lens"):
        K.fixed_attention(q, kc, kc, cp.ones(3, np.int32))
    with pytest.raises(ValueError, match="positions"):
        K.fixed_attention(q, kc, kc, seq, positions=cp.ones(1, np.int32))
    with pytest.raises(TypeError, match="trigger_early must be a bool"):
        K.fixed_attention(q, kc, kc, seq, trigger_early=1)
    with pytest.raises(ValueError, match="threads must be one of"):
        K.fixed_attention(q, kc, kc, seq, threads=64)
    with pytest.raises(ValueError, match="out"):
        K.fixed_attention(q, kc, kc, seq, out=cp.zeros((2, 4, 32), np.float16))
    with pytest.raises(ValueError, match="C-contiguous"):
        K.fixed_attention(q, kc[:, :, ::2], kc[:, :, ::2], seq)
