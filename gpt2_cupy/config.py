"""GPT-2 model hyper-parameters (no torch/transformers import at module level)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Activation names that mean the tanh-approximated GELU used by GPT-2.
SUPPORTED_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class GPT2Config:
    """Shape of a GPT-2 model. Only the standard GPT-2 architecture is supported:
    pre-LayerNorm blocks, tanh GELU, MLP width 4 * n_embd, attention scaled by
    1/sqrt(head_dim), learned absolute position embeddings."""

    n_layer: int
    n_head: int
    n_embd: int
    vocab_size: int = 50257
    n_positions: int = 1024
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not self.layer_norm_epsilon > 0:
            raise ValueError(f"layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_inner(self) -> int:
        """MLP hidden width (always 4 * n_embd)."""
        return 4 * self.n_embd

    @classmethod
    def from_hf(cls, hf_config: Any) -> "GPT2Config":
        """Build from a ``transformers.GPT2Config``; raise ValueError on settings
        this implementation does not support."""
        problems = []
        act = getattr(hf_config, "activation_function", "gelu_new")
        if act not in SUPPORTED_ACTIVATIONS:
            problems.append(
                f"activation_function={act!r} (supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
            )
        n_embd, n_head = int(hf_config.n_embd), int(hf_config.n_head)
        if n_head <= 0 or n_embd % n_head != 0:
            problems.append(f"n_embd={n_embd} not divisible by n_head={n_head}")
        n_inner = getattr(hf_config, "n_inner", None)
        if n_inner is not None and int(n_inner) != 4 * n_embd:
            problems.append(f"n_inner={n_inner} (only 4 * n_embd = {4 * n_embd} is supported)")
        if getattr(hf_config, "scale_attn_by_inverse_layer_idx", False):
            problems.append("scale_attn_by_inverse_layer_idx=True")
        if getattr(hf_config, "reorder_and_upcast_attn", False):
            problems.append("reorder_and_upcast_attn=True")
        if getattr(hf_config, "add_cross_attention", False):
            problems.append("add_cross_attention=True")
        if not getattr(hf_config, "scale_attn_weights", True):
            problems.append("scale_attn_weights=False")
        if getattr(hf_config, "is_encoder_decoder", False):
            problems.append("is_encoder_decoder=True")
        if problems:
            raise ValueError("unsupported GPT-2 config: " + "; ".join(problems))
        return cls(
            n_layer=int(hf_config.n_layer),
            n_head=n_head,
            n_embd=n_embd,
            vocab_size=int(hf_config.vocab_size),
            n_positions=int(hf_config.n_positions),
            layer_norm_epsilon=float(hf_config.layer_norm_epsilon),
        )

    def to_hf(self, **kwargs: Any):
        """Return an equivalent ``transformers.GPT2Config`` (extra kwargs are passed through)."""
        import transformers

        params = dict(
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            vocab_size=self.vocab_size,
            n_positions=self.n_positions,
            layer_norm_epsilon=self.layer_norm_epsilon,
            activation_function="gelu_new",
        )
        params.update(kwargs)
        return transformers.GPT2Config(**params)


SIZES: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),
    "distilgpt2": GPT2Config(n_layer=6, n_head=12, n_embd=768),
}
