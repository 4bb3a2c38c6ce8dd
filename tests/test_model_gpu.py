"""The whole model on the GPU against transformers (random weights at the real sizes)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cupy_kernels import _build  # noqa: E402
from gpt2_cupy import GPT2, SIZES, generate, stream  # noqa: E402
from gpt2_cupy.engine import LOOKAHEAD, MAX_SESSIONS  # noqa: E402

PROMPT = [15496, 11, 314, 1101, 257, 3303, 2746, 11]  # "Hello, I'm a language model,"


def hf_model(size: str, seed: int = 0, perturb: bool = False):
    torch.manual_seed(seed)
    with torch.device("cuda"):
        hf = transformers.GPT2LMHeadModel(SIZES[size].to_hf())
    hf.eval()
    if perturb:  # non-zero biases, non-unit layernorm: a mapping mistake can't hide
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.1)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


@pytest.fixture(scope="module")
def small():
    hf = hf_model("gpt2", perturb=True)
    return hf, GPT2.from_hf(hf, "float32")


def recorded_steps(model, sampling=None) -> int:
    """Decode steps a session of ``model`` records: the step, and where a graph runs several
    (engine.STEPS_PER_GRAPH) its chained copy (Session.step_next) and, where the argmax embeds
    the next step's tokens, the graph's first step (Session.step_lead)."""
    import gpt2_cupy.engine as E

    return 1 if E.STEPS_PER_GRAPH == 1 else 3 if model.embeds_in_argmax(sampling) else 2


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("size", ["distilgpt2", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"])
def test_logits_match_transformers(size):
    hf = hf_model(size, seed=1, perturb=True)
    ids = np.random.default_rng(0).integers(0, 50257, (2, 37))
    with torch.no_grad():
        expect = hf(torch.as_tensor(ids, device="cuda")).logits.double().cpu().numpy()
    model = GPT2.from_hf(hf, "float32")
    got = model.logits(ids).get()
    assert got.shape == (2, 37, 50257)
    assert rel_err(got, expect) < 1e-4
    del model, hf
    torch.cuda.empty_cache()


@pytest.mark.parametrize("T", [64, 12], ids=["gemm", "short"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_logits_error_at_most_twice_transformers(dtype, T):
    """Against float32 logits, our half-precision model errs at most 2x as much as
    transformers running in the same half precision: prompts on the gemm, and short ones
    (SHORT_PROMPT) on the decode step's products with their LayerNorms folded."""
    hf = hf_model("gpt2", seed=2, perturb=True)
    ids = np.random.default_rng(1).integers(0, 50257, (1, T))
    tids = torch.as_tensor(ids, device="cuda")
    with torch.no_grad():
        exact = hf(tids).logits.double().cpu().numpy()
        theirs = hf.to(getattr(torch, dtype))(tids).logits.double().cpu().numpy()
    hf.float()
    ours = GPT2.from_hf(hf, dtype).logits(ids).astype(cp.float32).get()
    assert rel_err(ours, exact) <= 2 * rel_err(theirs, exact)


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_512_tokens_match_transformers(use_cache):
    hf = hf_model("gpt2")
    with torch.no_grad():
        expect = hf.generate(torch.tensor([PROMPT], device="cuda"), max_new_tokens=512, do_sample=False,
                             use_cache=use_cache)[0].tolist()
    got = GPT2.from_hf(hf, "float32").generate(PROMPT, 512, use_cache=use_cache)
    assert len(got) == len(PROMPT) + 512
    assert got == expect


