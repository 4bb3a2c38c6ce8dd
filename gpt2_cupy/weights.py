"""Explicit Hugging Face GPT-2 -> gpt2-cupy weight mapping (torch level).

HF GPT-2 uses ``Conv1D`` layers that store weights as ``[in, out]`` and compute
``x @ W + b``. gpt2-cupy stores every linear weight as ``[out, in]`` (like
``torch.nn.Linear``) and computes ``x @ W.T + b``, so all four linear weights of
a block are transposed here with ``.t().contiguous()``.

Output keys (C = n_embd, V = vocab_size, P = n_positions)::

    wte [V, C]   wpe [P, C]   ln_f.w [C]   ln_f.b [C]
    h.{i}.ln_1.w [C]          h.{i}.ln_1.b [C]
    h.{i}.attn.w [3C, C]      h.{i}.attn.b [3C]      (q, k, v stacked along out)
    h.{i}.attn_proj.w [C, C]  h.{i}.attn_proj.b [C]
    h.{i}.ln_2.w [C]          h.{i}.ln_2.b [C]
    h.{i}.fc.w [4C, C]        h.{i}.fc.b [4C]
    h.{i}.mlp_proj.w [C, 4C]  h.{i}.mlp_proj.b [C]
    lm_head [V, C]            only when untied from wte
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

from .config import GPT2Config

_PREFIX = "transformer."

# Non-parameter buffers that some transformers versions put in the state dict.
_IGNORED_BUFFER_RE = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")

# Per-layer (our name, HF name without "h.{i}." prefix, transpose?)
_LAYER_MAP: tuple[tuple[str, str, bool], ...] = (
    ("ln_1.w", "ln_1.weight", False),
    ("ln_1.b", "ln_1.bias", False),
    ("attn.w", "attn.c_attn.weight", True),
    ("attn.b", "attn.c_attn.bias", False),
    ("attn_proj.w", "attn.c_proj.weight", True),
    ("attn_proj.b", "attn.c_proj.bias", False),
    ("ln_2.w", "ln_2.weight", False),
    ("ln_2.b", "ln_2.bias", False),
    ("fc.w", "mlp.c_fc.weight", True),
    ("fc.b", "mlp.c_fc.bias", False),
    ("mlp_proj.w", "mlp.c_proj.weight", True),
    ("mlp_proj.b", "mlp.c_proj.bias", False),
)

_TOP_MAP: tuple[tuple[str, str], ...] = (
    ("wte", "wte.weight"),
    ("wpe", "wpe.weight"),
    ("ln_f.w", "ln_f.weight"),
    ("ln_f.b", "ln_f.bias"),
)

LAYER_KEYS: tuple[str, ...] = tuple(name for name, _, _ in _LAYER_MAP)
"""Per-layer key suffixes, in order; the full key is f"h.{i}.{suffix}"."""


def expected_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Output key -> shape for ``config`` (excluding the optional ``lm_head``)."""
    C, V, P = config.n_embd, config.vocab_size, config.n_positions
    layer = {
        "ln_1.w": (C,),
        "ln_1.b": (C,),
        "attn.w": (3 * C, C),
        "attn.b": (3 * C,),
        "attn_proj.w": (C, C),
        "attn_proj.b": (C,),
        "ln_2.w": (C,),
        "ln_2.b": (C,),
        "fc.w": (4 * C, C),
        "fc.b": (4 * C,),
        "mlp_proj.w": (C, 4 * C),
        "mlp_proj.b": (C,),
    }
    shapes: dict[str, tuple[int, ...]] = {
        "wte": (V, C),
        "wpe": (P, C),
        "ln_f.w": (C,),
        "ln_f.b": (C,),
    }
    for i in range(config.n_layer):
        for suffix in LAYER_KEYS:
            shapes[f"h.{i}.{suffix}"] = layer[suffix]
    return shapes


def expected_keys(config: GPT2Config) -> list[str]:
    """Required output keys for ``config`` (``lm_head`` is optional, not listed)."""
    return list(expected_shapes(config))


