"""Text in, text out: the ``generate`` and ``stream`` functions and the model cache."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from .model import GPT2, dtype_name
from .tokenizer import Tokenizer, load_tokenizer

_models: dict[tuple, GPT2] = {}


def load_model(model: str | GPT2 = "gpt2", dtype="float32", random_weights: bool = False) -> GPT2:
    """A GPT2 from a Hub name or local directory (kept for later calls), or a random one of
    that size when ``random_weights``; a GPT2 instance is returned as is."""
    if isinstance(model, GPT2):
        return model
    key = (str(model), dtype_name(dtype), random_weights)
    if key not in _models:
        _models[key] = GPT2.random(model, dtype) if random_weights else GPT2.from_pretrained(model, dtype)
    return _models[key]


def _tokenizer_for(model, tokenizer) -> Tokenizer:
    if tokenizer is not None:
        return tokenizer
    return load_tokenizer(model if isinstance(model, str) else "gpt2")


def _encode(tok: Tokenizer, prompts: Sequence[str]) -> list[list[int]]:
    encoded = []
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"prompt {i} must be a str, got {type(p).__name__}")
        ids = tok.encode(p)
        if not ids:
            raise ValueError(f"prompt {i} is empty: it needs at least one token")
        encoded.append(ids)
    return encoded


def _stop_at(text: str, stop: Sequence[str]) -> int | None:
    hits = [text.find(s) for s in stop if s and s in text]
    return min(hits) if hits else None


def _text_steps(model, tok, prompts, max_new_tokens, stop, eos_token_id, reads_all: bool = False,
                **kwargs) -> Iterator[list[str]]:
    """For each decoding step, the new text of each prompt ('' when nothing new). ``reads_all``:
    the caller reads every item (generate), so that without an end-of-text token or a stop
    string no step can end the call early (the engine's fixed-length graphs).

    Inputs are checked now, before the iterator is returned."""
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) for s in stop):
        raise TypeError("stop must be a str or a list of str")
    ids = _encode(tok, prompts)
    eos = tok.eos_token_id if eos_token_id == "default" else eos_token_id
    if reads_all and not stop:  # (the engine takes its fixed-length graphs only without an end-of-text token)
        steps = model._stream(ids, max_new_tokens, eos_token_id=eos, fixed_length=True, **kwargs)
    else:
        steps = model.stream(ids, max_new_tokens, eos_token_id=eos, **kwargs)
    return _pieces(tok, steps, len(prompts), stop, eos)


def _pieces(tok, steps, n, stop, eos) -> Iterator[list[str]]:
    new = [[] for _ in range(n)]
    emitted = [""] * n
    finished = [False] * n
    for step in steps:
        pieces = []
        for b, t in enumerate(step):
            if t is None or finished[b]:
                pieces.append("")
                continue
            if t == eos:
                finished[b] = True
                pieces.append("")
                continue
            new[b].append(t)
            text = tok.decode(new[b])
            cut = _stop_at(text, stop)
            if cut is not None:
                text, finished[b] = text[:cut], True
            elif text.endswith("\ufffd"):  # a multi-byte character is not complete yet
                pieces.append("")
                continue
            pieces.append(text[len(emitted[b]):])
            emitted[b] = text
        yield pieces
        if all(finished):
            return
    # the last token may have left a multi-byte character incomplete: flush what there is
    tail = ["" if finished[b] else tok.decode(new[b])[len(emitted[b]):] for b in range(n)]
    if any(tail):
        yield tail


def generate(prompt: str | Sequence[str], model: str | GPT2 = "gpt2", *, max_new_tokens: int | Sequence[int] = 32,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, seed: int | None = None, stop: str | Sequence[str] | None = None,
             eos_token_id: int | None | str = "default", dtype="float32", use_cache: bool = True,
             cuda_graph: bool = True, kv_cache_dtype: str | None = None, random_weights: bool = False,
             tokenizer: Tokenizer | None = None, max_batch: int | None = None, progress: bool | None = None):
    """Continue ``prompt`` (a str, or a list of str run as one batch) with GPT-2.

    Returns the prompt followed by its continuation (a str, or a list of str). ``model`` is
    a Hub name, a local directory or a :class:`GPT2`. Generation stops after
    ``max_new_tokens``, at the end-of-text token (``eos_token_id=None`` disables it), or
    where a ``stop`` string appears (the text is cut before it). Greedy unless
    ``do_sample``; the same ``seed`` gives the same text. ``kv_cache_dtype`` 'int8' or
    'fp8' quantizes the KV cache (see :meth:`GPT2.generate`). ``max_batch``: continuous
    batching of a long list of prompts through that many slots, a slot refilled as soon
    as its sequence ends; ``max_new_tokens`` may then be one per prompt; ``progress``
    shows a progress bar (default: when there are more prompts than slots).
    """
    single = isinstance(prompt, str)
    prompts = [prompt] if single else list(prompt)
    if not prompts:
        raise ValueError("no prompt given")
    net = load_model(model, dtype, random_weights)
    tok = _tokenizer_for(model, tokenizer)
    if max_batch is not None or not isinstance(max_new_tokens, int):
        texts = _generate_continuous(net, tok, prompts, max_new_tokens, stop, eos_token_id, max_batch, progress,
                                     do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                                     seed=seed, use_cache=use_cache, cuda_graph=cuda_graph,
                                     kv_cache_dtype=kv_cache_dtype)
        return texts[0] if single else texts
    texts = list(prompts)
    for pieces in _text_steps(net, tok, prompts, max_new_tokens, stop, eos_token_id, reads_all=True,
                              do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                              use_cache=use_cache, cuda_graph=cuda_graph, kv_cache_dtype=kv_cache_dtype):
        texts = [t + p for t, p in zip(texts, pieces)]
    return texts[0] if single else texts


def _generate_continuous(net, tok, prompts, max_new_tokens, stop, eos_token_id, max_batch, progress, **kwargs):
    """generate() through the engine's continuous batching: a prompt's slot is freed as soon
    as its text reaches a stop string."""
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) for s in stop):
        raise TypeError("stop must be a str or a list of str")
    ids = _encode(tok, prompts)
    eos = tok.eos_token_id if eos_token_id == "default" else eos_token_id
    new: list[list[int]] = [[] for _ in prompts]

    def at_stop(p: int, t: int) -> bool:
        if t == eos:
            return False  # (the engine ends it)
        new[p].append(t)
        return bool(stop) and _stop_at(tok.decode(new[p]), stop) is not None

    seqs = net._generate_continuous(ids, max_new_tokens, eos_token_id=eos, max_batch=max_batch, progress=progress,
                                    stop=at_stop if stop else None, **kwargs)
    texts = []
    for prompt, row, seq in zip(prompts, ids, seqs):
        out = seq[len(row):]
        if eos is not None and eos in out:
            out = out[:out.index(eos)]
        text = tok.decode(out)
        cut = _stop_at(text, stop)
        texts.append(prompt + (text if cut is None else text[:cut]))
    return texts


def stream(prompt: str, model: str | GPT2 = "gpt2", **kwargs) -> Iterator[str]:
    """Like :func:`generate` for one prompt, but yields the new text piece by piece as the
    tokens are produced (the prompt itself is not yielded)."""
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    max_new_tokens = kwargs.pop("max_new_tokens", 32)
    stop = kwargs.pop("stop", None)
    eos_token_id = kwargs.pop("eos_token_id", "default")
    net = load_model(model, kwargs.pop("dtype", "float32"), kwargs.pop("random_weights", False))
    tok = _tokenizer_for(model, kwargs.pop("tokenizer", None))
    steps = _text_steps(net, tok, [prompt], max_new_tokens, stop, eos_token_id, **kwargs)
    return (pieces[0] for pieces in steps if pieces[0])
