"""flash_attention on the GPU against the float64 reference, held to FlashAttention's rule:
its error is at most twice the error of a naive attention in the same storage precision
(plus a small absolute slack): float16 and bfloat16 on 16-bit tensor cores, float32 in
3xTF32. Inputs are strided views of fused buffers, outputs are poisoned (NaN) before each
launch, lengths are ragged and Tq may differ from Tk."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled")]

cp = pytest.importorskip("cupy")
import cupy_kernels as K  # noqa: E402
from cupy_kernels import _build  # noqa: E402
from cupy_kernels import reference as ref  # noqa: E402
from gpu_util import poisoned  # noqa: E402

DTYPES = [np.float32, np.float16, _build.BFLOAT16]
LENGTHS = (1, 7, 63, 65, 1023, 1025)
# (Tq, Tk): equal lengths, a prompt after a cached prefix (Tq < Tk), and Tq > Tk, where
# the first Tq - Tk queries of causal attention see no key
TQ_TK = [(t, t) for t in LENGTHS] + [(1, 1025), (7, 63), (65, 1023), (63, 1025), (1023, 65), (65, 7), (7, 1)]
# absolute, for cases where the naive error is tiny (outputs are O(1))
SLACK = {np.dtype(np.float32): 1e-6, np.dtype(np.float16): 1e-3, _build.BFLOAT16: 1e-3}


def fused(rng, B, T, H, D, dtype, scale=1.0):
    """A [B, T, 3, H, D] buffer of values already rounded to dtype: (its three strided
    [B, T, H, D] views, their float64 host copies in [B, H, T, D] order)."""
    host = (rng.standard_normal((B, T, 3, H, D)) * scale).astype(np.float32)
    dev = cp.asarray(host).astype(dtype)
    back = dev.astype(cp.float32).get().astype(np.float64)
    return [dev[:, :, j] for j in range(3)], [back[:, :, j].transpose(0, 2, 1, 3) for j in range(3)]


def naive(q, k, v, causal: bool, scale: float):
    """Attention the plain way in the storage precision. 16-bit: S = q k^T rounded to the
    dtype, softmax in float32, P rounded to the dtype, O = P v rounded to the dtype (the
    products accumulated in float64). float32: float32 matrix products (cuBLAS SGEMM) and
    softmax. q [B, Tq, H, D], k, v [B, Tk, H, D]."""
    dtype = q.dtype
    acc = cp.float32 if dtype == np.float32 else cp.float64
    qf, kf, vf = (cp.ascontiguousarray(a.astype(acc).transpose(0, 2, 1, 3)) for a in (q, k, v))  # [B, H, T, D]
    s = (qf @ kf.swapaxes(-1, -2)).astype(dtype).astype(cp.float32) * np.float32(scale)  # [B, H, Tq, Tk]
    Tq, Tk = s.shape[-2:]
    if causal:
        visible = cp.arange(Tk)[None, :] <= cp.arange(Tq)[:, None] + (Tk - Tq)
        s = cp.where(visible, s, np.float32(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    m = cp.where(cp.isfinite(m), m, np.float32(0))  # rows without a visible key
    e = cp.exp(s - m)
    den = e.sum(axis=-1, keepdims=True)
    p = (e / cp.where(den > 0, den, np.float32(1))).astype(dtype).astype(acc)
    return (p @ vf).astype(dtype).transpose(0, 2, 1, 3)  # [B, Tq, H, D]


def check(out, q, k, v, expect, causal, scale):
    """expect: float64 [B, H, Tq, D]. Ours within 2x the naive error (+ SLACK) of expect."""
    expect = expect.transpose(0, 2, 1, 3)
    got = out.astype(cp.float32).get().astype(np.float64)
    assert np.isfinite(got).all(), "unwritten (poisoned) or non-finite outputs"
    err = np.abs(got - expect).max()
    naive_err = np.abs(naive(q, k, v, causal, scale).astype(cp.float32).get() - expect).max()
    assert err <= 2 * naive_err + SLACK[q.dtype], f"error {err:.3g}, naive same-precision error {naive_err:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("Tq,Tk", TQ_TK)
def test_flash_attention(Tq, Tk, causal, D, dtype):
    """q from one fused qkv buffer, k and v from another: every input is a strided view."""
    B, H = 2, 3
    rng = np.random.default_rng(Tq * 7919 + Tk * 31 + D + causal)
    (q, _, _), (qh, _, _) = fused(rng, B, Tq, H, D, dtype)
    (_, k, v), (_, kh, vh) = fused(rng, B, Tk, H, D, dtype)
    out = poisoned((B, Tq, H, D), dtype)
    assert K.flash_attention(q, k, v, causal=causal, out=out) is out
    scale = 1 / math.sqrt(D)
    check(out, q, k, v, ref.attention(qh, kh, vh, causal, scale), causal, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128])
def test_flash_attention_rising_scores(D, dtype):
    """Keys grow along the sequence, so later key tiles raise each row's running max and
    the output accumulated so far must be rescaled; a custom scale and a new output array."""
    B, H, T = 1, 2, 300
    rng = np.random.default_rng(D)
    (q, k, v), (qh, kh, vh) = fused(rng, B, T, H, D, dtype)
    growth = cp.linspace(0.2, 3.0, T, dtype=cp.float32)[None, :, None, None]
    k = (k.astype(cp.float32) * growth).astype(dtype)
    kh = k.astype(cp.float32).get().astype(np.float64).transpose(0, 2, 1, 3)
    for causal in (False, True):
        out = K.flash_attention(q, k, v, causal=causal, scale=0.2)
        assert out.shape == (B, T, H, D) and out.dtype == q.dtype and out.flags.c_contiguous
        check(out, q, k, v, ref.attention(qh, kh, vh, causal, 0.2), causal, 0.2)


def test_flash_attention_float32_keeps_float32_accuracy():
    """The 3xTF32 split matters: the error stays at float32 level, far below one tf32
    product's 2^-11 relative."""
    B, H, T, D = 1, 2, 257, 64
    rng = np.random.default_rng(5)
    (q, k, v), (qh, kh, vh) = fused(rng, B, T, H, D, np.float32, scale=2.0)
    out = K.flash_attention(q, k, v, causal=True)
    expect = ref.attention(qh, kh, vh, True, 1 / math.sqrt(D)).transpose(0, 2, 1, 3)
    assert np.abs(out.get() - expect).max() < 1e-5


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_without_keys_gives_zeros(causal, dtype):
    q = cp.ones((1, 5, 2, 64), dtype)
    empty = cp.ones((1, 0, 2, 64), dtype)
    out = poisoned(q.shape, dtype)
    K.flash_attention(q, empty, empty, causal=causal, out=out)
    assert (out == 0).all()


