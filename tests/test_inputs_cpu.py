"""Input checks that need no GPU: they run before anything is allocated or launched."""

from __future__ import annotations

import numpy as np
import pytest

import cupy_kernels as K
from gpt2_cupy import SIZES
from gpt2_cupy.__main__ import main
from gpt2_cupy.model import check_budgets, check_generate_args, check_input_ids, dtype_name

CFG = SIZES["gpt2"]


def test_kernels_reject_host_arrays_naming_the_argument():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(TypeError, match="x must live on the GPU"):
        K.layernorm(x, x[0], x[0])
    with pytest.raises(TypeError, match="logits must live on the GPU"):
        K.argmax(x)
    with pytest.raises(TypeError, match="q must be a cupy.ndarray"):
        K.causal_attention([1, 2], None, None)
    with pytest.raises(TypeError, match="q must be a cupy.ndarray"):
        K.flash_attention([1, 2], None, None)
    q = np.ones((1, 4, 2, 64), np.float16)
    with pytest.raises(TypeError, match="q must live on the GPU"):
        K.flash_attention(q, q, q)


@pytest.mark.parametrize("ids,rows", [([1, 2, 3], [[1, 2, 3]]), ([[5], [6, 7]], [[5], [6, 7]]),
                                      (np.array([[1, 2], [3, 4]], np.int32), [[1, 2], [3, 4]])])
def test_input_ids_forms(ids, rows):
    got, _ = check_input_ids(ids, CFG)
    assert [r.tolist() for r in got] == rows


@pytest.mark.parametrize("ids,error,match", [
    ([], ValueError, "empty"),
    (np.zeros((0, 4), np.int64), ValueError, "no sequence"),
    ([[1], []], ValueError, "sequence 1 is empty"),
    ([50257], ValueError, "outside the vocabulary"),
    ([-3], ValueError, "outside the vocabulary"),
    ([1.0, 2.0], TypeError, "integers"),
    ([True], TypeError, "integers"),
    (np.array([0.5]), TypeError, "integers"),
    (list(range(1025)), ValueError, "positions"),
    ("hello", TypeError, "input_ids"),
    (np.zeros((1, 2, 3), np.int64), ValueError, r"\[T\] or \[B, T\]"),
])
def test_bad_input_ids(ids, error, match):
    with pytest.raises(error, match=match):
        check_input_ids(ids, CFG)


def test_ragged_rejected_where_a_rectangle_is_needed():
    with pytest.raises(ValueError, match="different lengths"):
        check_input_ids([[1], [2, 3]], CFG, allow_ragged=False)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=1020), "exceed"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(do_sample=True, temperature=0.0), "temperature"),
    (dict(do_sample=True, temperature=float("nan")), "temperature"),
    (dict(do_sample=True, top_k=0), "top_k"),
    (dict(do_sample=True, top_p=1.5), "top_p"),
    (dict(do_sample=True, seed=-1), "seed"),
    (dict(eos_token_id=60000), "eos_token_id"),
])
def test_bad_generation_settings(kwargs, match):
    settings = dict(max_new_tokens=4, do_sample=False, temperature=1.0, top_k=None, top_p=None, seed=None,
                    eos_token_id=None)
    settings.update(kwargs)
    with pytest.raises(ValueError, match=match):
        check_generate_args([[1, 2, 3, 4, 5]], CFG, **settings)


def test_sampling_without_seed_draws_one():
    seed = check_generate_args([[1]], CFG, 4, True, 1.0, None, None, None, None)
    assert isinstance(seed, int) and 0 <= seed < 2**64


@pytest.mark.parametrize("name,canonical", [("fp16", "float16"), ("bf16", "bfloat16"), ("float32", "float32"),
                                            ("torch.float16", "float16")])
def test_dtype_names(name, canonical):
    assert dtype_name(name) == canonical


def test_unknown_dtype():
    with pytest.raises(ValueError, match="unsupported dtype"):
        dtype_name("int8")


