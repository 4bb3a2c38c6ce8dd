"""Float64 NumPy reference implementations for the GPT-2 kernels.

Every function converts its array inputs to float64 (integer index inputs to
int64) and returns float64 NumPy arrays. Linear weights use the (out, in)
layout and the weight names of ``gpt2_cupy.weights.map_hf_state_dict``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

__all__ = [
    "layernorm",
    "layernorm_residual",
    "gelu_tanh",
    "bias_gelu",
    "bias_add",
    "softmax",
    "embedding",
    "linear",
    "attention",
    "causal_attention",
    "decode_attention",
    "quantize_kv",
    "dequantize_kv",
    "gpt2_hidden",
    "gpt2_forward",
    "philox4x32_10",
    "sample_uniform",
    "sampling_probs",
    "sample",
]


def _f64(a: Any) -> np.ndarray:
    """Convert a NumPy / torch / CuPy array (or scalar, list) to float64 NumPy."""
    if hasattr(a, "detach"):  # torch.Tensor
        return np.asarray(a.detach().cpu().double().numpy())
    if type(a).__module__.split(".")[0] == "cupy":
        a = a.get()
    return np.asarray(a, dtype=np.float64)


def _i64(a: Any) -> np.ndarray:
    """Convert an integer array (NumPy / torch / CuPy / list) to int64 NumPy."""
    if hasattr(a, "detach"):
        return np.asarray(a.detach().cpu().long().numpy())
    if type(a).__module__.split(".")[0] == "cupy":
        a = a.get()
    a = np.asarray(a)
    if a.dtype.kind not in "iub":
        raise TypeError(f"expected an integer array, got dtype {a.dtype}")
    return a.astype(np.int64)


# ----------------------------------------------------------------------------
# Elementwise / normalization


def layernorm(x, w, b, eps: float = 1e-5) -> np.ndarray:
    """LayerNorm over the last axis (biased variance, like torch)."""
    x, w, b = _f64(x), _f64(w), _f64(b)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def layernorm_residual(x, y, w, b, bias=None, eps: float = 1e-5):
    """Return ``(s, layernorm(s))`` with ``s = x + y (+ bias)``."""
    s = _f64(x) + _f64(y)
    if bias is not None:
        s = s + _f64(bias)
    return s, layernorm(s, w, b, eps)


def gelu_tanh(x) -> np.ndarray:
    """Tanh-approximated GELU (GPT-2's ``gelu_new``)."""
    x = _f64(x)
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def bias_gelu(x, bias) -> np.ndarray:
    """``gelu_tanh(x + bias)``."""
    return gelu_tanh(_f64(x) + _f64(bias))


def bias_add(x, bias) -> np.ndarray:
    """``x + bias`` (bias broadcast over the last axis)."""
    return _f64(x) + _f64(bias)


# ----------------------------------------------------------------------------
# Softmax / attention


def _causal_visible(tq: int, tk: int) -> np.ndarray:
    """Bool [tq, tk]: query i sees key j iff j <= i + (tk - tq) (bottom-right aligned)."""
    i = np.arange(tq)[:, None]
    j = np.arange(tk)[None, :]
    return j <= i + (tk - tq)


def softmax(x, scale: float = 1.0, causal: bool = False) -> np.ndarray:
    """Softmax of ``scale * x`` over the last axis.

    With ``causal=True`` x is [..., Tq, Tk] and query i sees keys
    j <= i + (Tk - Tq); masked entries are exactly 0 and a row with no
    visible key is all 0.
    """
    z = _f64(x) * scale
    if not causal:
        z = z - z.max(axis=-1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=-1, keepdims=True)
    if z.ndim < 2:
        raise ValueError(f"causal softmax needs x of shape [..., Tq, Tk], got {z.shape}")
    visible = np.broadcast_to(_causal_visible(z.shape[-2], z.shape[-1]), z.shape)
    zm = np.where(visible, z, -np.inf)
    row_max = zm.max(axis=-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)  # fully masked rows
    e = np.where(visible, np.exp(zm - row_max), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    return e / np.where(denom > 0, denom, 1.0)


def attention(q, k, v, causal: bool, scale: float | None = None) -> np.ndarray:
    """Attention. q [B, H, Tq, D], k/v [B, H, Tk, D]; ``scale`` defaults to 1/sqrt(D).

    With ``causal=True`` query i sees keys j <= i + (Tk - Tq) (bottom-right aligned, any
    Tq and Tk); a query that sees no key (i < Tq - Tk) gives zeros, as does every query
    when Tk = 0. Returns [B, H, Tq, D]."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(f"expected q, k, v of rank 4 with k.shape == v.shape, got {q.shape}, {k.shape}, {v.shape}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on B, H or D")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if k.shape[2] == 0:
        return np.zeros(q.shape)
    att = q @ k.swapaxes(-1, -2)  # [B, H, Tq, Tk]
    att = softmax(att, scale=scale, causal=causal)  # [B, H, Tq, Tk]
    return att @ v  # [B, H, Tq, D]


def causal_attention(q, k, v, scale: float | None = None) -> np.ndarray:
    """Causal attention (``attention`` with ``causal=True``) for Tk >= Tq: query t sees keys
    <= t + (Tk - Tq). q [B, H, Tq, D], k/v [B, H, Tk, D]; returns [B, H, Tq, D]."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    if q.ndim == k.ndim == 4 and k.shape[2] < q.shape[2]:
        raise ValueError(f"need Tk >= Tq, got Tq={q.shape[2]}, Tk={k.shape[2]}")
    return attention(q, k, v, causal=True, scale=scale)


def decode_attention(q, k_cache, v_cache, seq_lens, scale: float | None = None, alibi_slopes=None) -> np.ndarray:
    """Single-token attention over a KV cache. q [B, H, D], caches [B, H_kv, S_max, D] with
    H_kv dividing H (query head h reads KV head h // (H / H_kv)); sequence b attends to its
    first seq_lens[b] keys (0 gives zeros). alibi_slopes [H] adds slope_h * (s - len + 1)
    to the score of key s. Returns [B, H, D]."""
    q, k_cache, v_cache = _f64(q), _f64(k_cache), _f64(v_cache)
    seq_lens = _i64(seq_lens).reshape(-1)
    B, H, D = q.shape
    if k_cache.shape != v_cache.shape or k_cache.ndim != 4 or k_cache.shape[0] < B or k_cache.shape[3] != D:
        raise ValueError(f"bad shapes: q {q.shape}, k_cache {k_cache.shape}, v_cache {v_cache.shape}")
    H_kv, S_max = k_cache.shape[1], k_cache.shape[2]
    if H % H_kv:
        raise ValueError(f"{H_kv} KV heads do not divide {H} query heads")
    if seq_lens.shape != (B,) or (seq_lens < 0).any() or (seq_lens > S_max).any():
        raise ValueError(f"seq_lens must be [B={B}] ints in [0, {S_max}], got {seq_lens}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    slopes = np.zeros(H) if alibi_slopes is None else _f64(alibi_slopes).reshape(H)
    kv_head = np.arange(H) // (H // H_kv)
    out = np.zeros((B, H, D), dtype=np.float64)
    for b in range(B):
        n = int(seq_lens[b])
        if n == 0:
            continue
        k, v = k_cache[b, kv_head, :n], v_cache[b, kv_head, :n]  # [H, n, D]
        att = np.einsum("hd,hsd->hs", q[b], k) * scale  # [H, n]
        att += slopes[:, None] * (np.arange(n) - (n - 1))[None, :]
        att = softmax(att)  # [H, n]
        out[b] = np.einsum("hs,hsd->hd", att, v)  # [H, D]
    return out


# int8 and fp8 e4m3 KV-cache rows: one scale per row of D elements (src_cu/kv.cuh)
KV_QMAX = {"int8": 127.0, "float8_e4m3": 448.0}


def quantize_kv(x, kv_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Quantize rows x [..., D] as the cache does, in the kernel's float32 arithmetic:
    scale = max|x| / QMAX, code = encode(x * (QMAX / max|x|)). Returns (codes [..., D] as
    int8 values, or float8_e4m3fn values as float64; scales [...] float32)."""
    x = np.asarray(_f64(x), dtype=np.float32)
    qmax = np.float32(KV_QMAX[kv_dtype])
    amax = np.abs(x).max(axis=-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, qmax / amax, np.float32(0)).astype(np.float32)
    y = x * inv[..., None]  # float32, as on the GPU
    if kv_dtype == "int8":
        codes = np.clip(np.rint(y), -127, 127).astype(np.int8)
    else:
        import ml_dtypes

        codes = np.clip(y, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return codes, (amax / qmax).astype(np.float32)


def dequantize_kv(codes, scales) -> np.ndarray:
    """codes [..., D] (int8 values or fp8 values) times their row scales [...], in float64."""
    return _f64(codes) * _f64(scales)[..., None]


# ----------------------------------------------------------------------------
# Embedding / linear


def embedding(ids, wte, wpe, positions) -> np.ndarray:
    """``wte[ids] + wpe[positions]`` (positions broadcast against ids)."""
    return _f64(wte)[_i64(ids)] + _f64(wpe)[_i64(positions)]


def linear(x, w, b=None) -> np.ndarray:
    """``x @ w.T (+ b)`` with w in (out, in) layout."""
    y = _f64(x) @ _f64(w).T
    if b is not None:
        y = y + _f64(b)
    return y


# ----------------------------------------------------------------------------
# Full model


def gpt2_hidden(weights: Mapping[str, Any], config, ids) -> np.ndarray:
    """Final hidden states (after ln_f), float64 [B, T, C], for ids [B, T]."""
    W = {k: _f64(v) for k, v in weights.items()}
    ids = _i64(ids)
    if ids.ndim != 2:
        raise ValueError(f"ids must be [B, T], got shape {ids.shape}")
    B, T = ids.shape
    C, H, eps = config.n_embd, config.n_head, config.layer_norm_epsilon
    D = C // H
    if T > config.n_positions:
        raise ValueError(f"T={T} exceeds n_positions={config.n_positions}")

    pos = np.arange(T)  # [T]
    x = embedding(ids, W["wte"], W["wpe"], pos)  # [B, T, C]
    for i in range(config.n_layer):
        p = f"h.{i}."
        # --- attention ---
        h = layernorm(x, W[p + "ln_1.w"], W[p + "ln_1.b"], eps)  # [B, T, C]
        qkv = linear(h, W[p + "attn.w"], W[p + "attn.b"])  # [B, T, 3C]
        q, k, v = np.split(qkv, 3, axis=-1)  # 3 x [B, T, C]
        q = q.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # [B, H, T, D]
        k = k.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # [B, H, T, D]
        v = v.reshape(B, T, H, D).transpose(0, 2, 1, 3)  # [B, H, T, D]
        y = causal_attention(q, k, v)  # [B, H, T, D]
        y = y.transpose(0, 2, 1, 3).reshape(B, T, C)  # [B, T, C]
        x = x + linear(y, W[p + "attn_proj.w"], W[p + "attn_proj.b"])  # [B, T, C]
        # --- MLP ---
        h = layernorm(x, W[p + "ln_2.w"], W[p + "ln_2.b"], eps)  # [B, T, C]
        h = gelu_tanh(linear(h, W[p + "fc.w"], W[p + "fc.b"]))  # [B, T, 4C]
        x = x + linear(h, W[p + "mlp_proj.w"], W[p + "mlp_proj.b"])  # [B, T, C]
    return layernorm(x, W["ln_f.w"], W["ln_f.b"], eps)  # [B, T, C]


def gpt2_forward(weights: Mapping[str, Any], config, ids) -> np.ndarray:
    """Logits float64 [B, T, V] for ids [B, T]; uses ``weights["lm_head"]`` if
    present, else the tied ``wte``."""
    x = gpt2_hidden(weights, config, ids)  # [B, T, C]
    lm_head = weights["lm_head"] if "lm_head" in weights else weights["wte"]
    return linear(x, lm_head)  # [B, T, V]


# ----------------------------------------------------------------------------
# Sampling


_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_MASK32 = 0xFFFFFFFF


def philox4x32_10(counter, key) -> tuple[int, int, int, int]:
    """Philox4x32-10 (Salmon et al., SC'11): four 32-bit words from a 4-word counter and
    a 2-word key, as src_cu/common.cuh computes it."""
    c0, c1, c2, c3 = (int(c) & _MASK32 for c in counter)
    k0, k1 = (int(k) & _MASK32 for k in key)
    for _ in range(10):
        p0, p1 = _PHILOX_M[0] * c0, _PHILOX_M[1] * c2
        hi0, lo0 = p0 >> 32, p0 & _MASK32
        hi1, lo1 = p1 >> 32, p1 & _MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _MASK32, (k1 + _PHILOX_W[1]) & _MASK32
    return c0, c1, c2, c3


def sample_uniform(seed: int, offset: int, row: int) -> float:
    """The U[0, 1) number the sampling kernel draws for ``row`` at counter ``offset``."""
    word = philox4x32_10((offset & _MASK32, offset >> 32, row, 0), (seed & _MASK32, seed >> 32))[0]
    return (word >> 8) / 2.0**24


def sampling_probs(logits, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> np.ndarray:
    """The distribution the sampling kernel draws from, for logits [V] (float64 [V]):
    softmax(logits / temperature) restricted to the top_k largest (ties at the k-th value
    kept), renormalized, then to the smallest set of largest probabilities whose mass
    reaches top_p (ties kept), renormalized."""
    z = _f64(logits).reshape(-1) / temperature
    keep = np.ones(z.shape, dtype=bool)
    if top_k is not None and 0 < top_k < z.size:
        kth = np.sort(z)[::-1][top_k - 1]
        keep &= z >= kth
    p = np.where(keep, np.exp(z - z.max()), 0.0)
    p /= p.sum()
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        mass = np.cumsum(p[order])
        n = int(np.searchsorted(mass, top_p * mass[-1] * (1 - 1e-12))) + 1  # first prefix reaching top_p
        boundary = p[order[min(n, p.size) - 1]]
        keep &= p >= boundary
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def sample(logits, u: float, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None) -> int:
    """Inverse-CDF choice, in index order, of the uniform number ``u`` under
    :func:`sampling_probs`."""
    cdf = np.cumsum(sampling_probs(logits, temperature, top_k, top_p))
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), cdf.size - 1))
