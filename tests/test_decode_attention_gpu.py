"""Decoding attention and the quantized KV-cache append against float64 numpy, on the GPU:
MHA, GQA and MQA, ALiBi, caches in the model's dtype, int8 and fp8 e4m3, one split and
several, lengths 1, 7, 1000 and 4097 mixed in one batch. Cache rows past each sequence's
length and the outputs are poisoned (NaN) before the launch."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("compiled")]

cp = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")
import cupy_kernels as K  # noqa: E402
from cupy_kernels import reference as ref  # noqa: E402
from cupy_kernels.decode_attention import _COUNTERS  # noqa: E402
from gpu_util import DTYPES, check, poisoned, rand  # noqa: E402

KV = {"plain": None, "int8": "int8", "fp8": "float8_e4m3"}


def codes_to_host(cache, kv):
    """A quantized cache's codes as float64 values (int8 values, or e4m3 values)."""
    host = cache.get()
    if kv == "float8_e4m3":
        return host.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return host.astype(np.float64)


def build_cache(rng, B, H_kv, S, D, lens, dtype, kv):
    """A cache of S rows per (sequence, KV head), written by kv_append from random rows.
    Returns the GPU arrays as decode_attention's keyword arguments and the float64 values
    the kernel should see (dequantized for int8 / fp8). Rows >= lens[b] are poisoned."""
    k, kh = rand(rng, (B, S, H_kv, D), dtype, 2.0)
    v, vh = rand(rng, (B, S, H_kv, D), dtype)
    storage = K.kv_storage_dtype(kv, dtype)
    kc = cp.zeros((B, H_kv, S, D), dtype=storage)
    vc = cp.zeros((B, H_kv, S, D), dtype=storage)
    scales = {}
    if kv is not None:
        scales = {"k_scale": cp.empty((B, H_kv, S), np.float32), "v_scale": cp.empty((B, H_kv, S), np.float32)}
    K.kv_append(kc, vc, k, v, cp.zeros(B, dtype=np.int32), **scales)
    if kv is None:
        k_host, v_host = kh.transpose(0, 2, 1, 3), vh.transpose(0, 2, 1, 3)
    else:
        k_host = ref.dequantize_kv(codes_to_host(kc, kv), scales["k_scale"])
        v_host = ref.dequantize_kv(codes_to_host(vc, kv), scales["v_scale"])
    for b, n in enumerate(lens):  # a read past a sequence's length turns the output into NaN
        for a in (kc, vc) if kv is None else (scales["k_scale"], scales["v_scale"]):
            a[b, :, n:] = poisoned(a[b, :, n:].shape, a.dtype)
    return {"k_cache": kc, "v_cache": vc, **scales}, k_host, v_host


CASES = [  # H, H_kv, D, lens, alibi
    (12, 12, 64, [1], False),
    (12, 12, 64, [7, 1000, 1, 4097], True),
    (8, 2, 128, [4097, 33], False),  # GQA, 4 query heads per KV head and per block (B x S_max >= 8192)
    (8, 2, 64, [16381, 5], False),  # the same with hd64
    (6, 3, 64, [1000, 7], True),  # GQA, 2 per KV head (one per block: a short batch)
    (5, 1, 128, [1, 1000], False),  # MQA, 5 query heads
    (32, 1, 64, [4097], True),  # MQA, 32 query heads (8 blocks share each KV row)
]


# 100 splits: more than a warp's lanes and not a multiple of the merge's loads in flight
@pytest.mark.parametrize("splits,merge", [(None, "last-block"), (1, "last-block"), (7, "last-block"), (7, "kernel"),
                                          (100, "last-block"), (100, "kernel")])
