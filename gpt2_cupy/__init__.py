"""gpt2-cupy: GPT-2 inference on NVIDIA GPUs with CuPy and hand-written CUDA kernels.

    from gpt2_cupy import generate
    print(generate("Hello, I'm a language model,", max_new_tokens=64))
"""

from .config import SIZES, GPT2Config
from .generation import generate, load_model, stream
from .model import GPT2, KVCache
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["GPT2", "GPT2Config", "KVCache", "SIZES", "Tokenizer", "generate", "load_model", "load_tokenizer", "stream"]