def test_flash_attention_bad_inputs_raise_before_launch():
    q = cp.ones((1, 8, 2, 64), np.float16)
    with pytest.raises(TypeError, match="q has dtype float64"):
        K.flash_attention(q.astype(np.float64), q.astype(np.float64), q.astype(np.float64))
    with pytest.raises(TypeError, match="k has dtype"):
        K.flash_attention(q, q.astype(_build.BFLOAT16), q)
    with pytest.raises(ValueError, match="head_dim"):
        q32 = cp.ones((1, 8, 2, 32), np.float16)
        K.flash_attention(q32, q32, q32)
    with pytest.raises(ValueError, match="v must have shape"):
        K.flash_attention(q, q, q[:, :7])
    with pytest.raises(ValueError, match="k must have shape"):
        K.flash_attention(q, cp.ones((1, 8, 3, 64), np.float16), q)
    with pytest.raises(ValueError, match="unit stride along head_dim"):
        t = cp.ones((1, 8, 2, 128), np.float16)[..., ::2]
        K.flash_attention(t, t, t)
    with pytest.raises(ValueError, match="16-byte boundary"):
        base = cp.ones((1, 8, 3 * 2 * 64 + 1), np.float16)
        qkv = base[:, :, 1:].reshape(1, 8, 3, 2, 64)
        K.flash_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
    with pytest.raises(ValueError, match="time stride"):  # the kernel's row stride is a 32-bit byte count
        huge = cp.lib.stride_tricks.as_strided(q, shape=(1, 2, 2, 64), strides=(2**32, 2**31, 128, 2))
        K.flash_attention(huge, huge, huge)
    with pytest.raises(ValueError, match="scale"):
        K.flash_attention(q, q, q, scale=0.0)
    with pytest.raises(ValueError, match="out"):
        K.flash_attention(q, q, q, out=cp.empty((1, 8, 2, 63), np.float16))
    q32 = cp.ones((1, 8, 2, 64), np.float32)
    with pytest.raises(ValueError, match="8-byte boundary"):  # float32 pairs are stored as 8 bytes
        K.flash_attention(q32, q32, q32, out=cp.empty(q32.size + 1, np.float32)[1:].reshape(q32.shape))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("D", [64, 128])
