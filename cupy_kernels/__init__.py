"""gpt2-cupy's CUDA kernels, compiled at run time by NVRTC and callable on their own.

Every function takes CuPy arrays or any GPU ``__dlpack__`` tensor (no copy), launches on
the current stream without synchronizing, and returns CuPy arrays. Storage dtypes are
float32, float16 and bfloat16; arithmetic and reductions are float32.
"""

from .attention import causal_attention
from .decode_attention import decode_attention
from .decode_step import decode_step
from .decode_step import unsupported as decode_step_unsupported
from .embedding import embedding
from .fixed_attention import fixed_attention
from .flash_attention import flash_attention
from .gemm import gemm
from .gelu import bias_add, bias_gelu
from .kv_cache import kv_advance, kv_append, kv_storage_dtype
from .layernorm import layernorm, layernorm_residual
from .linear import fold_layernorm, linear, linear_argmax, linear_tiles, quantize_rows, screens_float, unpack_rows
from .read_floor import read_floor, read_under_load
from .sampling import argmax, publish_tokens, sample
from .softmax import softmax

__all__ = [
    "argmax",
    "bias_add",
    "bias_gelu",
    "causal_attention",
    "decode_attention",
    "decode_step",
    "decode_step_unsupported",
    "embedding",
    "fixed_attention",
    "flash_attention",
    "fold_layernorm",
    "gemm",
    "kv_advance",
    "kv_append",
    "kv_storage_dtype",
    "layernorm",
    "layernorm_residual",
    "linear",
    "linear_argmax",
    "linear_tiles",
    "quantize_rows",
    "screens_float",
    "unpack_rows",
    "publish_tokens",
    "read_floor",
    "read_under_load",
    "sample",
    "softmax",
]
