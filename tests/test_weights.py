"""CPU tests of gpt2_cupy.config and gpt2_cupy.weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from gpt2_cupy.config import SIZES, GPT2Config
from gpt2_cupy.weights import expected_keys, expected_shapes, map_hf_state_dict

TINY = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=101, n_positions=32)
C, V, P = TINY["n_embd"], TINY["vocab_size"], TINY["n_positions"]


def _randomize(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2)
    return model.eval()


def _hf_config(**overrides):
    return transformers.GPT2Config(**dict(TINY, bos_token_id=0, eos_token_id=0, **overrides))


def _lm_model(tie=True, seed=0):
    return _randomize(transformers.GPT2LMHeadModel(_hf_config(tie_word_embeddings=tie)), seed)


@pytest.fixture(scope="module")
def lm_model():
    return _lm_model()


@pytest.fixture(scope="module")
def cfg():
    return GPT2Config(**TINY)


# ----------------------------------------------------------------------------
# Mapping


def test_keys_and_shapes(lm_model, cfg):
    out = map_hf_state_dict(lm_model.state_dict(), cfg)
    keys = ["wte", "wpe", "ln_f.w", "ln_f.b"]
    for i in range(cfg.n_layer):
        keys += [
            f"h.{i}.{s}"
            for s in (
                "ln_1.w", "ln_1.b", "attn.w", "attn.b", "attn_proj.w", "attn_proj.b",
                "ln_2.w", "ln_2.b", "fc.w", "fc.b", "mlp_proj.w", "mlp_proj.b",
            )
        ]
    assert set(out) == set(keys)
    assert set(expected_keys(cfg)) == set(keys)
    assert len(expected_keys(cfg)) == len(keys)
    shapes = {k: tuple(v.shape) for k, v in out.items()}
    assert shapes == expected_shapes(cfg)
    assert shapes["wte"] == (V, C)
    assert shapes["wpe"] == (P, C)
    assert shapes["ln_f.w"] == shapes["ln_f.b"] == (C,)
    for i in range(cfg.n_layer):
        assert shapes[f"h.{i}.attn.w"] == (3 * C, C)
        assert shapes[f"h.{i}.attn.b"] == (3 * C,)
        assert shapes[f"h.{i}.attn_proj.w"] == (C, C)
        assert shapes[f"h.{i}.fc.w"] == (4 * C, C)
        assert shapes[f"h.{i}.fc.b"] == (4 * C,)
        assert shapes[f"h.{i}.mlp_proj.w"] == (C, 4 * C)
        assert shapes[f"h.{i}.mlp_proj.b"] == (C,)
    for v in out.values():
        assert v.dtype == torch.float32
        assert v.is_contiguous()
        assert not v.requires_grad


def test_values_and_transposition(lm_model, cfg):
    out = map_hf_state_dict(lm_model.state_dict(), cfg)
    tr = lm_model.transformer
    assert torch.equal(out["wte"], tr.wte.weight)
    assert torch.equal(out["wpe"], tr.wpe.weight)
    assert torch.equal(out["ln_f.w"], tr.ln_f.weight)
    assert torch.equal(out["ln_f.b"], tr.ln_f.bias)
    for i, block in enumerate(tr.h):
        p = f"h.{i}."
        assert torch.equal(out[p + "ln_1.w"], block.ln_1.weight)
        assert torch.equal(out[p + "ln_1.b"], block.ln_1.bias)
        assert torch.equal(out[p + "ln_2.w"], block.ln_2.weight)
        assert torch.equal(out[p + "ln_2.b"], block.ln_2.bias)
        assert torch.equal(out[p + "attn.w"], block.attn.c_attn.weight.t())
        assert torch.equal(out[p + "attn.b"], block.attn.c_attn.bias)
        assert torch.equal(out[p + "attn_proj.w"], block.attn.c_proj.weight.t())
        assert torch.equal(out[p + "attn_proj.b"], block.attn.c_proj.bias)
        assert torch.equal(out[p + "fc.w"], block.mlp.c_fc.weight.t())
        assert torch.equal(out[p + "fc.b"], block.mlp.c_fc.bias)
        assert torch.equal(out[p + "mlp_proj.w"], block.mlp.c_proj.weight.t())
        assert torch.equal(out[p + "mlp_proj.b"], block.mlp.c_proj.bias)


def test_linear_layout_matches_conv1d(lm_model, cfg):
    """x @ W.T + b with the mapped [out, in] weights reproduces each HF Conv1D."""
    out = map_hf_state_dict(lm_model.state_dict(), cfg)
    block = lm_model.transformer.h[1]
    x = torch.randn(3, C, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(torch.nn.functional.linear(x, out["h.1.attn.w"], out["h.1.attn.b"]), block.attn.c_attn(x))
        torch.testing.assert_close(torch.nn.functional.linear(x, out["h.1.fc.w"], out["h.1.fc.b"]), block.mlp.c_fc(x))
        h = torch.randn(3, 4 * C, generator=torch.Generator().manual_seed(2))
        torch.testing.assert_close(torch.nn.functional.linear(h, out["h.1.mlp_proj.w"], out["h.1.mlp_proj.b"]), block.mlp.c_proj(h))


def test_transposed_weights_do_not_alias_model(lm_model, cfg):
    sd = lm_model.state_dict()
    out = map_hf_state_dict(sd, cfg)
    assert out["h.0.fc.w"].data_ptr() != sd["transformer.h.0.mlp.c_fc.weight"].data_ptr()


def test_tied_lm_head_omitted(lm_model, cfg):
    sd = lm_model.state_dict()
    assert "lm_head.weight" in sd  # transformers keeps the tied key in state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["transformer.wte.weight"].data_ptr()
    assert "lm_head" not in map_hf_state_dict(sd, cfg)
    # Same values but separate storage (e.g. loaded from a checkpoint) also counts as tied.
    sd2 = {k: v.clone() for k, v in sd.items()}
    assert sd2["lm_head.weight"].data_ptr() != sd2["transformer.wte.weight"].data_ptr()
    assert "lm_head" not in map_hf_state_dict(sd2, cfg)
    # No lm_head key at all (GPT2Model / safetensors without the tied key).
    sd3 = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    assert "lm_head" not in map_hf_state_dict(sd3, cfg)


def test_untied_lm_head_included(cfg):
    model = _lm_model(tie=False, seed=3)
    sd = model.state_dict()
    assert not torch.equal(sd["lm_head.weight"], sd["transformer.wte.weight"])
    out = map_hf_state_dict(sd, cfg)
    assert torch.equal(out["lm_head"], model.lm_head.weight)
    assert tuple(out["lm_head"].shape) == (V, C)
    assert torch.equal(out["wte"], model.transformer.wte.weight)


def test_accepts_gpt2model_state_dict(lm_model, cfg):
    base = _randomize(transformers.GPT2Model(_hf_config()), seed=5)
    sd = base.state_dict()
    assert not any(k.startswith("transformer.") for k in sd)
    out = map_hf_state_dict(sd, cfg)
    assert set(out) == set(expected_keys(cfg))
    assert torch.equal(out["h.0.fc.w"], base.h[0].mlp.c_fc.weight.t())
    # Stripping the prefix of an LM head model state dict works too.
    sd_lm = {k.removeprefix("transformer."): v for k, v in lm_model.state_dict().items()}
    ref = map_hf_state_dict(lm_model.state_dict(), cfg)
    out2 = map_hf_state_dict(sd_lm, cfg)
    assert set(out2) == set(ref)
    assert all(torch.equal(out2[k], ref[k]) for k in ref)


def test_ignores_attention_buffers(lm_model, cfg):
    sd = dict(lm_model.state_dict())
    for i in range(cfg.n_layer):
        sd[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, P, P, dtype=torch.bool))
        sd[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    out = map_hf_state_dict(sd, cfg)
    assert set(out) == set(expected_keys(cfg))


def test_missing_key_raises(lm_model, cfg):
    sd = dict(lm_model.state_dict())
    del sd["transformer.h.1.mlp.c_fc.bias"]
    with pytest.raises(KeyError, match=r"h\.1\.mlp\.c_fc\.bias"):
        map_hf_state_dict(sd, cfg)
    sd = dict(lm_model.state_dict())
    del sd["transformer.wpe.weight"]
    with pytest.raises(KeyError, match="wpe"):
        map_hf_state_dict(sd, cfg)


def test_missing_layer_raises(lm_model, cfg):
    deeper = dataclasses.replace(cfg, n_layer=3)
    with pytest.raises(KeyError, match=r"h\.2\."):
        map_hf_state_dict(lm_model.state_dict(), deeper)


def test_wrong_shape_raises(lm_model, cfg):
    sd = dict(lm_model.state_dict())
    sd["transformer.h.0.attn.c_attn.weight"] = torch.zeros(3 * C, C)  # not transposed
    with pytest.raises(ValueError) as info:
        map_hf_state_dict(sd, cfg)
    msg = str(info.value)
    assert "h.0.attn.c_attn.weight" in msg
    assert str((3 * C, C)) in msg and str((C, 3 * C)) in msg

    sd = dict(lm_model.state_dict())
    sd["transformer.ln_f.bias"] = torch.zeros(C + 1)
    with pytest.raises(ValueError, match=r"ln_f\.bias.*\(65,\).*\(64,\)"):
        map_hf_state_dict(sd, cfg)

    # Config with the wrong vocab size.
    with pytest.raises(ValueError, match="wte"):
        map_hf_state_dict(lm_model.state_dict(), dataclasses.replace(cfg, vocab_size=V + 1))

    sd = dict(lm_model.state_dict())
    sd["lm_head.weight"] = torch.zeros(V + 3, C)
    with pytest.raises(ValueError, match="lm_head"):
        map_hf_state_dict(sd, cfg)


def test_unexpected_key_raises(lm_model, cfg):
    sd = dict(lm_model.state_dict())
    sd["transformer.h.0.attn.q_proj.weight"] = torch.zeros(C, C)
    sd["score.weight"] = torch.zeros(2, C)
    with pytest.raises(ValueError) as info:
        map_hf_state_dict(sd, cfg)
    assert "h.0.attn.q_proj.weight" in str(info.value)
    assert "score.weight" in str(info.value)
    # Extra layers beyond config.n_layer are also unexpected.
    with pytest.raises(ValueError, match=r"h\.1\."):
        map_hf_state_dict(lm_model.state_dict(), dataclasses.replace(cfg, n_layer=1))


def test_duplicate_prefixed_key_raises(lm_model, cfg):
    sd = dict(lm_model.state_dict())
    sd["wte.weight"] = sd["transformer.wte.weight"]
    with pytest.raises(ValueError, match="duplicate"):
        map_hf_state_dict(sd, cfg)


def test_keeps_dtype(cfg):
    model = _lm_model().double()
    out = map_hf_state_dict(model.state_dict(), cfg)
    assert all(v.dtype == torch.float64 for v in out.values())


# ----------------------------------------------------------------------------
# Config


def test_config_basics():
    c = GPT2Config(n_layer=2, n_head=4, n_embd=64)
    assert c.head_dim == 16
    assert c.vocab_size == 50257 and c.n_positions == 1024 and c.layer_norm_epsilon == 1e-5
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.n_layer = 3
    with pytest.raises(ValueError):
        GPT2Config(n_layer=2, n_head=5, n_embd=64)


def test_from_hf_round_trip():
    hf = _hf_config(layer_norm_epsilon=1e-6)
    c = GPT2Config.from_hf(hf)
    assert c == GPT2Config(**TINY, layer_norm_epsilon=1e-6)
    hf2 = c.to_hf()
    assert isinstance(hf2, transformers.GPT2Config)
    for name in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions", "layer_norm_epsilon"):
        assert getattr(hf2, name) == getattr(hf, name)
    assert hf2.activation_function == "gelu_new"
    assert GPT2Config.from_hf(hf2) == c
    for name, size in SIZES.items():
        assert GPT2Config.from_hf(size.to_hf()) == size, name
    # gelu_pytorch_tanh is the same function
    assert GPT2Config.from_hf(_hf_config(activation_function="gelu_pytorch_tanh")) == GPT2Config(**TINY)
    assert GPT2Config.from_hf(_hf_config(n_inner=4 * C)) == GPT2Config(**TINY)


def test_sizes():
    want = {
        "gpt2": (12, 12, 768),
        "gpt2-medium": (24, 16, 1024),
        "gpt2-large": (36, 20, 1280),
        "gpt2-xl": (48, 25, 1600),
        "distilgpt2": (6, 12, 768),
    }
    assert set(SIZES) == set(want)
    for name, (n_layer, n_head, n_embd) in want.items():
        s = SIZES[name]
        assert (s.n_layer, s.n_head, s.n_embd) == (n_layer, n_head, n_embd), name
        assert s.vocab_size == 50257 and s.n_positions == 1024 and s.layer_norm_epsilon == 1e-5
        assert s.head_dim == 64


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(activation_function="relu"), "activation_function"),
        (dict(activation_function="gelu"), "activation_function"),
        (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
        (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
        (dict(add_cross_attention=True), "add_cross_attention"),
        (dict(n_inner=100), "n_inner"),
        (dict(scale_attn_weights=False), "scale_attn_weights"),
    ],
)
def test_unsupported_config_raises(overrides, match):
    with pytest.raises(ValueError, match=match):
        GPT2Config.from_hf(_hf_config(**overrides))


def test_indivisible_heads_raise():
    hf = _hf_config()
    hf.n_head = 5  # the HF config itself does not validate this
    with pytest.raises(ValueError, match="divisible"):
        GPT2Config.from_hf(hf)


def test_config_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, gpt2_cupy.config; print('torch' in sys.modules, 'transformers' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=_repo_root())
    assert res.stdout.strip() == "False False"


def _repo_root():
    import pathlib

    return str(pathlib.Path(__file__).resolve().parents[1])