@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H,H_kv,D,lens,alibi", CASES)
def test_decode_attention(H, H_kv, D, lens, alibi, dtype, kv, splits, merge):
    rng = np.random.default_rng(H * 1000 + sum(lens) + D)
    B, S = len(lens), max(lens) + 3
    cache, k_host, v_host = build_cache(rng, B, H_kv, S, D, lens, dtype, KV[kv])
    q_rows, q_rowsh = rand(rng, (B, 3, H, D), dtype)  # q is the first third of a qkv row
    slopes = None
    if alibi:
        slopes = (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)
    seq = cp.asarray(np.array(lens, dtype=np.int32))
    out = poisoned((B, H, D), dtype)
    K.decode_attention(q_rows[:, 0], seq_lens=seq, alibi_slopes=None if slopes is None else cp.asarray(slopes),
                       num_splits=splits, merge=merge, out=out, **cache)
    check(out, ref.decode_attention(q_rowsh[:, 0], k_host, v_host, lens, alibi_slopes=slopes), dtype)
    for counters in _COUNTERS.values():  # the last-block merge leaves its counters zeroed
        assert not counters.any()


# chunks shorter than a loop trip, of one trip and a half, and longer than most sequences
@pytest.mark.parametrize("split_keys", [40, 96, 1000])
@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H,H_kv,D,lens,alibi", CASES)
def test_decode_attention_split_keys(H, H_kv, D, lens, alibi, dtype, kv, split_keys):
    """Equal chunks of at most split_keys keys: each sequence as many as its own length needs
    (one: written by its block; more: merged by the last); with the block width fixed, a
    sequence's bits alone are its bits in the batch (as the decode step fixes it)."""
    rng = np.random.default_rng(H * 1000 + sum(lens) + D + split_keys)
    B, S = len(lens), max(lens) + 3
    if S > 128 * split_keys:
        pytest.skip("more than 128 chunks")
    cache, k_host, v_host = build_cache(rng, B, H_kv, S, D, lens, dtype, KV[kv])
    q_rows, q_rowsh = rand(rng, (B, 3, H, D), dtype)
    slopes = None
    if alibi:
        slopes = cp.asarray((2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32))
    seq = cp.asarray(np.array(lens, dtype=np.int32))
    out = poisoned((B, H, D), dtype)
    K.decode_attention(q_rows[:, 0], seq_lens=seq, alibi_slopes=slopes, split_keys=split_keys, out=out, **cache)
    check(out, ref.decode_attention(q_rowsh[:, 0], k_host, v_host, lens,
                                    alibi_slopes=None if slopes is None else slopes.get()), dtype)
    for counters in _COUNTERS.values():  # the merge leaves its counters zeroed
        assert not counters.any()
    if H_kv != H:  # (grouped heads: the heads a block takes follow the batch's rows)
        return
    # a sequence alone (its own cache rows only) gets its bits in the batch, for a fixed block width
    batch = K.decode_attention(q_rows[:, 0], seq_lens=seq, alibi_slopes=slopes, split_keys=split_keys, threads=128,
                               **cache)
    check(batch, ref.decode_attention(q_rowsh[:, 0], k_host, v_host, lens,
                                      alibi_slopes=None if slopes is None else slopes.get()), dtype)
    for b in range(B):
        alone = poisoned((1, H, D), dtype)
        one = {name: a[b : b + 1] for name, a in cache.items()}
        K.decode_attention(q_rows[b : b + 1, 0], seq_lens=seq[b : b + 1], alibi_slopes=slopes, split_keys=split_keys,
                           threads=128, out=alone, **one)
        assert cp.array_equal(alone.view(cp.uint8), batch[b : b + 1].view(cp.uint8))