def test_flash_attention_varlen_packed_sequences(D, dtype):
    """cu_seqlens: ragged prompts (an empty one among them) packed along time in one fused
    buffer, each attending causally to its own keys only: every sequence within the error
    rule of the reference run on it alone, and with the bits flash_attention gives it alone."""
    lens = [1, 7, 0, 130, 65, 64, 300, 129]
    T, H = sum(lens), 3
    rng = np.random.default_rng(D + len(lens))
    (q, k, v), (qh, kh, vh) = fused(rng, 1, T, H, D, dtype)
    cu = np.concatenate([[0], np.cumsum(lens)])
    out = poisoned((1, T, H, D), dtype)
    assert K.flash_attention(q, k, v, causal=True, cu_seqlens=cp.asarray(cu, dtype=cp.int32), out=out) is out
    scale = 1 / math.sqrt(D)
    for a, b in zip(cu[:-1], cu[1:]):
        if a == b:
            continue
        seq = out[:, a:b]
        check(seq, q[:, a:b], k[:, a:b], v[:, a:b], ref.attention(qh[:, :, a:b], kh[:, :, a:b], vh[:, :, a:b], True,
                                                                  scale), True, scale)
        assert cp.array_equal(seq, K.flash_attention(q[:, a:b], k[:, a:b], v[:, a:b], causal=True))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flash_attention_varlen_max_seqlen_padded(dtype):
    """cu_seqlens on the GPU with max_seqlen (no host check): padded rows past the last offset,
    empty sequences after it and max_seqlen above the longest sequence give every sequence the
    bits of the checked call, and leave the padded rows as they were."""
    lens, pad, D, H = [5, 0, 70, 33], 27, 64, 2
    T = sum(lens) + pad
    rng = np.random.default_rng(31)
    (q, k, v), _ = fused(rng, 1, T, H, D, dtype)
    cu = np.concatenate([[0], np.cumsum(lens)])
    checked = K.flash_attention(q[:, :T - pad], k[:, :T - pad], v[:, :T - pad], causal=True, cu_seqlens=cu)
    out = poisoned((1, T, H, D), dtype)
    cu_dev = cp.asarray(np.concatenate([cu, [cu[-1]] * 3]), dtype=cp.int32)  # three empty sequences after them
    assert K.flash_attention(q, k, v, cu_seqlens=cu_dev, max_seqlen=96, out=out) is out
    assert cp.array_equal(out[:, :T - pad], checked)
    assert bool(cp.isnan(out[:, T - pad:].astype(cp.float32)).all())  # (poisoned: not written)


def test_flash_attention_varlen_max_seqlen_checks():
    q = cp.ones((1, 8, 2, 64), np.float16)
    cu = cp.asarray([0, 8], dtype=cp.int32)
    with pytest.raises(TypeError, match="int32 array on the GPU"):
        K.flash_attention(q, q, q, cu_seqlens=[0, 8], max_seqlen=8)
    with pytest.raises(TypeError, match="int32 array on the GPU"):
        K.flash_attention(q, q, q, cu_seqlens=cu.astype(cp.int64), max_seqlen=8)
    for bad in (9, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_seqlen must be an int"):
            K.flash_attention(q, q, q, cu_seqlens=cu, max_seqlen=bad)
    with pytest.raises(ValueError, match="max_seqlen goes with cu_seqlens"):
        K.flash_attention(q, q, q, max_seqlen=8)
    with pytest.raises(ValueError, match="n \\+ 1 >= 2"):
        K.flash_attention(q, q, q, cu_seqlens=cu[:1], max_seqlen=8)


def test_flash_attention_varlen_bad_offsets_raise():
    q = cp.ones((1, 8, 2, 64), np.float16)
    for cu, match in (([0, 3, 9], "rise from 0 to T"), ([1, 8], "rise from 0"), ([0, 5, 3, 8], "without falling"),
                      ([8], "n \\+ 1 >= 2"), (np.array([0.0, 8.0]), "integer")):
        with pytest.raises(ValueError, match=match):
            K.flash_attention(q, q, q, cu_seqlens=cu)
    with pytest.raises(ValueError, match="causal"):
        K.flash_attention(q, q, q, causal=False, cu_seqlens=[0, 8])
    with pytest.raises(ValueError, match="\\[1, T, H, D\\]"):
        q2 = cp.ones((2, 8, 2, 64), np.float16)
        K.flash_attention(q2, q2, q2, cu_seqlens=[0, 8])
