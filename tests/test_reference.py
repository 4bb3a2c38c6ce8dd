"""CPU tests of cupy_kernels.reference against torch / transformers (float64)."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from cupy_kernels import reference as ref
from gpt2_cupy.config import GPT2Config
from gpt2_cupy.weights import map_hf_state_dict

TINY = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=101, n_positions=32)


@functools.lru_cache(maxsize=None)
def _hf_model(attn_implementation: str | None, tie: bool = True, seed: int = 0):
    """Tiny float64 GPT2LMHeadModel in eval mode with every parameter randomized."""
    kwargs = dict(TINY, bos_token_id=0, eos_token_id=0, tie_word_embeddings=tie)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs)).double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # tied lm_head/wte is a single parameter
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)
    return model


def _hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), use_cache=False)
    return out.logits.double().numpy()


def _assert_logits_close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-10) -> None:
    assert got.shape == want.shape
    assert got.dtype == np.float64
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < rtol, f"relative max error {err:.3e}"


@pytest.mark.parametrize("attn_implementation", [None, "eager", "sdpa"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 7), (1, TINY["n_positions"]), (3, TINY["n_positions"])])
def test_gpt2_forward_matches_transformers(attn_implementation, shape):
    model = _hf_model(attn_implementation)
    cfg = GPT2Config.from_hf(model.config)
    weights = map_hf_state_dict(model.state_dict(), cfg)
    assert "lm_head" not in weights  # tied
    rng = np.random.default_rng(shape[0] * 100 + shape[1])
    ids = rng.integers(0, cfg.vocab_size, size=shape, dtype=np.int64)
    _assert_logits_close(ref.gpt2_forward(weights, cfg, ids), _hf_logits(model, ids))


def test_gpt2_forward_untied_lm_head():
    model = _hf_model(None, tie=False)
    assert model.lm_head.weight is not model.transformer.wte.weight
    cfg = GPT2Config.from_hf(model.config)
    weights = map_hf_state_dict(model.state_dict(), cfg)
    assert "lm_head" in weights
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 9))
    want = _hf_logits(model, ids)
    _assert_logits_close(ref.gpt2_forward(weights, cfg, ids), want)
    # Ignoring lm_head (using wte) must give different logits.
    tied = {k: v for k, v in weights.items() if k != "lm_head"}
    assert not np.allclose(ref.gpt2_forward(tied, cfg, ids), want)


def test_gpt2_forward_numpy_weights_and_hidden():
    model = _hf_model(None)
    cfg = GPT2Config.from_hf(model.config)
    weights = {k: v.numpy().copy() for k, v in map_hf_state_dict(model.state_dict(), cfg).items()}
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, 5))
    with torch.no_grad():
        hidden = model.transformer(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    got_hidden = ref.gpt2_hidden(weights, cfg, ids)
    np.testing.assert_allclose(got_hidden, hidden, rtol=0, atol=1e-10 * np.abs(hidden).max())
    _assert_logits_close(ref.gpt2_forward(weights, cfg, ids.tolist()), _hf_logits(model, ids))


def test_gpt2_forward_rejects_too_long():
    model = _hf_model(None)
    cfg = GPT2Config.from_hf(model.config)
    weights = map_hf_state_dict(model.state_dict(), cfg)
    with pytest.raises(ValueError):
        ref.gpt2_forward(weights, cfg, np.zeros((1, cfg.n_positions + 1), dtype=np.int64))


# ----------------------------------------------------------------------------
# Small references


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_layernorm_matches_torch():
    r = _rng(0)
    x = r.normal(size=(3, 5, 48)) * 3 + 1
    w, b = r.normal(size=48), r.normal(size=48)
    want = F.layer_norm(torch.from_numpy(x), (48,), torch.from_numpy(w), torch.from_numpy(b), eps=1e-5).numpy()
    np.testing.assert_allclose(ref.layernorm(x, w, b), want, rtol=1e-12, atol=1e-12)
    want2 = F.layer_norm(torch.from_numpy(x), (48,), torch.from_numpy(w), torch.from_numpy(b), eps=1e-2).numpy()
    np.testing.assert_allclose(ref.layernorm(x, w, b, eps=1e-2), want2, rtol=1e-12, atol=1e-12)
    # float32 / torch inputs are accepted and the result is float64
    out = ref.layernorm(torch.from_numpy(x).float(), w.astype(np.float32), b.astype(np.float32))
    assert out.dtype == np.float64


def test_layernorm_residual():
    r = _rng(1)
    x, y = r.normal(size=(4, 32)), r.normal(size=(4, 32))
    w, b, bias = r.normal(size=32), r.normal(size=32), r.normal(size=32)
    s, out = ref.layernorm_residual(x, y, w, b)
    np.testing.assert_allclose(s, x + y, rtol=0, atol=0)
    np.testing.assert_allclose(out, ref.layernorm(x + y, w, b), rtol=1e-15, atol=1e-15)
    s, out = ref.layernorm_residual(x, y, w, b, bias=bias, eps=1e-3)
    np.testing.assert_allclose(s, x + y + bias, rtol=1e-15, atol=1e-15)
    want = F.layer_norm(torch.from_numpy(x + y + bias), (32,), torch.from_numpy(w), torch.from_numpy(b), eps=1e-3)
    np.testing.assert_allclose(out, want.numpy(), rtol=1e-12, atol=1e-12)


def test_gelu_matches_torch():
    x = np.linspace(-8, 8, 1001)
    want = F.gelu(torch.from_numpy(x), approximate="tanh").numpy()
    np.testing.assert_allclose(ref.gelu_tanh(x), want, rtol=1e-13, atol=1e-15)
    act = transformers.activations.ACT2FN["gelu_new"]
    np.testing.assert_allclose(ref.gelu_tanh(x), act(torch.from_numpy(x)).numpy(), rtol=1e-13, atol=1e-15)
    r = _rng(2)
    x2, bias = r.normal(size=(3, 16)), r.normal(size=16)
    np.testing.assert_allclose(ref.bias_gelu(x2, bias), ref.gelu_tanh(x2 + bias), rtol=0, atol=0)
    np.testing.assert_allclose(ref.bias_add(x2, bias), x2 + bias, rtol=0, atol=0)


def test_softmax_plain_matches_torch():
    r = _rng(3)
    x = r.normal(size=(2, 3, 17)) * 10
    for scale in (1.0, 0.125):
        want = torch.softmax(torch.from_numpy(x) * scale, dim=-1).numpy()
        np.testing.assert_allclose(ref.softmax(x, scale=scale), want, rtol=1e-12, atol=1e-15)
    # large values must not overflow
    big = np.array([[1000.0, 999.0, -1000.0]])
    assert np.all(np.isfinite(ref.softmax(big)))


@pytest.mark.parametrize("tq,tk", [(6, 6), (3, 8), (1, 5), (8, 5)])
def test_softmax_causal(tq, tk):
    r = _rng(4)
    x = r.normal(size=(2, 3, tq, tk)) * 5
    p = ref.softmax(x, scale=0.5, causal=True)
    i = np.arange(tq)[:, None]
    j = np.arange(tk)[None, :]
    masked = j > i + (tk - tq)
    assert np.all(p[..., masked] == 0.0)
    has_key = ~masked.all(axis=-1)  # [tq]
    np.testing.assert_allclose(p.sum(-1)[..., has_key], 1.0, rtol=0, atol=1e-13)
    assert np.all(p[..., ~has_key, :] == 0.0)
    # Visible part equals a plain softmax over the visible prefix.
    for qi in range(tq):
        n = qi + (tk - tq) + 1
        if n <= 0:
            continue
        np.testing.assert_allclose(p[..., qi, :n], ref.softmax(x[..., qi, :n], scale=0.5), rtol=1e-13, atol=1e-15)


def test_embedding_and_linear():
    r = _rng(5)
    wte, wpe = r.normal(size=(11, 8)), r.normal(size=(6, 8))
    ids = np.array([[3, 0, 10], [1, 1, 2]])
    pos = np.arange(3)
    got = ref.embedding(ids, wte, wpe, pos)
    assert got.shape == (2, 3, 8)
    for b in range(2):
        for t in range(3):
            np.testing.assert_array_equal(got[b, t], wte[ids[b, t]] + wpe[t])
    x, w, bias = r.normal(size=(2, 3, 8)), r.normal(size=(5, 8)), r.normal(size=5)
    want = F.linear(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(bias)).numpy()
    np.testing.assert_allclose(ref.linear(x, w, bias), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ref.linear(x, w), x @ w.T, rtol=1e-12, atol=1e-12)


def test_causal_attention_matches_sdpa():
    r = _rng(6)
    q, k, v = (r.normal(size=(2, 3, 9, 16)) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    want = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True).numpy()
    np.testing.assert_allclose(ref.causal_attention(q, k, v), want, rtol=1e-11, atol=1e-12)
    want = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=0.3).numpy()
    np.testing.assert_allclose(ref.causal_attention(q, k, v, scale=0.3), want, rtol=1e-11, atol=1e-12)


def test_causal_attention_bottom_right_alignment():
    r = _rng(7)
    B, H, Tk, D = 2, 2, 10, 8
    q_full, k, v = (r.normal(size=(B, H, Tk, D)) for _ in range(3))
    full = ref.causal_attention(q_full, k, v)
    # The last Tq queries against all Tk keys (a cached prefix) equal the last
    # Tq rows of full causal attention.
    for tq in (1, 3, Tk):
        got = ref.causal_attention(q_full[:, :, -tq:], k, v)
        np.testing.assert_allclose(got, full[:, :, -tq:], rtol=1e-13, atol=1e-14)
    # Explicit mask check against torch with a bottom-right mask.
    tq = 4
    mask = torch.from_numpy(np.arange(Tk)[None, :] <= np.arange(tq)[:, None] + (Tk - tq))
    want = F.scaled_dot_product_attention(
        torch.from_numpy(q_full[:, :, -tq:]), torch.from_numpy(k), torch.from_numpy(v), attn_mask=mask
    ).numpy()
    np.testing.assert_allclose(ref.causal_attention(q_full[:, :, -tq:], k, v), want, rtol=1e-11, atol=1e-12)
    with pytest.raises(ValueError):
        ref.causal_attention(q_full, k[:, :, :5], v[:, :, :5])


@pytest.mark.parametrize("tq,tk", [(6, 6), (3, 8), (1, 5), (8, 5), (4, 1)])
def test_attention_bottom_right_mask(tq, tk):
    """causal: query i sees keys j <= i + (tk - tq); a query that sees none gives zeros."""
    r = _rng(10)
    q, k, v = r.normal(size=(2, 3, tq, 8)), r.normal(size=(2, 3, tk, 8)), r.normal(size=(2, 3, tk, 8))
    got = ref.attention(q, k, v, causal=True, scale=0.4)
    assert got.shape == (2, 3, tq, 8)
    for i in range(tq):
        n = i + (tk - tq) + 1  # keys 0 .. n - 1 are visible
        if n <= 0:
            assert np.all(got[:, :, i] == 0.0)
            continue
        s = np.einsum("bhd,bhjd->bhj", q[:, :, i], k[:, :, :n]) * 0.4
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.einsum("bhj,bhjd->bhd", p / p.sum(-1, keepdims=True), v[:, :, :n])
        np.testing.assert_allclose(got[:, :, i], want, rtol=1e-12, atol=1e-14)


def test_attention_causal_equals_causal_attention_and_plain_matches_sdpa():
    r = _rng(11)
    q, k, v = (r.normal(size=(2, 3, 9, 16)) for _ in range(3))
    np.testing.assert_array_equal(ref.attention(q, k, v, causal=True), ref.causal_attention(q, k, v))
    np.testing.assert_array_equal(ref.attention(q[:, :, -4:], k, v, causal=True),
                                  ref.causal_attention(q[:, :, -4:], k, v))
    tq, tk, tv = (torch.from_numpy(a) for a in (q[:, :, :5], k, v))
    want = F.scaled_dot_product_attention(tq, tk, tv, scale=0.3).numpy()
    np.testing.assert_allclose(ref.attention(q[:, :, :5], k, v, causal=False, scale=0.3), want,
                               rtol=1e-11, atol=1e-12)


def test_attention_without_keys_is_zero():
    q = _rng(12).normal(size=(1, 2, 3, 8))
    empty = np.zeros((1, 2, 0, 8))
    for causal in (False, True):
        assert np.all(ref.attention(q, empty, empty, causal=causal) == 0.0)


def test_decode_attention_matches_last_causal_row():
    r = _rng(8)
    B, H, S_max, D = 3, 4, 12, 16
    k_cache, v_cache = r.normal(size=(B, H, S_max, D)), r.normal(size=(B, H, S_max, D))
    q = r.normal(size=(B, H, D))
    seq_lens = np.array([1, 7, 12])
    got = ref.decode_attention(q, k_cache, v_cache, seq_lens)
    assert got.shape == (B, H, D)
    for b, n in enumerate(seq_lens):
        full = ref.causal_attention(q[b : b + 1, :, None, :], k_cache[b : b + 1, :, :n], v_cache[b : b + 1, :, :n])
        np.testing.assert_allclose(got[b], full[0, :, 0], rtol=1e-13, atol=1e-14)
    # Keys beyond seq_lens must not matter.
    k2, v2 = k_cache.copy(), v_cache.copy()
    k2[0, :, 1:] = 1e3
    v2[1, :, 7:] = np.nan
    np.testing.assert_array_equal(ref.decode_attention(q, k2, v2, seq_lens), got)
    # Scale and torch cross-check for one sequence.
    b, n = 1, 7
    want = F.scaled_dot_product_attention(
        torch.from_numpy(q[b][:, None]), torch.from_numpy(k_cache[b, :, :n]), torch.from_numpy(v_cache[b, :, :n]), scale=0.2
    ).numpy()[:, 0]
    np.testing.assert_allclose(ref.decode_attention(q, k_cache, v_cache, seq_lens, scale=0.2)[b], want, rtol=1e-11, atol=1e-12)
    # Empty sequence gives zeros.
    assert np.all(ref.decode_attention(q, k_cache, v_cache, np.array([0, 1, 2]))[0] == 0.0)


def test_decode_attention_equals_full_model_attention_step():
    """decode_attention with the prefix K/V equals the last row of causal attention."""
    r = _rng(9)
    B, H, T, D = 2, 3, 6, 8
    q, k, v = (r.normal(size=(B, H, T, D)) for _ in range(3))
    full = ref.causal_attention(q, k, v)
    S_max = 10
    k_cache = np.zeros((B, H, S_max, D))
    v_cache = np.zeros((B, H, S_max, D))
    k_cache[:, :, :T], v_cache[:, :, :T] = k, v
    got = ref.decode_attention(q[:, :, -1], k_cache, v_cache, np.full(B, T), scale=1 / math.sqrt(D))
    np.testing.assert_allclose(got, full[:, :, -1], rtol=1e-13, atol=1e-14)


def test_decode_attention_gqa_and_alibi_match_torch():
    """Query head h reads KV head h // (H / H_kv); ALiBi adds slope_h * (s - len + 1)."""
    r = _rng(10)
    B, H, H_kv, S_max, D = 2, 6, 2, 9, 8
    k_cache, v_cache = r.normal(size=(B, H_kv, S_max, D)), r.normal(size=(B, H_kv, S_max, D))
    q = r.normal(size=(B, H, D))
    slopes = 2.0 ** -np.arange(1, H + 1)
    seq_lens = np.array([9, 4])
    got = ref.decode_attention(q, k_cache, v_cache, seq_lens, alibi_slopes=slopes)
    for b, n in enumerate(seq_lens):
        k = torch.from_numpy(k_cache[b, :, :n]).repeat_interleave(H // H_kv, dim=0)  # [H, n, D]
        v = torch.from_numpy(v_cache[b, :, :n]).repeat_interleave(H // H_kv, dim=0)
        bias = torch.from_numpy(slopes[:, None, None] * (np.arange(n) - (n - 1))[None, None, :])  # [H, 1, n]
        want = F.scaled_dot_product_attention(torch.from_numpy(q[b][:, None]), k, v, attn_mask=bias).numpy()[:, 0]
        np.testing.assert_allclose(got[b], want, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3"])
def test_quantize_kv_rows(kv_dtype):
    import ml_dtypes

    x = _rng(11).normal(size=(3, 5, 64)) * 4
    x[1, 2] = 0.0
    codes, scales = ref.quantize_kv(x, kv_dtype)
    assert codes.shape == x.shape and scales.shape == x.shape[:2] and scales.dtype == np.float32
    qmax = ref.KV_QMAX[kv_dtype]
    np.testing.assert_allclose(scales, np.abs(x).max(-1) / qmax, rtol=1e-6)
    assert np.all(codes[1, 2] == 0) and scales[1, 2] == 0
    assert np.abs(codes).max() == qmax  # each row's largest value uses the full range
    if kv_dtype == "int8":
        assert codes.dtype == np.int8
        assert np.all(np.abs(ref.dequantize_kv(codes, scales) - x) <= scales[..., None] * 0.5001)
    else:  # every code is an e4m3 value
        np.testing.assert_array_equal(codes.astype(ml_dtypes.float8_e4m3fn).astype(np.float64), codes)
        assert np.all(np.abs(ref.dequantize_kv(codes, scales) - x) <= np.abs(x) * 2.0**-4 * 1.001 + scales[..., None] * 2.0**-9)