@pytest.mark.parametrize("threads", [128, 512])
@pytest.mark.parametrize("split_keys", [None, 40, 1000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H,H_kv,D", [(12, 12, 64), (8, 2, 128), (5, 1, 128)])
def test_decode_attention_appended(H, H_kv, D, dtype, split_keys, threads):
    """The appended rows (k, v beside q, as the decode step's q|k|v product writes them) give
    the bits of the cache's own row len - 1; where that row falls in the first loop trip the
    kernel takes it from there: poisoned in the cache (short sequences), the output is still
    the reference."""
    rng = np.random.default_rng(H * 100 + D + threads + (split_keys or 0))
    lens = [1, 7, 1000, 4097]
    B, S = len(lens), max(lens) + 3
    cache, k_host, v_host = build_cache(rng, B, H_kv, S, D, lens, dtype, None)
    qkv, qkvh = rand(rng, (B, H + 2 * H_kv, D), dtype)  # q | k | v of each sequence, one row
    q, k_new, v_new = qkv[:, :H], qkv[:, H : H + H_kv], qkv[:, H + H_kv :]
    for b, n in enumerate(lens):  # the appended row is the cache's row len - 1
        k_new[b] = cache["k_cache"][b, :, n - 1]
        v_new[b] = cache["v_cache"][b, :, n - 1]
    seq = cp.asarray(np.array(lens, dtype=np.int32))
    args = dict(seq_lens=seq, split_keys=split_keys, threads=threads, **cache)
    plain = K.decode_attention(q, **args)
    out = poisoned((B, H, D), dtype)
    K.decode_attention(q, appended=(k_new, v_new), out=out, **args)
    assert cp.array_equal(out.view(cp.uint8), plain.view(cp.uint8))
    for b, n in enumerate(lens):
        if n <= 8:  # inside the first trip of every block shape: read from the appended row only
            for c in (cache["k_cache"], cache["v_cache"]):
                c[b, :, n - 1] = poisoned(c[b, :, n - 1].shape, c.dtype)
    out = poisoned((B, H, D), dtype)
    K.decode_attention(q, appended=(k_new, v_new), out=out, **args)
    check(out, ref.decode_attention(qkvh[:, :H], k_host, v_host, lens), dtype)


@pytest.mark.parametrize("split_keys", [None, 40, 1000])
@pytest.mark.parametrize("dtype", DTYPES[1:], ids=str)  # 16-bit
@pytest.mark.parametrize("H,D", [(12, 64), (8, 128)])
def test_decode_attention_trips_ahead(H, D, dtype, split_keys):
    """AHEAD_DEEP loop trips requested ahead, the appended rows read beside q or not, give
    the bits of one trip ahead, which match the reference."""
    from cupy_kernels.decode_attention import AHEAD_DEEP

    rng = np.random.default_rng(H * 10 + D + (split_keys or 0))
    lens = [1, 7, 1000, 4097, 130, 64, 320, 321]
    B, S = len(lens), max(lens) + 3
    cache, k_host, v_host = build_cache(rng, B, H, S, D, lens, dtype, None)
    qkv, qkvh = rand(rng, (B, 3 * H, D), dtype)
    q, k_new, v_new = qkv[:, :H], qkv[:, H : 2 * H], qkv[:, 2 * H :]
    for b, n in enumerate(lens):
        k_new[b] = cache["k_cache"][b, :, n - 1]
        v_new[b] = cache["v_cache"][b, :, n - 1]
    args = dict(seq_lens=cp.asarray(np.array(lens, dtype=np.int32)), split_keys=split_keys, threads=128, **cache)
    one = poisoned((B, H, D), dtype)
    K.decode_attention(q, out=one, **args)
    check(one, ref.decode_attention(qkvh[:, :H], k_host, v_host, lens), dtype)
    for appended in (None, (k_new, v_new)):
        out = poisoned((B, H, D), dtype)
        K.decode_attention(q, ahead=AHEAD_DEEP, appended=appended, out=out, **args)
        assert cp.array_equal(out.view(cp.uint8), one.view(cp.uint8)), appended is None


@pytest.mark.parametrize("words", [0, 1, 1000, 163_841])  # 163,841: 2.6 MB and one word, not a multiple of the blocks
@pytest.mark.parametrize("threads,split_keys,ahead", [(128, None, 1), (128, 40, 1), (512, 1000, 1), (128, 40, 4)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_warm_keeps_the_bits(dtype, threads, split_keys, ahead, words):
    """Extra blocks reading a weight into L2 (warm=) leave the output's bits, the merge of split
    chunks (counters) and the warmed array as they were, for one sequence and several."""
    if ahead != 1 and dtype == np.float32:
        pytest.skip("trips ahead take 16-bit caches")
    rng = np.random.default_rng(words + threads + (split_keys or 0))
    H, D = 12, 64
    for lens in ([300], [1, 7, 1000, 130]):
        B, S = len(lens), max(lens) + 3
        cache, k_host, v_host = build_cache(rng, B, H, S, D, lens, dtype, None)
        q, qh = rand(rng, (B, H, D), dtype)
        args = dict(seq_lens=cp.asarray(np.array(lens, dtype=np.int32)), split_keys=split_keys, threads=threads,
                    ahead=ahead, **cache)
        plain = poisoned((B, H, D), dtype)
        K.decode_attention(q, out=plain, **args)
        check(plain, ref.decode_attention(qh, k_host, v_host, lens), dtype)
        weight = cp.asarray(rng.integers(0, 2**31, (words, 4), dtype=np.int64).astype(np.uint32))
        before = weight.copy()
        for blocks in (1, 7, 128):
            out = poisoned((B, H, D), dtype)
            K.decode_attention(q, out=out, warm=weight, warm_blocks=blocks, **args)
            assert cp.array_equal(out.view(cp.uint8), plain.view(cp.uint8)), (lens, blocks)
        assert cp.array_equal(weight, before)
        assert not _COUNTERS or all(int(c.sum()) == 0 for c in _COUNTERS.values())


@pytest.mark.parametrize("kv", ["plain", "int8"])
@pytest.mark.parametrize("threads,split_keys,ahead", [(128, None, 1), (128, 40, 1), (512, 1000, 1), (128, 40, 4)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_prefetch_keeps_the_bits(dtype, threads, split_keys, ahead, kv):
    """The cache rows requested into L2 before the wait (prefetch=, the positions of a decode
    step: each sequence's length - 1) leave the output's bits and the merge's counters as they
    were; so do positions that are not the lengths' (past the cache, negative, zero)."""
    if ahead != 1 and (dtype == np.float32 or kv != "plain"):
        pytest.skip("trips ahead take 16-bit caches in q's dtype")
    if threads == 512 and kv != "plain":
        pytest.skip("512 threads take a cache in q's dtype")
    rng = np.random.default_rng(threads + (split_keys or 0) + ahead)
    H, D = 12, 64
    for lens in ([300], [1, 7, 1000, 130]):
        B, S = len(lens), max(lens) + 3
        cache, k_host, v_host = build_cache(rng, B, H, S, D, lens, dtype, KV[kv])
        q, qh = rand(rng, (B, H, D), dtype)
        args = dict(seq_lens=cp.asarray(np.array(lens, dtype=np.int32)), split_keys=split_keys, threads=threads,
                    ahead=ahead, **cache)
        plain = poisoned((B, H, D), dtype)
        K.decode_attention(q, out=plain, **args)
        if kv == "plain":
            check(plain, ref.decode_attention(qh, k_host, v_host, lens), dtype)
        for positions in (np.array(lens) - 1, np.full(B, S + 100), np.full(B, -5), np.zeros(B)):
            out = poisoned((B, H, D), dtype)
            K.decode_attention(q, out=out, prefetch=cp.asarray(positions.astype(np.int32)), **args)
            assert cp.array_equal(out.view(cp.uint8), plain.view(cp.uint8)), (lens, positions)
        assert not _COUNTERS or all(int(c.sum()) == 0 for c in _COUNTERS.values())


@pytest.mark.parametrize("threads", [128, 512])
@pytest.mark.parametrize("qpb", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_every_block_shape(dtype, qpb, threads, monkeypatch):
    """Each declared (query heads per block, threads) kernel of a cache in the model's dtype,
    whatever launch_config would pick, with one split and several."""
    import importlib

    from cupy_kernels import _build

    mod = importlib.import_module("cupy_kernels.decode_attention")  # the package's name is the function

    def forced(dt, cache_dtype, B, H, H_kv, D, S_max):
        name = mod._name(_build.ctype(dt), _build.ctype(dt), D, qpb, threads)
        return mod.Launch(_build.kernel(mod._SRC, name), H // qpb, 1, threads)

    monkeypatch.setattr(mod, "launch_config", forced)
    rng = np.random.default_rng(qpb * threads)
    H, H_kv, lens = 8, 2, [1500, 33, 1]
    for D in (64, 128):
        cache, k_host, v_host = build_cache(rng, len(lens), H_kv, max(lens) + 5, D, lens, dtype, None)
        q, qh = rand(rng, (len(lens), H, D), dtype)
        want = ref.decode_attention(qh, k_host, v_host, lens)
        for splits in (1, 7):
            out = poisoned((len(lens), H, D), dtype)
            K.decode_attention(q, seq_lens=cp.asarray(np.array(lens, np.int32)), num_splits=splits, out=out, **cache)
            check(out, want, dtype)


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kv", ["int8", "float8_e4m3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_append_quantized(dtype, kv, D):
    """Codes and scales equal numpy's quantization of the same float32 values, bit for bit."""
    rng = np.random.default_rng(D)
    B, T, H, S = 3, 5, 4, 16
    qkv, qkvh = rand(rng, (B, T, 3, H, D), dtype, 3.0)
    qkv[0, 1, 1, 2] = 0  # an all-zero row: scale 0, codes 0
    qkvh[0, 1, 1, 2] = 0
    storage = K.kv_storage_dtype(kv, dtype)
    kc, vc = cp.zeros((4, H, S, D), storage), cp.zeros((4, H, S, D), storage)
    ks, vs = cp.full((4, H, S), np.nan, np.float32), cp.full((4, H, S), np.nan, np.float32)
    start_h = np.array([0, 3, 11], dtype=np.int32)
    slots_h = np.array([2, 0, 3], dtype=np.int32)
    lens = cp.zeros(B, dtype=np.int32)
    K.kv_append(kc, vc, qkv[:, :, 1], qkv[:, :, 2], cp.asarray(start_h), slots=cp.asarray(slots_h), seq_lens=lens,
                k_scale=ks, v_scale=vs)
    assert lens.get().tolist() == (start_h + T).tolist()
    for cache, scale, j in ((kc, ks, 1), (vc, vs, 2)):
        codes, scales = codes_to_host(cache, kv), scale.get()
        for b in range(B):
            rows = slice(start_h[b], start_h[b] + T)
            want_codes, want_scales = ref.quantize_kv(qkvh[b, :, j].transpose(1, 0, 2), kv)  # [H, T, D]
            np.testing.assert_array_equal(codes[slots_h[b], :, rows], want_codes)
            np.testing.assert_array_equal(scales[slots_h[b], :, rows], want_scales)
        assert np.isnan(scales[1]).all() and np.isnan(scales[2, :, T:]).all()  # nothing else written
    # a dequantized value is within half a step (int8), or 2^-4 relative / a subnormal step (fp8)
    got = ref.dequantize_kv(codes_to_host(kc, kv)[2, :, :T], ks.get()[2, :, :T])
    want = qkvh[0, :, 1].transpose(1, 0, 2)
    step = ks.get()[2, :, :T, None]
    bound = step * 0.5001 if kv == "int8" else np.abs(want) * 2.0**-4 * 1.001 + step * 2.0**-9
    assert (np.abs(got - want) <= bound).all()


def test_launch_config_splits_and_heads_per_block():
    from cupy_kernels import _build
    from cupy_kernels.decode_attention import launch_config

    fp16 = np.float16
    sms = _build.sm_count(cp.cuda.Device().id)
    # batches that fill the GPU many times: unsplit; wide blocks for long caches only
    big = launch_config(fp16, fp16, 128, 32, 32, 128, 4096)
    assert (big.splits, big.threads) == (1, 512)
    assert launch_config(fp16, fp16, 128, 32, 32, 128, 128)[2:] == (1, 128)
    assert launch_config(fp16, np.int8, 128, 32, 32, 128, 4096)[2:] == (1, 128)
    long = launch_config(fp16, fp16, 1, 32, 32, 128, 32768)  # one long sequence: split over the SMs
    assert long.threads == 128 and long.splits > 1 and long.blocks * long.splits >= sms
    short = launch_config(fp16, fp16, 1, 12, 12, 64, 512)  # two trips of a wide block: no merge
    assert (short.threads, short.splits) == (512, 1)
    assert launch_config(fp16, np.int8, 1, 12, 12, 64, 512).threads == 128  # quantized rows: narrow blocks
    # grouped heads: one query head per block for a short batch, 4 (one read of each K/V row,
    # in wide blocks) for a long one
    assert launch_config(fp16, fp16, 1, 32, 8, 128, 4096).blocks == 32
    gqa = launch_config(fp16, fp16, 1, 32, 8, 128, 32768)
    assert (gqa.blocks, gqa.threads) == (8, 512) and gqa.splits > 1
    assert launch_config(fp16, fp16, 1, 24, 8, 128, 32768).blocks == 24  # 3 per KV head: no 2 or 4 divides

def test_decode_attention_bad_inputs_raise():
    q = cp.zeros((2, 8, 64), np.float16)
    kc = cp.zeros((2, 3, 16, 64), np.float16)
    seq = cp.ones(2, np.int32)
    with pytest.raises(ValueError, match="KV heads must divide"):
        K.decode_attention(q, kc, kc, seq)
    kc = cp.zeros((2, 4, 16, 64), np.int8)
    with pytest.raises(ValueError, match="k_scale"):
        K.decode_attention(q, kc, kc, seq)
    with pytest.raises(TypeError, match="k_cache"):
        K.decode_attention(q, kc.astype(np.int32), kc.astype(np.int32), seq)
    kc = cp.zeros((2, 4, 16, 64), np.float16)
    with pytest.raises(ValueError, match="k_scale"):
        K.decode_attention(q, kc, kc, seq, k_scale=cp.zeros((2, 4, 16), np.float32))
    with pytest.raises(ValueError, match="num_splits"):
        K.decode_attention(q, kc, kc, seq, num_splits=0)
    with pytest.raises(ValueError, match="num_splits"):
        K.decode_attention(q, kc, kc, seq, num_splits=129)
    with pytest.raises(ValueError, match="threads"):
        K.decode_attention(q, kc, kc, seq, threads=256)
    kq = cp.zeros((2, 4, 16, 64), np.int8)
    with pytest.raises(ValueError, match="512 threads"):
        K.decode_attention(q, kq, kq, seq, threads=512, k_scale=cp.ones((2, 4, 16), np.float32),
                           v_scale=cp.ones((2, 4, 16), np.float32))
    with pytest.raises(ValueError, match="merge"):
        K.decode_attention(q, kc, kc, seq, merge="tree")
    with pytest.raises(ValueError, match="split_keys"):
        K.decode_attention(q, kc, kc, seq, split_keys=0)
    with pytest.raises(ValueError, match="num_splits or split_keys"):
        K.decode_attention(q, kc, kc, seq, num_splits=2, split_keys=64)
    with pytest.raises(ValueError, match="last-block"):
        K.decode_attention(q, kc, kc, seq, split_keys=64, merge="kernel")
    with pytest.raises(ValueError, match="alibi_slopes"):
        K.decode_attention(q, kc, kc, seq, alibi_slopes=cp.zeros(4, np.float32))
    rows = cp.zeros((2, 16, 64), np.float16)  # q | k | v, 8 query heads and 4 KV heads
    with pytest.raises(ValueError, match="appended k must have shape"):
        K.decode_attention(rows[:, :8], kc, kc, seq, appended=(rows[:, 8:11], rows[:, 12:15]))
    with pytest.raises(ValueError, match="batch stride"):
        K.decode_attention(rows[:, :8], kc, kc, seq, appended=(cp.zeros((2, 4, 64), np.float16), rows[:, 12:]))
    with pytest.raises(TypeError, match="appended v"):
        K.decode_attention(rows[:, :8], kc, kc, seq, appended=(rows[:, 8:12], rows[:, 12:].astype(np.float32)))
    with pytest.raises(TypeError, match="pair"):
        K.decode_attention(rows[:, :8], kc, kc, seq, appended=rows[:, 8:12])
    with pytest.raises(ValueError, match="appended rows take a cache"):
        K.decode_attention(rows[:, :8], kq, kq, seq, k_scale=cp.ones((2, 4, 16), np.float32),
                           v_scale=cp.ones((2, 4, 16), np.float32), appended=(rows[:, 8:12], rows[:, 12:]))
    with pytest.raises(TypeError, match="v_cache"):
        K.decode_attention(q, kc, kc.astype(np.float32), seq)
    with pytest.raises(ValueError, match="ahead must be"):
        K.decode_attention(q, kc, kc, seq, ahead=3)
    with pytest.raises(ValueError, match="one query head per block of 128"):
        K.decode_attention(q, kc, kc, seq, ahead=4, threads=512)
    with pytest.raises(ValueError, match="float16 or bfloat16 cache"):
        K.decode_attention(q, kq, kq, seq, ahead=4, k_scale=cp.ones((2, 4, 16), np.float32),
                           v_scale=cp.ones((2, 4, 16), np.float32))
    w = cp.zeros((64, 64), np.float16)
    for bad in (w[:, :60], w.reshape(-1)[4:], w.reshape(-1)[:4]):  # not contiguous, 8 bytes off, 8 bytes long
        with pytest.raises(ValueError, match="warm must be"):
            K.decode_attention(q, kc, kc, seq, warm=bad)
    with pytest.raises(TypeError, match="warm must live on the GPU"):
        K.decode_attention(q, kc, kc, seq, warm=np.zeros(64, np.float16))
    for blocks in (0, 1025, 2.0, True):
        with pytest.raises(ValueError, match="warm_blocks"):
            K.decode_attention(q, kc, kc, seq, warm=w, warm_blocks=blocks)
    with pytest.raises(TypeError, match="prefetch must be int32"):
        K.decode_attention(q, kc, kc, seq, prefetch=cp.zeros(2, np.int64))
    with pytest.raises(ValueError, match="prefetch"):
        K.decode_attention(q, kc, kc, seq, prefetch=cp.zeros(3, np.int32))
    q32, k32 = cp.zeros((2, 8, 64), np.float32), cp.zeros((2, 8, 16, 64), np.float32)
    with pytest.raises(ValueError, match="float16 or bfloat16 cache"):
        K.decode_attention(q32, k32, k32, seq, ahead=4)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        K.kv_storage_dtype("int4", np.float16)
    with pytest.raises(ValueError, match="head_dim"):
        K.kv_append(cp.zeros((1, 2, 4, 32), np.int8), cp.zeros((1, 2, 4, 32), np.int8),
                    cp.zeros((1, 1, 2, 32), np.float16), cp.zeros((1, 1, 2, 32), np.float16), cp.zeros(1, np.int32),
                    k_scale=cp.zeros((1, 2, 4), np.float32), v_scale=cp.zeros((1, 2, 4), np.float32))