def test_batch_equals_one_by_one(small):
    _, model = small
    prompts = [PROMPT, [50, 8, 999, 4, 77, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [42]]
    alone = [model.generate(p, 40) for p in prompts]
    assert model.generate(prompts, 40) == alone
    assert model.generate(prompts, 40, cuda_graph=False) == alone
    assert model.generate(prompts, 5, use_cache=False) == [a[: len(p) + 5] for a, p in zip(alone, prompts)]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_batch_equals_one_by_one_on_tensor_cores(small, dtype):
    """Half precision runs the decode step's products on tensor cores: a sequence's tokens
    still do not depend on its batch, alone (LayerNorm in the products' prologue), in 9 rows
    (two n-tiles) and in 20 (LayerNorm ahead of the products)."""
    hf, _ = small
    model = GPT2.from_hf(hf, dtype)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 50257, int(n)).tolist() for n in rng.integers(1, 30, 20)]
    alone = [model.generate(p, 24) for p in prompts]
    assert model.generate(prompts, 24) == alone
    assert model.generate(prompts[:9], 24) == alone[:9]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attention_trips_ahead_keep_the_tokens(small, dtype, monkeypatch):
    """The decode step's attention with AHEAD_DEEP trips ahead (chosen for batches of up to
    DECODE_AHEAD_BATCH of wide models; here for GPT-2 small) gives each sequence, alone and
    in pairs, the tokens it gets in a batch of four run one trip ahead. (decode_attention is the
    step's attention with fixed_attention off: quantized caches, a model with fused_step on.)"""
    import cupy_kernels as K
    import gpt2_cupy.model as M
    from cupy_kernels.decode_attention import AHEAD_DEEP

    monkeypatch.setattr(M, "DECODE_FIXED_ATTENTION", False)
    hf, _ = small
    model = GPT2.from_hf(hf, dtype)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 50257, int(n)).tolist() for n in (1, 70, 200, 3)]
    batch = model.generate(prompts, 80)  # up to 280 cached keys: 5 loop trips of 64, one ahead
    monkeypatch.setattr(M, "DECODE_AHEAD_WIDTH", 0)
    seen, real = set(), K.decode_attention

    def spy(*args, **kwargs):
        seen.add(kwargs.get("ahead", 1))
        return real(*args, **kwargs)

    monkeypatch.setattr(K, "decode_attention", spy)
    alone = [model.generate(p, 80) for p in prompts]
    pairs = model.generate(prompts[:2], 80) + model.generate(prompts[2:], 80)
    assert seen == {AHEAD_DEEP}
    assert alone == batch
    assert pairs == batch


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_fixed_attention_width_follows_the_batch(small, dtype, monkeypatch):
    """Models with caches of their dtype decode with fixed_attention, its block width by batch
    (DECODE_FIXED_THREADS; float32: DECODE_FIXED_FLOAT32), and each sequence gets the tokens it
    gets alone; a quantized cache and a model with fused_step on keep decode_attention."""
    import cupy_kernels as K
    import gpt2_cupy.model as M

    hf, _ = small
    model = GPT2.from_hf(hf, dtype)
    rng = np.random.default_rng(14)
    prompts = [rng.integers(0, 50257, int(n)).tolist() for n in rng.integers(1, 60, 20)]
    seen, real = [], K.fixed_attention

    def spy(*args, **kwargs):
        seen.append(kwargs["threads"])
        return real(*args, **kwargs)

    monkeypatch.setattr(K, "fixed_attention", spy)
    widths = M.DECODE_FIXED_FLOAT32 if dtype == "float32" else M.DECODE_FIXED_THREADS
    alone = [model.generate(p, 30) for p in prompts[:3]]
    assert set(seen) == {widths[0][1]}
    for rows in (9, 20):
        seen.clear()
        assert model.generate(prompts[:rows], 30)[:3] == alone
        bucket = 1 << (rows - 1).bit_length()
        assert set(seen) == {next(t for most, t in widths if most is None or bucket <= most)}
    seen.clear()
    model.generate(prompts[:2], 5, kv_cache_dtype="int8")
    model.fused_step = True
    model.generate(prompts[:2], 5)
    assert not seen
    model.fused_step = False


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_attention_l2_warm_keeps_the_tokens(small, dtype, monkeypatch):
    """The decode step's attention reading part of the MLP down's weight into L2 (chosen at
    batches of up to DECODE_WARM_BATCH for GPT-2 medium and large; here for GPT-2 small) gives
    each prompt, alone and in a pair, the tokens it gets in a batch of three, which warms
    nothing. (With fixed_attention off, as above.)"""
    import cupy_kernels as K
    import gpt2_cupy.model as M

    monkeypatch.setattr(M, "DECODE_FIXED_ATTENTION", False)
    hf, _ = small
    model = GPT2.from_hf(hf, dtype)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, 50257, int(n)).tolist() for n in (1, 70, 600)]  # 600: two chunks of keys
    batch = model.generate(prompts, 40)
    monkeypatch.setattr(M, "DECODE_WARM_WIDTHS", (model.config.n_embd,))
    warmed, real = [], K.decode_attention

    def spy(*args, **kwargs):
        if kwargs.get("warm") is not None:
            warmed.append(kwargs["warm"].nbytes)
        return real(*args, **kwargs)

    monkeypatch.setattr(K, "decode_attention", spy)
    alone = [model.generate(p, 40) for p in prompts]
    down = model.blocks[0].mlp_proj_w
    assert warmed and set(warmed) == {min(down.nbytes, M.DECODE_WARM_BYTES // 16 * 16)}
    assert alone == batch
    monkeypatch.setattr(M, "DECODE_WARM_BATCH", 2)
    warmed.clear()
    pairs = model.generate(prompts[:2], 40) + model.generate(prompts[1:], 40)
    assert warmed
    assert pairs == batch[:2] + batch[1:]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paced_products_keep_the_tokens(small, dtype, monkeypatch):
    """The decode step's q|k|v and MLP up products requesting their weights paced
    (DECODE_PACE_GBPS, taken by GPT-2 small at batches of up to DECODE_PACE_BATCH) give each
    prompt the tokens it gets unpaced, alone and in a batch; a slow pace as well."""
    import cupy_kernels as K
    import gpt2_cupy.model as M

    hf, _ = small
    model = GPT2.from_hf(hf, dtype)
    assert model.config.n_embd in M.DECODE_PACE_WIDTHS
    rng = np.random.default_rng(13)
    prompts = [rng.integers(0, 50257, int(n)).tolist() for n in (1, 70, 600)]
    paces, real = [], K.linear

    def spy(*args, **kwargs):
        paces.append(kwargs.get("pace"))
        return real(*args, **kwargs)

    default = M.DECODE_PACE_GBPS or 2000
    peak = _build.peak_memory_GBps(cp.cuda.Device().id)
    monkeypatch.setattr(K, "linear", spy)
    monkeypatch.setattr(M, "DECODE_PACE_GBPS", 0)
    plain = model.generate(prompts, 40)
    assert paces and set(paces) == {None}
    # a pace in GB/s, a slow one, and a share of the device's peak bandwidth (DECODE_PACE_PEAK_SHARE)
    for gbps, share, pace in ((default, None, default), (100, None, 100),
                              (default, 0.6, round(0.6 * peak) if peak else default)):
        monkeypatch.setattr(M, "DECODE_PACE_GBPS", gbps)
        monkeypatch.setattr(M, "DECODE_PACE_PEAK_SHARE", {model.config.n_embd: share} if share else {})
        model._engine = None  # the sessions (and their recorded steps) of the setting before
        paces.clear()
        batch = model.generate(prompts, 40)
        # q|k|v and MLP up of every block, in each recorded step
        assert paces.count(pace) == 2 * model.config.n_layer * recorded_steps(model)
        assert batch == plain
        assert [model.generate(p, 40) for p in prompts] == plain


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_stats_warp_keeps_the_tokens(small, dtype, monkeypatch):
    """The folded products taking one warp more for the rows' statistics (DECODE_STATS_WARP)
    give each prompt the tokens it gets without it, alone and in a batch of three."""
    import cupy_kernels as K
    import gpt2_cupy.model as M

    hf, _ = small
    model = GPT2.from_hf(hf, dtype)
    rng = np.random.default_rng(17)
    prompts = [rng.integers(0, 50257, int(n)).tolist() for n in (1, 70, 600)]
    seen, real = [], K.linear

    def spy(*args, **kwargs):
        seen.append(kwargs.get("stats_warp", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(K, "linear", spy)
    monkeypatch.setattr(M, "DECODE_STATS_WARP", {})
    plain = model.generate(prompts, 40)
    assert seen and not any(seen)
    monkeypatch.setattr(M, "DECODE_STATS_WARP", {model.config.n_embd: {"qkv": (1, 8), "up": (1, 8)}})
    model._engine = None  # the sessions (and their recorded steps) of the setting before
    seen.clear()
    batch = model.generate(prompts, 40)
    assert seen.count(True) == 2 * model.config.n_layer * recorded_steps(model)  # q|k|v and MLP up of each block
    assert batch == plain
    assert [model.generate(p, 40) for p in prompts] == plain


@pytest.mark.parametrize("points", [
    {"qkv": "requested", "proj": "waited", "up": "waited", "down": "requested"},
    {"qkv": "waited", "proj": "requested", "up": "requested", "down": "waited"}], ids=["a", "b"])
def test_product_triggers_keep_the_tokens(small, monkeypatch, points):
    """The products letting the next kernel start later than as they start
    (DECODE_PRODUCT_TRIGGERS, at batch 1; here every role of GPT-2 small's width, at each later
    point in one of the cases) give each prompt the tokens it gets without, alone; a batch keeps
    its products' triggers at their start."""
    import cupy_kernels as K
    import gpt2_cupy.engine as E
    import gpt2_cupy.model as M

    hf, _ = small
    model = GPT2.from_hf(hf, "float16")
    monkeypatch.setattr(E, "STEPS_PER_GRAPH", 1)  # (the chained steps' first product: the test below)
    rng = np.random.default_rng(15)
    prompts = [rng.integers(0, 50257, int(n)).tolist() for n in (1, 70)]
    triggers, real = [], K.linear

    def spy(*args, **kwargs):
        triggers.append(kwargs.get("trigger", "start"))
        return real(*args, **kwargs)

    monkeypatch.setattr(K, "linear", spy)
    monkeypatch.setattr(M, "DECODE_PRODUCT_TRIGGERS", {})
    plain = [model.generate(p, 40) for p in prompts]
    assert triggers and set(triggers) == {"start"}
    monkeypatch.setattr(M, "DECODE_PRODUCT_TRIGGERS", {model.config.n_embd: points})
    model._engine = None  # the sessions (and their recorded steps) of the setting before
    triggers.clear()
    assert [model.generate(p, 40) for p in prompts] == plain
    n = 2 * model.config.n_layer  # each role in every block, in two sessions (64, 128 rows)
    assert triggers.count("requested") == 2 * n and triggers.count("waited") == 2 * n
    triggers.clear()
    assert model.generate(prompts, 40) == plain
    assert triggers and set(triggers) == {"start"}


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_steps_chained_in_one_graph_keep_the_tokens(small, monkeypatch, dtype):
    """Sessions that run STEPS_PER_GRAPH decode steps a graph launch (each step's embedding and
    first product starting while the step before ends; in float16 that embedding run by the
    step before's argmax), and STEPS_PER_GRAPH_FIXED_LENGTH in the calls that read every step
    (generate without an end-of-text token), give every prompt the tokens of one step a launch:
    alone, in a batch, for every call length around the graphs' steps, up to an end-of-text
    token, through stream, and up to the model's last position."""
    import gpt2_cupy.engine as E

    hf, _ = small
    model = GPT2.from_hf(hf, dtype)
    rng = np.random.default_rng(16)
    prompts = [rng.integers(0, 50257, int(n)).tolist() for n in (1, 9, 70)]
    longest = rng.integers(0, 50257, model.config.n_positions - 9).tolist()
    monkeypatch.setattr(E, "STEPS_PER_GRAPH", 1)
    plain = [model.generate(p, 41) for p in prompts]
    assert model.generate(prompts, 41) == plain
    plain_longest = model.generate(longest, 9)
    monkeypatch.setattr(E, "STEPS_PER_GRAPH", 4)
    monkeypatch.setattr(E, "STEPS_PER_GRAPH_FIXED_LENGTH", 8)
    model._engine = None  # the sessions of one step a launch
    launches, real = [], E.Session.run_step

    def spy(self, slot, n=1):
        launches.append(n)
        return real(self, slot, n)

    monkeypatch.setattr(E.Session, "run_step", spy)
    assert [model.generate(p, 41) for p in prompts] == plain
    assert launches == [8] * 3 * 5  # 40 steps a call after the prefill's token
    launches.clear()
    streamed = [t for (t,) in model.stream(prompts[0], 41)]  # (read step by step: it may stop early)
    assert prompts[0] + streamed == plain[0] and launches == [4] * 10
    assert model.generate(prompts, 41) == plain
    for new in range(1, 22):  # 8, 4 and 1 steps a launch
        assert model.generate(prompts[1], new) == plain[1][:len(prompts[1]) + new]
    launches.clear()
    eos = plain[2][len(prompts[2]) + 6]
    assert model.generate(prompts[2], 41, eos_token_id=eos) == plain[2][:plain[2].index(eos, len(prompts[2])) + 1]
    assert set(launches) == {4}
    assert model.generate(longest, 9) == plain_longest  # (the last graph's argmax embeds past the last position)
    folds = model.embeds_in_argmax(None)
    assert folds == (dtype == "float16")
    sessions = [s for pool in model.engine._sessions.values() for s in pool]
    assert sessions and all(s.per_graph == 4 and s.per_graph_fixed == 8 for s in sessions)
    for s in sessions:  # a chained step without its embedding launch where the argmax before it embeds
        assert len(s.step_next) == len(s.step) - folds and len(s.step_lead) == len(s.step)
        assert (s.step_lead is s.step) == (not folds)


def test_chained_steps_start_the_attention_after_the_first_product(small, monkeypatch):
    """In the graph of several steps, a step after the first lets its attention start only once
    its first q|k|v product has passed its wait (the attentions read the cache positions, which
    the step before moves on, before their own wait): one "waited" trigger, in the recorded
    chained step; none where a graph runs one step."""
    import cupy_kernels as K
    import gpt2_cupy.engine as E
    import gpt2_cupy.model as M

    hf, _ = small
    model = GPT2.from_hf(hf, "float16")
    monkeypatch.setattr(M, "DECODE_PRODUCT_TRIGGERS", {})
    triggers, real = [], K.linear

    def spy(*args, **kwargs):
        triggers.append(kwargs.get("trigger", "start"))
        return real(*args, **kwargs)

    monkeypatch.setattr(K, "linear", spy)
    monkeypatch.setattr(E, "STEPS_PER_GRAPH", 1)
    one = model.generate(PROMPT, 10)
    assert triggers and set(triggers) == {"start"}
    monkeypatch.setattr(E, "STEPS_PER_GRAPH", 4)
    model._engine = None
    triggers.clear()
    assert model.generate(PROMPT, 10) == one
    assert triggers.count("waited") == 1 and set(triggers) == {"start", "waited"}


def test_fast_pace_keeps_the_tokens(small, monkeypatch):
    """GPT-2 small's sessions of 5 to 8 rows pace at DECODE_PACE_FAST's rate, and each prompt
    gets the tokens it gets unpaced, in the batch and alone."""
    import cupy_kernels as K
    import gpt2_cupy.model as M

    hf, _ = small
    model = GPT2.from_hf(hf, "float16")
    rows_from, gbps = M.DECODE_PACE_FAST[model.config.n_embd]
    rng = np.random.default_rng(14)
    prompts = [rng.integers(0, 50257, int(n)).tolist() for n in (3, 40, 1, 90, 7, 12, 5, 64)[:rows_from]]
    paces, real = [], K.linear

    def spy(*args, **kwargs):
        paces.append(kwargs.get("pace"))
        return real(*args, **kwargs)

    monkeypatch.setattr(K, "linear", spy)
    batch = model.generate(prompts, 24)
    assert paces.count(gbps) == 2 * model.config.n_layer * recorded_steps(model)  # q|k|v and MLP up of every block
    monkeypatch.setattr(M, "DECODE_PACE_GBPS", 0)
    model._engine = None
    paces.clear()
    assert model.generate(prompts, 24) == batch
    assert set(paces) == {None}
    assert [model.generate(p, 24) for p in prompts] == batch


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_decode_step_profile_reads_every_product(small, dtype):
    """benchmarks/decode_step.py names each launch of a recorded decode step (paced, at batch 1,
    and not, at 9) and reads each product's shape from its arguments: four products a block with
    GPT-2's weight shapes, then the LM head."""
    import gpt2_cupy.model as M
    from benchmarks.decode_step import launch_roles
    from gpt2_cupy.engine import Session

    hf, _ = small
    model = GPT2.from_hf(hf, dtype)
    C, V, s = model.config.n_embd, model.config.vocab_size, model.dtype.itemsize
    shapes = {"qkv": (3 * C, C), "attn_proj": (C, C), "fc": (4 * C, C), "mlp_proj": (C, 4 * C), "lm_head": (V, C)}
    for batch in (1, 9):
        session = Session(model, batch, 128, None, None, cuda_graph=False)
        roles = launch_roles(model, session.step, batch, 64)
        products = [(role, nbytes) for role, nbytes in roles if role in shapes]
        assert [role for role, _ in products] == ["qkv", "attn_proj", "fc", "mlp_proj"] * model.config.n_layer + ["lm_head"]
        screened = model.folded and M.DECODE_HEAD_SCREEN and batch <= M.DECODE_SCREEN_ROWS
        screened32 = not model.folded and M.DECODE_HEAD_SCREEN_FLOAT32 and batch == 1
        for role, nbytes in products:
            N, Kd = shapes[role]
            if role == "lm_head" and screened:  # its weight at 8 bits, with scale, u and c (and a few exact tiles)
                assert nbytes == N * Kd + 12 * N + batch * Kd * s
                assert [(r, b) for r, b in roles if r.startswith("lm_head_")] == [("lm_head_tiles", 4 * batch * -(-N // 16))]
            elif role == "lm_head" and screened32:  # float32: at 8 bits, with scale, x and ln_f (and a few blocks)
                assert nbytes == N * Kd + 4 * N + 3 * Kd * s
                assert [(r, b) for r, b in roles if r.startswith("lm_head_")] == [("lm_head_tiles", 4 * -(-N // 32))]
            else:
                assert nbytes == (N * Kd + batch * (N + Kd)) * s, role


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_packed_prefill_equals_each_prompt_alone(small, dtype, monkeypatch):
    """Prompts prefilled together (one forward over their tokens packed along time, or
    several when they exceed the token budget) leave in the cache and in the last residuals
    exactly the bits each prompt leaves alone: short prompts (SHORT_PROMPT) packed with short
    ones on the decode step's products, the others on the gemm."""
    import gpt2_cupy.model as M

    hf, _ = small
    model = GPT2.from_hf(hf, dtype)
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 50257, int(n)) for n in (1, 37, 200, 5, 16, 3, 129, 64)]
    slots = [4, 0, 2, 5, 7, 6, 1, 3]
    C, n = model.config.n_embd, len(rows)

    def run(groups_of):
        cache = M.KVCache(model.config, n, 256, model.dtype)
        cache.k.fill(0)
        cache.v.fill(0)
        last = cp.full((n, C), np.nan, dtype=np.float32).astype(model.dtype)
        for lo, hi in groups_of:
            model._prefill(rows[lo:hi], cache, slots[lo:hi], last[lo:hi])
        return cache, last

    alone_cache, alone_last = run([(i, i + 1) for i in range(n)])
    assert bool(cp.isfinite(alone_last.astype(cp.float32)).all())
    for budget in (M.PREFILL_TOKENS, 200):  # one forward (float16 / bfloat16), then packs of <= 200 tokens
        monkeypatch.setattr(M, "PREFILL_TOKENS", budget)
        cache, last = run([(0, n)])
        assert cp.array_equal(last, alone_last), budget
        assert cp.array_equal(cache.k, alone_cache.k) and cp.array_equal(cache.v, alone_cache.v), budget
    # 16-bit: [1] (short), [37], [200] (over 200 tokens together), [5, 16, 3] (short), [129, 64]
    assert model.prefill_groups([r.size for r in rows]) == (
        [(i, i + 1) for i in range(n)] if dtype == "float32" else [(0, 1), (1, 2), (2, 3), (3, 6), (6, 8)])


@pytest.mark.parametrize("lengths,other", [((3, 12), (4, 10)), ((20, 17), (19, 18))], ids=["short", "long"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_recorded_prefill_replays_the_forward(small, dtype, lengths, other, monkeypatch):
    """A prefill into a cache is recorded once per bucket of its shape (record_size: tokens,
    prompts, the longest, padded) and replayed with new token ids, lengths and cache rows,
    launch by launch and then, on a stream of its own, as a CUDA graph: the cache and the last
    residuals get exactly the bits of the forward run launch by launch without padding (the
    padding rows write nothing); the cache keeps at most PLANS records of RECORD_TOKENS tokens
    together. Short prompts (SHORT_PROMPT, the decode step's products) and longer ones (the
    gemm)."""
    import gpt2_cupy.model as M

    hf, _ = small
    model = GPT2.from_hf(hf, dtype)
    rng = np.random.default_rng(9)
    C = model.config.n_embd
    assert model.prefill_groups(lengths) == model.prefill_groups(other) == [(0, 2)]  # one forward each
    assert M.record_size(sum(lengths), 8) > sum(lengths)  # padded

    def prompts(ns):
        return [rng.integers(0, 50257, n) for n in ns]

    def run(cache, rows, slots):
        last = cp.full((len(rows), C), np.nan, dtype=np.float32).astype(model.dtype)
        model._prefill(rows, cache, slots, last)
        return last

    def fresh():
        cache = M.KVCache(model.config, 3, 64, model.dtype)
        cache.k.fill(0)
        cache.v.fill(0)
        return cache

    def same(last, cache, want_last, want):
        return (cp.array_equal(last, want_last) and cp.array_equal(cache.k, want.k)
                and cp.array_equal(cache.v, want.v))

    first, second, third = prompts(lengths), prompts(lengths), prompts(other)
    monkeypatch.setattr(M, "RECORD_TOKENS", 0)  # launch by launch, no padding
    eager, eager_other = fresh(), fresh()
    eager_last, other_last = run(eager, second, [2, 0]), run(eager_other, third, [1, 2])
    monkeypatch.setattr(M, "RECORD_TOKENS", 2048)
    cache = fresh()
    run(cache, first, [2, 0])  # recorded (and run)
    for rows, slots, want_last, want in ((second, [2, 0], eager_last, eager), (third, [1, 2], other_last, eager_other)):
        cache.k.fill(0)
        cache.v.fill(0)
        last = run(cache, rows, slots)  # the record, with these prompts' ids, lengths and rows
        assert len(cache.plans) == 1
        assert same(last, cache, want_last, want)
    (bucket,) = cache.plans
    monkeypatch.setattr(M, "PLANS", 2)
    run(cache, prompts([5]), [1])  # other buckets: records of their own
    run(cache, prompts([30]), [0])
    assert [k[2:] for k in cache.plans] == [(8, 1, 8), (32, 1, 32)]  # the first record dropped
    monkeypatch.setattr(M, "RECORD_TOKENS", 40)
    run(cache, prompts([9]), [2])  # 16 tokens more than 40 together: both dropped
    assert [k[2:] for k in cache.plans] == [(16, 1, 16)]
    assert bucket[2:] == (M.record_size(sum(lengths), 8), 2, M.record_size(max(lengths), 8))
    monkeypatch.setattr(M, "RECORD_TOKENS", 2048)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:  # on a stream of its own the record runs as a CUDA graph from its second use on
        graphed = fresh()
        run(graphed, first, [2, 0])  # recorded, run launch by launch
        (entry,) = graphed.plans.values()
        assert entry.graph is None
        graphed.k.fill(0)
        graphed.v.fill(0)
        last = run(graphed, second, [2, 0])  # captured and run, with the second prompts' ids
        stream.synchronize()
    assert entry.graph is not None
    assert same(last, graphed, eager_last, eager)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_cached_tokens_are_argmax_of_full_forward(small, dtype):
    """Each token the cached decode path picked is (within rounding) the argmax of the
    full forward pass's logits at its position."""
    hf, _ = small
    model = GPT2.from_hf(hf, dtype)
    seq = model.generate(PROMPT, 24)
    logits = model.logits(seq[:-1]).astype(cp.float32).get()  # [T, V]
    tol = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-1}[dtype]
    for pos in range(len(PROMPT) - 1, len(seq) - 1):
        row = logits[pos]
        assert row[seq[pos + 1]] >= row.max() - tol * np.abs(row).max()


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_kv_cache_generation(small, kv):
    """A quantized cache only changes what decoding reads: the first new token (from the
    prefill) is the fp32 cache's, the graph and the kernel-by-kernel step agree, and a
    batch gives each row its own tokens."""
    _, model = small
    plain = model.generate(PROMPT, 16)
    got = model.generate(PROMPT, 16, kv_cache_dtype=kv)
    assert len(got) == len(PROMPT) + 16 and all(0 <= t < 50257 for t in got)
    assert got[len(PROMPT)] == plain[len(PROMPT)]
    assert model.generate(PROMPT, 16, kv_cache_dtype=kv, cuda_graph=False) == got
    other = PROMPT[3:] + [318]
    assert model.generate([PROMPT, other], 16, kv_cache_dtype=kv) == [got, model.generate(other, 16, kv_cache_dtype=kv)]


def test_sampling_is_seeded(small):
    _, model = small
    kw = dict(do_sample=True, temperature=0.9, top_k=50, top_p=0.95)
    a = model.generate(PROMPT, 30, seed=7, **kw)
    assert model.generate(PROMPT, 30, seed=7, **kw) == a
    assert model.generate(PROMPT, 30, seed=7, cuda_graph=False, **kw) == a
    assert model.generate(PROMPT, 30, seed=8, **kw) != a
    assert all(0 <= t < 50257 for t in a)


def test_eos_stops_a_sequence(small):
    _, model = small
    first = model.generate(PROMPT, 10)
    eos = first[len(PROMPT) + 2]  # the third new token
    got = model.generate(PROMPT, 10, eos_token_id=eos)
    assert got == first[: first.index(eos, len(PROMPT)) + 1]


def test_engine_reuses_sessions_across_calls(small, monkeypatch):
    """A warm call of the same bucket records and captures nothing new, and every length
    around the read-back lookahead gives the prefix of the longer run."""
    import gpt2_cupy.engine as E

    _, model = small
    first = model.generate(PROMPT, 20)  # (19 steps: the fixed-length calls' graph too)
    n = model.engine.sessions()
    made, real_capture, real_many, real_record = [], _build.capture, E.Session.capture_many, model.record_step
    monkeypatch.setattr(_build, "capture", lambda *a, **k: made.append("capture") or real_capture(*a, **k))
    monkeypatch.setattr(E.Session, "capture_many", lambda self, *a: made.append("many") or real_many(self, *a))
    monkeypatch.setattr(model, "record_step", lambda *a, **k: made.append("record") or real_record(*a, **k))
    assert model.generate(PROMPT, 20) == first
    assert made == []
    assert model.generate(PROMPT[:5], 30) == model.generate(PROMPT[:5], 30)  # same cache bucket
    assert model.engine.sessions() == n
    for new in range(1, 2 * LOOKAHEAD + 2):
        assert model.generate(PROMPT, new) == first[: len(PROMPT) + new]
    assert model.generate(PROMPT, 20, cuda_graph=False) == first


def test_abandoned_stream_leaves_the_model_usable(small):
    _, model = small
    expect = model.generate(PROMPT, 30)
    it = model.stream(PROMPT, 30)
    assert [next(it)[0] for _ in range(3)] == expect[len(PROMPT): len(PROMPT) + 3]
    other = model.stream(PROMPT, 30)  # while `it` holds its session: a session of its own
    assert [step[0] for step in other] == expect[len(PROMPT):]
    del it
    assert model.generate(PROMPT, 30) == expect


def test_sessions_are_bounded(small):
    _, model = small
    for new in (50, 100, 200, 400, 1000):  # a cache-length bucket each
        model.generate(PROMPT[:2], new)
    assert model.engine.sessions() <= MAX_SESSIONS


def test_bad_inputs_raise_and_model_stays_usable(small):
    _, model = small
    before = model.generate(PROMPT, 8)
    with pytest.raises(ValueError, match="positions"):
        model.generate(list(range(1000)), 100)
    with pytest.raises(ValueError, match="empty"):
        model.generate([], 4)
    with pytest.raises(ValueError, match="empty"):
        model.generate([PROMPT, []], 4)
    with pytest.raises(ValueError, match="vocabulary"):
        model.generate([1, 2, 50257], 4)
    with pytest.raises(ValueError, match="vocabulary"):
        model.generate([-1], 4)
    with pytest.raises(TypeError, match="integers"):
        model.generate(np.array([1.0, 2.0]), 4)
    with pytest.raises(TypeError, match="integers"):
        model.generate([1, 2.5], 4)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(PROMPT, 4, do_sample=True, temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(PROMPT, 4, do_sample=True, top_p=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(PROMPT, -1)
    with pytest.raises(ValueError, match="dtype"):
        GPT2.from_hf(small[0], "int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        model.generate(PROMPT, 4, kv_cache_dtype="int4")
    assert model.generate(PROMPT, 8) == before
    assert model.generate(cp.asarray(PROMPT), 8) == before
    assert model.generate(torch.tensor(PROMPT, device="cuda"), 8) == before


def test_text_generate_and_stream(small, monkeypatch):
    """The text API: generate, stream and stop strings agree; generate without an end-of-text
    token or a stop string runs the fixed-length calls' graphs (STEPS_PER_GRAPH_FIXED_LENGTH
    steps a launch), stream and a call with a stop string the shorter ones."""
    import gpt2_cupy.engine as E

    _, model = small
    launches, real = [], E.Session.run_step

    def spy(self, slot, n=1):
        launches.append(n)
        return real(self, slot, n)

    monkeypatch.setattr(E.Session, "run_step", spy)
    longest, short = E.STEPS_PER_GRAPH_FIXED_LENGTH, E.STEPS_PER_GRAPH
    prompt = "Hello, I'm a language model,"
    text = generate(prompt, model, max_new_tokens=20, eos_token_id=None)
    assert text.startswith(prompt) and len(text) > len(prompt)
    assert longest in launches
    launches.clear()
    pieces = list(stream(prompt, model, max_new_tokens=20, eos_token_id=None))
    assert prompt + "".join(pieces) == text
    assert launches and max(launches) == short
    batch = generate([prompt, "The"], model, max_new_tokens=20, eos_token_id=None)
    assert batch[0] == text
    launches.clear()
    stop = text[len(prompt) + 5: len(prompt) + 8]
    cut = generate(prompt, model, max_new_tokens=20, eos_token_id=None, stop=stop)
    assert stop not in cut[len(prompt):] and text.startswith(cut)
    assert launches and max(launches) == short
    with pytest.raises(ValueError, match="empty"):
        generate("", model)
    with pytest.raises(ValueError, match="positions"):
        generate(prompt, model, max_new_tokens=1020)


def test_command_line_random_weights():
    run = subprocess.run([sys.executable, "-m", "gpt2_cupy", "Hello", "--random-weights", "--max-new-tokens", "12",
                          "--dtype", "float16"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Hello")
    assert "tokens/s" in run.stderr


def test_from_pretrained_local_directory(tmp_path):
    """A model saved in transformers' format loads from its directory, by the API and the CLI."""
    hf = hf_model("distilgpt2", seed=3, perturb=True)
    hf.save_pretrained(tmp_path)
    ids = np.random.default_rng(2).integers(0, 50257, (1, 9))
    a = GPT2.from_pretrained(str(tmp_path), dtype="float32").logits(ids).get()
    b = GPT2.from_hf(hf, "float32").logits(ids).get()
    np.testing.assert_array_equal(a, b)
    run = subprocess.run([sys.executable, "-m", "gpt2_cupy", "Hi", "--model", str(tmp_path), "--max-new-tokens", "4"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    missing = subprocess.run([sys.executable, "-m", "gpt2_cupy", "Hi", "--model", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 1 and missing.stderr.startswith("error:")
    assert "Traceback" not in missing.stderr


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_continuous_batching_equals_alone(small, dtype):
    """More prompts than slots, per-prompt max_new_tokens (0 and 1 among them), end-of-text
    ending some early: every prompt gets exactly its alone-result, in the input order,
    whatever the number of slots (a cache bucket of its own included)."""
    hf, _ = small
    model = GPT2.from_hf(hf, dtype)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 50257, int(n)).tolist() for n in rng.integers(1, 40, 11)]
    budgets = [int(m) for m in rng.integers(2, 40, 11)]
    budgets[0], budgets[3], budgets[7], budgets[9] = 9, 0, 1, 100  # nothing, the first token only, a longer cache
    free = [model.generate(p, m) for p, m in zip(prompts, budgets)]
    eos = free[0][len(prompts[0]) + 2]  # a token some sequences make early
    alone = [model.generate(p, m, eos_token_id=eos) for p, m in zip(prompts, budgets)]
    assert any(len(a) < len(p) + m for a, p, m in zip(alone, prompts, budgets))  # end-of-text cut some
    for max_batch in (1, 3, 16):
        got = model.generate(prompts, budgets, eos_token_id=eos, max_batch=max_batch, progress=max_batch == 3)
        assert got == alone, max_batch
    assert model.generate(prompts[:4], 12, max_batch=2) == [model.generate(p, 12) for p in prompts[:4]]


def test_continuous_batching_sampling_is_seeded(small):
    """Same seed, same text; each prompt draws its own random numbers, even through the
    same slot as another copy of it."""
    _, model = small
    prompts = [PROMPT, [42], [7, 8, 9], PROMPT[:3]]
    a = model.generate(prompts, [5, 9, 3, 7], do_sample=True, seed=3, max_batch=2)
    assert a == model.generate(prompts, [5, 9, 3, 7], do_sample=True, seed=3, max_batch=2)
    assert [len(s) - len(p) for s, p in zip(a, prompts)] == [5, 9, 3, 7]
    same = model.generate([PROMPT] * 4, 12, do_sample=True, seed=5, max_batch=1)
    assert len({tuple(s) for s in same}) == 4


def test_continuous_batching_bad_requests_raise_before_running(small, monkeypatch):
    _, model = small
    before = model.generate(PROMPT, 8)
    with pytest.raises(ValueError, match="max_batch"):
        model.generate([PROMPT, [1]], 4, max_batch=0)
    with pytest.raises(ValueError, match="entries"):
        model.generate([PROMPT, [1]], [4], max_batch=2)
    with pytest.raises(ValueError, match="sequence 1"):
        model.generate([PROMPT, [1]], [4, -2], max_batch=2)
    with pytest.raises(ValueError, match="positions"):
        model.generate([PROMPT, list(range(1000))], [4, 30], max_batch=1)
    with pytest.raises(ValueError, match="use_cache"):
        model.generate([PROMPT, [1]], 4, max_batch=2, use_cache=False)
    with pytest.raises(ValueError, match="no sequence"):
        model.generate(np.zeros((0, 4), dtype=np.int64), 4, max_batch=2)
    assert model.generate([PROMPT, [1]], [0, 0], max_batch=2) == [PROMPT, [1]]
    import gpt2_cupy.engine as engine

    monkeypatch.setattr(engine, "free_bytes", lambda: 1 << 20)
    with pytest.raises(MemoryError, match="max_batch"):
        model.generate([PROMPT] * 8, 4, max_batch=8)
    monkeypatch.undo()
    assert model.generate(PROMPT, 8) == before
    assert model.generate([PROMPT, [1]], [8, 3], max_batch=1)[0] == before


def test_text_generate_continuous_batching(small):
    _, model = small
    prompts = ["Hello, I'm a language model,", "The", "A B C", "x"]
    alone = [generate(p, model, max_new_tokens=n, eos_token_id=None) for p, n in zip(prompts, (12, 5, 9, 1))]
    assert generate(prompts, model, max_new_tokens=[12, 5, 9, 1], eos_token_id=None, max_batch=2) == alone
    stop = alone[0][len(prompts[0]) + 3: len(prompts[0]) + 6]
    cut = generate(prompts, model, max_new_tokens=12, eos_token_id=None, max_batch=3, stop=stop)
    assert cut[0] == generate(prompts[0], model, max_new_tokens=12, eos_token_id=None, stop=stop)
    assert stop not in cut[0][len(prompts[0]):]


def test_float32_steps_screen_the_head(small, monkeypatch):
    """Greedy float32 steps of one sequence screen the LM head (DECODE_HEAD_SCREEN_FLOAT32:
    linear_argmax's screen= for float32 rows) and get the tokens they get without it, kernel
    by kernel and in CUDA graphs; sessions of more rows do not screen."""
    import cupy_kernels as K
    import gpt2_cupy.model as M

    hf, _ = small
    rng = np.random.default_rng(31)
    prompts = [rng.integers(0, 50257, int(n)).tolist() for n in (1, 7, 40)]
    seen, real = [], K.linear_argmax

    def spy(*args, **kwargs):
        seen.append((args[0].shape[0], kwargs.get("screen") is not None))
        return real(*args, **kwargs)

    monkeypatch.setattr(K, "linear_argmax", spy)
    fresh = GPT2.from_hf(hf, "float32")
    screened = [fresh.generate(p, 60) for p in prompts] + [fresh.generate(prompts[1], 20, cuda_graph=False)]
    assert (1, True) in seen and all(screen == (rows == 1) for rows, screen in seen)
    seen.clear()
    assert fresh.generate(prompts, 20) == [s[:len(p) + 20] for s, p in zip(screened, prompts)]
    assert seen and not any(screen for _, screen in seen)
    monkeypatch.setattr(M, "DECODE_HEAD_SCREEN_FLOAT32", False)
    plain = GPT2.from_hf(hf, "float32")
    seen.clear()
    assert [plain.generate(p, 60) for p in prompts] + [plain.generate(prompts[1], 20, cuda_graph=False)] == screened
    assert seen and not any(screen for _, screen in seen)