def test_command_line_error_is_one_line(capsys):
    assert main(["hi", "--dtype", "int8", "--random-weights"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ValueError: unsupported dtype") and "\n" not in err


def test_programmatic_launch_packs_arguments_as_cupy_does():
    """cuLaunchKernelEx gets each argument as CuPy would pass it: typed numpy scalars at
    their width, Python ints (null pointers) as 64 bits."""
    import ctypes

    from cupy_kernels._build import _c_arg

    assert isinstance(_c_arg(np.int32(-3)), ctypes.c_int32) and _c_arg(np.int32(-3)).value == -3
    assert isinstance(_c_arg(np.float32(0.5)), ctypes.c_float) and _c_arg(np.float32(0.5)).value == 0.5
    assert isinstance(_c_arg(np.uint32(7)), ctypes.c_uint32)
    assert isinstance(_c_arg(np.uint64(2**63)), ctypes.c_uint64) and _c_arg(np.uint64(2**63)).value == 2**63
    assert isinstance(_c_arg(0), ctypes.c_int64)
    with pytest.raises(TypeError, match="programmatic"):
        _c_arg("not an argument")


def test_engine_buckets():
    from gpt2_cupy.engine import MIN_CACHE, batch_bucket, length_bucket

    assert [batch_bucket(b) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert length_bucket(10, 1024) == MIN_CACHE
    assert length_bucket(520, 1024) == 1024 and length_bucket(1000, 1024) == 1024
    assert length_bucket(129, 1024) == 256 and length_bucket(128, 1024) == 128


def test_max_new_tokens_per_prompt():
    rows = [np.array([1]), np.array([2, 3])]
    assert check_budgets(rows, 5) == [5, 5]
    assert check_budgets(rows, [0, np.int64(7)]) == [0, 7]
    with pytest.raises(ValueError, match="2 prompts"):
        check_budgets(rows, [1, 2, 3])
    with pytest.raises(ValueError, match="sequence 1"):
        check_budgets(rows, [1, -1])
    with pytest.raises(ValueError, match="sequence 0"):
        check_budgets(rows, [True, 1])
    with pytest.raises(ValueError, match="sequence 0"):
        check_budgets(rows, 2.5)


def test_record_size_buckets_and_prefill_meta_padding():
    """A recorded prefill's bucket: eight sizes an octave, at most an eighth over past 8 least;
    the per-call data: token ids, positions, cache rows (-1 for padding) and offsets (the last
    repeated for padding prompts), each part on a 32-byte boundary."""
    from gpt2_cupy.model import _prefill_meta, record_size

    assert [record_size(n, 8) for n in (1, 8, 9, 17, 37, 100, 512, 513, 2049)] == [8, 8, 16, 24, 40, 104, 512, 576,
                                                                                      2304]
    assert [record_size(n) for n in (1, 3, 9, 17, 33)] == [1, 3, 9, 18, 36]
    for n in range(1, 5000):
        b = record_size(n, 8)
        assert b >= n and b == record_size(b, 8) and (n <= 64 or b - n <= n / 8), n
    rows = [np.array([5, 6, 7]), np.array([9, 8])]
    meta = _prefill_meta(rows, [3, 2], [4, 1], 9, 4)  # 9 rows (4 padding), 4 prompts (2 padding)
    stride = 16
    assert meta.dtype == np.int32 and meta.size == 3 * stride + 9
    assert meta[:stride].tolist() == [5, 6, 7, 9, 8] + [0] * 11
    assert meta[stride:2 * stride].tolist() == [0, 1, 2, 0, 1] + [0] * 11
    assert meta[2 * stride:2 * stride + 9].tolist() == [4, 4, 4, 1, 1, -1, -1, -1, -1]
    assert meta[3 * stride:].tolist() == [0, 3, 5, 5, 5] + [2, 4, 0, 0]  # offsets, then the last rows
    alone = _prefill_meta(rows[1:], [2], None, 2, 1)  # one prompt, no cache, no padding
    assert alone.tolist() == [9, 8] + [0] * 6 + [0, 1] + [0] * 6 + [0] * 8 + [0, 2, 1]
    one = _prefill_meta(rows[:1], [3], [2], 8, 2)  # one prompt, padded
    assert one.tolist() == [5, 6, 7] + [0] * 5 + [0, 1, 2] + [0] * 5 + [2] * 3 + [-1] * 5 + [0, 3, 3] + [2, 0]
    assert (_prefill_meta(rows, [3, 2], [4, 1], 5, 2)[:3 * 8 + 3].tolist()  # no padding
            == [5, 6, 7, 9, 8, 0, 0, 0, 0, 1, 2, 0, 1, 0, 0, 0, 4, 4, 4, 1, 1, -1, -1, -1, 0, 3, 5])


def test_prefill_groups_pack_prompts_up_to_the_token_budget():
    from types import SimpleNamespace

    from gpt2_cupy.model import GPT2, PLANS, PREFILL_TOKENS, SHORT_PACK, SHORT_PROMPT, SHORT_RECORDS

    half = SimpleNamespace(dtype=np.dtype(np.float16))
    lengths = [1000, 5000, 2500, 700, 8192, 1, 1]
    groups = GPT2.prefill_groups(half, lengths)
    assert groups == [(0, 2), (2, 4), (4, 5), (5, 7)]
    assert all(sum(lengths[lo:hi]) <= PREFILL_TOKENS for lo, hi in groups)
    assert GPT2.prefill_groups(half, [3]) == [(0, 1)]
    # short prompts (at most SHORT_PROMPT tokens) pack only with short ones, up to SHORT_PACK tokens
    # while their run holds at most SHORT_RECORDS such packs (fewer records than a cache keeps)
    assert SHORT_PROMPT == 16 and SHORT_PACK == 256 and SHORT_RECORDS == 4 < PLANS
    assert GPT2.prefill_groups(half, [3, 40, 5, 6, 16, 17, 2]) == [(0, 1), (1, 2), (2, 5), (5, 6), (6, 7)]
    assert GPT2.prefill_groups(half, [16] * 64) == [(i, i + 16) for i in range(0, 64, 16)]
    # a longer run: packs of up to PREFILL_TOKENS, the runs around it as before
    assert GPT2.prefill_groups(half, [16] * 600) == [(0, 512), (512, 600)]
    assert GPT2.prefill_groups(half, [16] * 65 + [40] + [8] * 3) == [(0, 65), (65, 66), (66, 69)]
    assert GPT2.prefill_groups(half, [15, 1] * 16 + [2]) == [(0, 32), (32, 33)]
    assert GPT2.prefill_groups(half, [40, 50, 1, 1]) == [(0, 2), (2, 4)]
    single = SimpleNamespace(dtype=np.dtype(np.float32))  # float32: every prompt alone
    assert GPT2.prefill_groups(single, [3, 4, 5]) == [(0, 1), (1, 2), (2, 3)]
    # the memory check's bound: the largest pack of at most `at_once` prompts
    assert GPT2.prefill_tokens(half, [10, 20, 30], 2) == 50
    assert GPT2.prefill_tokens(half, [8000, 9000 - 8000, 500], 3) == PREFILL_TOKENS
    assert GPT2.prefill_tokens(single, [10, 20, 30], 3) == 30


def test_gemm_tiles_fill_the_gpu():
    from cupy_kernels.gemm import TILES, gemm_tiles

    assert TILES[gemm_tiles(8000, 2304, 132)].bm == 128
    # 16-column tiles while their grid fits the SMs at once (228 KiB an SM)
    assert gemm_tiles(8, 1600, 132) == "64x16w4" and gemm_tiles(64, 768, 132) == "64x16w4"
    assert gemm_tiles(8, 4800, 132) == "16x16w1"  # 300 blocks of 64 x 16 are over the 264 that fit
    assert gemm_tiles(8, 6400, 132) == gemm_tiles(64, 4800, 132) == "64x64w4"
    assert gemm_tiles(8, 1600, 84, smem_sm=100 * 1024) == "64x64w4"  # 100 blocks, one an SM of 100 KiB
    assert gemm_tiles(256, 768, 132) == "64x16w4" and gemm_tiles(256, 1600, 132) == "64x64w4"  # 192 / 400 blocks
    assert TILES[gemm_tiles(500, 768, 132)].bm == 64
    assert all(t.smem_bytes <= 99 * 1024 for t in (TILES[gemm_tiles(12, 768, 132)], TILES[gemm_tiles(9000, 9000, 1)]))


def test_float32_long_rows_take_one_batch_a_warp():
    """CUDA-core products of float32 rows longer than one batch of (1, 8) (1,024 columns at
    16-byte vectors) take FLOAT_LONG_TILE, a declared tile; shorter rows, LayerNorm prologues
    and the LM head keep theirs."""
    import importlib

    lin = importlib.import_module("cupy_kernels.linear")
    long_rows = (lin.FLOAT_LONG_TILE, lin.FLOAT_LONG_WARPS)
    assert lin.FLOAT_LONG_TILE in lin.TILES and lin.FLOAT_LONG_WARPS in lin.WARPS
    assert lin._tile(768, 3072, 4) == lin._tile(1600, 6400, 4) == lin._tile(1024, 1025, 4) == long_rows
    assert lin._tile(768, 768, 4) == lin._tile(1024, 1024, 4) == ((1, 8), 8)
    assert lin._tile(3072, 1600, 4, ln=True) == ((2, 4), 4)
    assert lin._tile(50257, 1600, 4) == ((4, 2), 8)
    assert lin._tile(768, 3072, 2) == ((2, 4), 4)  # (16-bit rows on CUDA cores)


def test_float32_layernorm_rows_of_small_take_one_batch_a_warp():
    """CUDA-core products of float32 rows with the LayerNorm prologue longer than one batch of
    (2, 4) and at most one of FLOAT_LN_TILE (GPT-2 small's q|k|v and MLP up) take it, a declared
    tile; shorter and longer rows and rows without the prologue keep theirs."""
    import importlib

    lin = importlib.import_module("cupy_kernels.linear")
    assert lin.FLOAT_LN_TILE in lin.TILES
    ln_rows = (lin.FLOAT_LN_TILE, 4)
    assert lin._tile(2304, 768, 4, ln=True) == lin._tile(3072, 768, 4, ln=True) == ln_rows
    assert lin._tile(100, 513, 4, ln=True) == ln_rows
    assert lin._tile(2304, 512, 4, ln=True) == lin._tile(3072, 1024, 4, ln=True) == ((2, 4), 4)
    assert lin._tile(2304, 768, 4) == ((1, 8), 8)
    assert lin._tile(2304, 768, 2, ln=True) == ((2, 4), 4)  # (16-bit rows on CUDA cores)


def test_streamed_lm_head_takes_its_shapes():
    """linear_mma_stream_kernel: GPT-2 small's LM head from 17 to 64 rows on an H100-like GPU
    (132 SMs, 227 KiB of shared memory a block); not for fewer or more rows, wider rows, short
    weights, outputs in x's dtype or n-tiles asked for."""
    import importlib

    lin = importlib.import_module("cupy_kernels.linear")
    V, C, sms, smem = CFG.vocab_size, CFG.n_embd, 132, 232448
    kw = lin._mma_warps(C)
    take = lambda B, N=V, K_=C, tile=None, xin=lin.X_LN_FOLD, logits=True: lin._mma_stream(  # noqa: E731
        B, N, K_, tile, xin, logits, lin._mma_warps(K_), sms, smem)
    assert all(take(B) for B in (17, 33, 64)) and take(40, xin=lin.X_PLAIN)
    assert not any(take(B) for B in (1, 8, 16, 65, 256))
    assert not take(64, K_=SIZES["gpt2-xl"].n_embd)  # 8 warps a group: blocks of more than 16 warps
    assert not take(64, N=3 * C) and not take(64, logits=False) and not take(64, tile=8)
    assert not take(64, xin=lin.X_LN)
    assert lin._stream_smem(C, kw, True) + lin._STREAM_STATIC_SMEM <= smem


def test_product_arguments_hold_n_and_k_where_read():
    """Every product kernel's arguments begin with linear._args's; ARG_N and ARG_K (where
    benchmarks/decode_step.py reads a recorded launch's shape) point at its N and K."""
    import importlib

    lin = importlib.import_module("cupy_kernels.linear")
    args = lin._args(None, 0, 0, None, None, None, None, None, 7, 2304, 768)
    assert (int(args[lin.ARG_N]), int(args[lin.ARG_K])) == (2304, 768)
    assert lin.ARG_K == len(args) - 1


def test_decode_pace_follows_the_rule():
    """The decode step's pace (GB/s) by width, batch and the device's peak DRAM bandwidth:
    GPT-2 small's a share of the peak up to DECODE_PACE_FAST's rows, medium's fixed, none past
    DECODE_PACE_BATCH or for wider models."""
    from gpt2_cupy.model import (DECODE_PACE_BATCH, DECODE_PACE_FAST, DECODE_PACE_GBPS, DECODE_PACE_PEAK_SHARE,
                                 decode_pace)

    share, (fast_rows, fast) = DECODE_PACE_PEAK_SHARE[768], DECODE_PACE_FAST[768]
    assert decode_pace(768, 1, 3352.0) == round(share * 3352.0)
    assert decode_pace(768, fast_rows - 1, 4915.2) == round(share * 4915.2)
    assert decode_pace(768, 1, None) == DECODE_PACE_GBPS  # a device that does not give its peak
    assert decode_pace(768, fast_rows, 4915.2) == decode_pace(768, DECODE_PACE_BATCH, 3352.0) == fast
    assert decode_pace(1024, 1, 4915.2) == decode_pace(1024, DECODE_PACE_BATCH, None) == DECODE_PACE_GBPS
    assert decode_pace(768, DECODE_PACE_BATCH + 1, 4915.2) is None
    assert decode_pace(1600, 1, 4915.2) is None and decode_pace(1280, 1, 3352.0) is None