def _strip_prefix(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        name = key[len(_PREFIX):] if key.startswith(_PREFIX) else key
        if name in out:
            raise ValueError(f"duplicate key {name!r} (present with and without {_PREFIX!r} prefix)")
        out[name] = value
    return out


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    if (
        a.device.type != "meta"
        and a.data_ptr() == b.data_ptr()
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
    ):
        return True
    return bool(torch.equal(a, b))


def map_hf_state_dict(
    state_dict: Mapping[str, torch.Tensor], config: GPT2Config
) -> dict[str, torch.Tensor]:
    """Map a HF ``GPT2LMHeadModel`` / ``GPT2Model`` state dict to gpt2-cupy names.

    Returns detached torch tensors with the input dtype/device; linear weights
    are new contiguous ``[out, in]`` tensors, the others share storage with the
    input. Raises KeyError for a missing key, ValueError for a wrong shape or
    leftover parameter keys.
    """
    sd = _strip_prefix(state_dict)
    shapes = expected_shapes(config)
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}

    def take(hf_key: str, our_key: str, transpose: bool) -> None:
        if hf_key not in sd:
            raise KeyError(f"missing HF weight {hf_key!r} (for {our_key!r})")
        tensor = sd[hf_key]
        want = shapes[our_key]
        # Conv1D stores [in, out]: the HF shape is the transpose of ours.
        hf_want = tuple(reversed(want)) if transpose else want
        got = tuple(tensor.shape)
        if got != hf_want:
            raise ValueError(
                f"HF weight {hf_key!r} (for {our_key!r}) has shape {got}, expected {hf_want}"
            )
        tensor = tensor.detach()
        out[our_key] = tensor.t().contiguous() if transpose else tensor
        used.add(hf_key)

    for our_key, hf_key in _TOP_MAP:
        take(hf_key, our_key, False)
    for i in range(config.n_layer):
        for suffix, hf_suffix, transpose in _LAYER_MAP:
            take(f"h.{i}.{hf_suffix}", f"h.{i}.{suffix}", transpose)

    if "lm_head.weight" in sd:
        used.add("lm_head.weight")
        lm_head = sd["lm_head.weight"].detach()
        want = shapes["wte"]
        if tuple(lm_head.shape) != want:
            raise ValueError(
                f"HF weight 'lm_head.weight' (for 'lm_head') has shape "
                f"{tuple(lm_head.shape)}, expected {want}"
            )
        if not _same_values(lm_head, sd["wte.weight"].detach()):
            out["lm_head"] = lm_head
    if "lm_head.bias" in sd:
        raise ValueError("unexpected 'lm_head.bias': GPT-2's lm_head has no bias")

    leftover = sorted(
        k for k in sd if k not in used and not _IGNORED_BUFFER_RE.match(k)
    )
    if leftover:
        raise ValueError(f"unexpected keys in GPT-2 state dict: {leftover}")
    return out


def hf_to_cupy(hf_model, config: GPT2Config, dtype: torch.dtype) -> dict:
    """The weights of an in-memory transformers GPT-2 model as CuPy arrays on the current
    CuPy device, in gpt2-cupy names and layouts.

    torch moves each tensor to the GPU and casts it (the transposes of the Conv1D weights
    happen there too); each result crosses into CuPy by DLPack, sharing its memory.
    """
    import cupy

    if not torch.cuda.is_available():
        raise RuntimeError(
            "this torch build has no CUDA support, so weights cannot be handed to CuPy on the GPU; "
            "install a CUDA build of torch (pip install torch)"
        )
    device = torch.device("cuda", cupy.cuda.Device().id)
    with torch.no_grad():
        state = {k: v.detach().to(device=device, dtype=dtype) for k, v in hf_model.state_dict().items()}
        mapped = map_hf_state_dict(state, config)
        mapped = {k: v.contiguous() for k, v in mapped.items()}
    torch.cuda.synchronize(device)
    return {k: cupy.from_dlpack(v) for k, v in mapped.items()}
