"""The fused decode step (one persistent kernel) against the kernel-by-kernel step: the same
bits in the residual stream, the KV cache, the row statistics and the tokens. With
``fused_step`` on, the kernel-by-kernel step (every batch) keeps decode_attention, whose bits
the persistent kernel computes."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import cupy_kernels as K  # noqa: E402
from gpt2_cupy import GPT2  # noqa: E402
from gpt2_cupy.engine import DecodeBuffers  # noqa: E402
from gpt2_cupy.model import KVCache  # noqa: E402


def random_model(dtype, n_layer=3, n_head=12, seed=0, perturb=True) -> GPT2:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=64 * n_head, n_positions=1024)
    with torch.device("cuda"):
        hf = transformers.GPT2LMHeadModel(cfg)
    if perturb:  # LayerNorms with parameters and non-zero biases: folding has something to do
        with torch.no_grad():
            for p in hf.parameters():
                if p.ndim == 1:
                    p.add_(torch.randn_like(p) * 0.1)
    return GPT2.from_hf(hf, dtype)


def run_steps(model: GPT2, prompt, steps: int, fused: bool, max_len: int = 256):
    """Prefill ``prompt`` into a fresh cache, then ``steps`` decode steps with the fused or
    the kernel-by-kernel step (of a model with fused_step on); returns the tokens and the
    final state."""
    model.fused_step = True
    buf = DecodeBuffers(model.config, 1, model.dtype)
    cache = KVCache(model.config, 1, max_len, model.dtype)
    cache.k.fill(np.nan)  # rows the step must not read, poisoned
    cache.v.fill(np.nan)
    buf.x.fill(np.nan)
    model._prefill([np.asarray(prompt)], cache, [0], buf.x)
    cache.positions.set(np.array([len(prompt)], np.int32))
    from cupy_kernels import _build

    with _build.recording() as head:
        model.head(buf, None)
    head.replay()
    plan = model.record_step(cache, buf, None, fused=fused)
    tokens = [int(buf.tokens.get()[0])]
    for _ in range(steps):
        plan.replay()
        tokens.append(int(buf.tokens.get()[0]))
    cp.cuda.Device().synchronize()
    return tokens, buf, cache, plan


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n_head,n_layer", [(12, 3), (25, 2), (16, 2)])  # GPT-2 small's, XL's, medium's width
def test_fused_step_bits_equal_the_kernel_by_kernel_step(dtype, n_head, n_layer):
    model = random_model(dtype, n_layer=n_layer, n_head=n_head)
    rng = np.random.default_rng(n_head)
    prompt = rng.integers(0, 50257, 37).tolist()
    t0, b0, c0, plan0 = run_steps(model, prompt, 40, fused=False)
    t1, b1, c1, plan1 = run_steps(model, prompt, 40, fused=True)
    assert len(plan1) == 1 and plan1[0].cooperative  # the fused step ran
    assert len(plan0) > 1
    assert t1 == t0
    assert cp.array_equal(b1.x, b0.x)
    assert cp.array_equal(b1.stats, b0.stats)
    n = len(prompt) + 40
    assert cp.array_equal(c1.k[:, :, :, :n], c0.k[:, :, :, :n])
    assert cp.array_equal(c1.v[:, :, :, :n], c0.v[:, :, :, :n])
    assert bool(cp.isnan(c1.k[:, :, :, n:].astype(cp.float32)).all())  # nothing written past the sequence
    assert int(c1.positions.get()[0]) == n and int(c1.lengths.get()[0]) == n


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_step_generate_equals_batched(dtype):
    """generate() of one prompt (fused step, CUDA graph) equals the same prompt in a batch
    (kernel-by-kernel step) with fused_step on; with it off again, the step's own attention:
    a prompt alone equals it in a batch, also across calls."""
    model = random_model(dtype, n_layer=4)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 50257, int(n)).tolist() for n in (5, 90, 17)]
    model.fused_step = True
    batched = model.generate(prompts, 60)
    alone = [model.generate(p, 60) for p in prompts]
    assert alone == batched
    assert [model.generate(p, 60, cuda_graph=False) for p in prompts] == batched
    model.fused_step = False
    batched = model.generate(prompts, 60)
    assert [model.generate(p, 60) for p in prompts] == batched


def test_fused_step_rejects_bad_shapes():
    model = random_model("float16", n_layer=1)
    cfg = model.config
    buf = DecodeBuffers(cfg, 2, model.dtype)
    cache = KVCache(cfg, 2, 64, model.dtype)
    blk = model.blocks[0]
    layer = {"attn_w": blk.attn_w, "attn_b": blk.attn_b, "attn_u": blk.attn_u, "attn_c": blk.attn_c,
             "proj_w": blk.attn_proj_w, "proj_b": blk.attn_proj_b, "fc_w": blk.fc_w, "fc_u": blk.fc_u,
             "fc_c": blk.fc_c, "mlp_w": blk.mlp_proj_w, "mlp_b": blk.mlp_proj_b}
    args = (buf.tokens[:1], cache.positions[:1], cache.lengths[:1])
    with pytest.raises(ValueError, match="one sequence"):
        K.decode_step(*args, buf.x, buf.qkv, buf.f, buf.stats, cache.k, cache.v, [layer], model.wte, model.wpe,
                      model.lm_head, model.head_u, model.head_c, eps=1e-5, split_keys=512, attention_threads=128)
    one = DecodeBuffers(cfg, 1, model.dtype)
    with pytest.raises(ValueError, match="k_cache"):  # a cache of two sequences
        K.decode_step(*args, one.x, one.qkv, one.f, one.stats, cache.k, cache.v, [layer], model.wte, model.wpe,
                      model.lm_head, model.head_u, model.head_c, eps=1e-5, split_keys=512, attention_threads=128)
    c1 = KVCache(cfg, 1, 64, model.dtype)
    with pytest.raises(ValueError, match="split_keys"):
        K.decode_step(*args, one.x, one.qkv, one.f, one.stats, c1.k, c1.v, [layer], model.wte, model.wpe,
                      model.lm_head, model.head_u, model.head_c, eps=1e-5, split_keys=0, attention_threads=128)
    bad = dict(layer, fc_u=blk.fc_u.astype(cp.float16))
    with pytest.raises(ValueError, match="fc_u"):
        K.decode_step(*args, one.x, one.qkv, one.f, one.stats, c1.k, c1.v, [bad], model.wte, model.wpe,
                      model.lm_head, model.head_u, model.head_c, eps=1e-5, split_keys=512, attention_threads=128)
    with pytest.raises(ValueError, match="trace"):
        K.decode_step(*args, one.x, one.qkv, one.f, one.stats, c1.k, c1.v, [layer], model.wte, model.wpe,
                      model.lm_head, model.head_u, model.head_c, eps=1e-5, split_keys=512, attention_threads=128,
                      trace=cp.zeros((1, 3), dtype=cp.uint64))
    assert model.generate([1, 2, 3], 3)  # still usable


def test_fused_step_timeline():
    """With a trace buffer the step writes every block's marks, in time order, and its ring
    stages' times in the order each stage lives through them, and the same token as without one."""
    from cupy_kernels.decode_step import split_trace, trace_marks

    model = random_model("float16", n_layer=2)
    cfg = model.config
    tokens = []
    for traced in (False, True):
        buf = DecodeBuffers(cfg, 1, model.dtype)
        cache = KVCache(cfg, 1, 64, model.dtype)
        model._prefill([np.arange(7)], cache, [0], buf.x)
        cache.positions.set(np.array([7], np.int32))
        buf.tokens.set(np.array([11], np.int32))
        trace = cp.zeros((cp.cuda.Device().attributes["MultiProcessorCount"], trace_marks(cfg.n_layer)), cp.uint64)
        model.fused_step_launch(cache, buf, trace=trace if traced else None)
        tokens.append(int(buf.tokens.get()[0]))
        t = trace.get()
    assert tokens[0] == tokens[1]
    marks, stages = split_trace(t.astype(np.int64), cfg.n_layer)
    assert (marks > 0).all()
    assert (np.diff(marks, axis=1) >= 0).all()
    for issued, wanted, had, freed in stages:
        n = int(np.count_nonzero(freed))
        assert n > 0 and (freed[n:] == 0).all() and (issued[n:] == 0).all()
        issued, wanted, had, freed = issued[:n], wanted[:n], had[:n], freed[:n]
        assert (issued > 0).all() and (issued < had).all() and (wanted <= had).all() and (had <= freed).all()
        assert (np.diff(issued) >= 0).all() and (np.diff(freed) >= 0).all()
