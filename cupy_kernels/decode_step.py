"""The whole decode step of a 16-bit GPT-2 for one sequence as one persistent, cooperative
kernel: embedding, every block, the LM head and the argmax, with grid-wide barriers between
the phases instead of kernel boundaries. Its numbers are those of the multi-kernel step
(``linear``, ``decode_attention``), bit for bit.

Kernel: ``src_cu/decode_step.cu``. Tests: ``tests/test_decode_step_gpu.py``.
Benchmarks: ``benchmarks/decode_step.py``, ``benchmarks/e2e.py``.
"""

from __future__ import annotations

import cupy
import numpy

from . import _build, _checks
from ._build import f32, i32
from .linear import _mma_warps

_SRC = "decode_step.cu"
THREADS = 288  # decode_step.cu's BLOCK_THREADS: 8 consumer warps and the producer warp
STAGE_BYTES = 34816  # decode_step.cu's STAGE_BYTES: one slot of the weight ring
MAX_STAGES = 8  # decode_step.cu's MAX_STAGES
MIN_STAGES = 2
TRACE_MARKS_PER_LAYER = 14  # decode_step.cu's Trace marks: q|k|v 3, attention 2, projection 3, MLP up 3, down 3
ATTENTION_THREADS = (128,)  # decode_attention's block width the step runs: an attention item takes that many threads
MAX_C = 1600  # decode_step.cu's STEP_MAX_C (GPT-2 XL)
HEAD_DIM = 64
# decode_step.cu's LayerPtr order: one row of pointers per block of the model
LAYER_KEYS = ("attn_w", "attn_b", "attn_u", "attn_c", "proj_w", "proj_b", "fc_w", "fc_u", "fc_c", "mlp_w", "mlp_b")
_LAYER_PTRS = 16

_HALVES = [c for c in _build.CTYPES.values() if c != "float"]
_build.declare(_SRC, [f"decode_step_kernel<{c}, {a}>" for c in _HALVES for a in ATTENTION_THREADS], cooperative=True)


STAGE_TRACE = 1536  # decode_step.cu: ring stages a block traces


def trace_marks(n_layer: int) -> int:
    """Columns of the step's timeline (``trace=``) for a model of ``n_layer`` blocks: a mark at
    the start, TRACE_MARKS_PER_LAYER a block, three for the LM head, one at the end; then four
    times STAGE_TRACE for the block's first ring stages (split_trace)."""
    return 1 + TRACE_MARKS_PER_LAYER * n_layer + 3 + 1 + 4 * STAGE_TRACE


def split_trace(trace, n_layer: int):
    """A timeline [blocks, trace_marks(n_layer)] as (marks [blocks, marks], stages [blocks, 4,
    STAGE_TRACE]): each block's global times (ns) at its marks, and at which the producer issued
    ring stage k (its slot free), the consumers asked for it, had it, and freed it (0 past the
    block's last stage)."""
    at = trace_marks(n_layer) - 4 * STAGE_TRACE
    return trace[:, :at], trace[:, at:].reshape(trace.shape[0], 4, STAGE_TRACE)


def _name(dtype, attention_threads: int) -> str:
    return f"decode_step_kernel<{_build.ctype(dtype)}, {attention_threads}>"


def ring_stages(kern=None) -> int:
    """Slots of the weight ring the step's block holds in this GPU's shared memory (at most
    MAX_STAGES): the opt-in limit of a block less the kernel's static shared memory."""
    kern = kern or _build.kernel(_SRC, _name(numpy.float16, ATTENTION_THREADS[0]))
    static = getattr(kern, "raw", kern).shared_size_bytes
    return min(MAX_STAGES, (_build.smem_optin() - static) // STAGE_BYTES)


def unsupported(dtype, C: int, H: int, attention_threads: int) -> str | None:
    """Why the fused step cannot run a model of these sizes here (None: it can)."""
    if numpy.dtype(dtype).itemsize != 2:
        return f"the fused decode step takes float16 / bfloat16 models, not {numpy.dtype(dtype)}"
    if H * HEAD_DIM != C or C > MAX_C:
        return f"the fused decode step takes heads of {HEAD_DIM} and widths up to {MAX_C}, not {H} heads of {C}"
    if attention_threads not in ATTENTION_THREADS:
        return f"the fused decode step runs attention in blocks of {ATTENTION_THREADS} threads, not {attention_threads}"
    if not _build.cooperative_supported():
        return "this GPU or process cannot make cooperative launches (cuda.bindings missing?)"
    if ring_stages() < MIN_STAGES:
        return f"this GPU's shared memory holds fewer than {MIN_STAGES} slots of the fused step's weight ring"
    return None


def decode_step(tokens, positions, seq_lens, x, qkv, f, stats, k_cache, v_cache, layers: list[dict], wte, wpe,
                lm_head, head_u, head_c, *, eps: float, split_keys: int, attention_threads: int, trace=None) -> None:
    """One decode step of one sequence, in place: x [1, C] <- embedding of tokens[0] at
    positions[0], the blocks (keys and values into k_cache / v_cache [L, 1, H, S_max, 64] at
    positions[0], seq_lens[0] <- positions[0] + 1), then tokens[0] <- argmax of the logits and
    positions[0] += 1. qkv [1, 3C], f [1, 4C] and stats float32 [1, C / 16, 2] are work space.

    ``layers``: per block, the arrays of LAYER_KEYS, with the LayerNorms folded into the
    products as the model folds them (``fold_layernorm``): attn_u / attn_c, fc_u / fc_c and
    head_u / head_c float32 (the first block's q|k|v folds its LayerNorm from the statistics of
    the embedding's row, as the model's step does). ``split_keys``: keys per chunk of the cache in attention (as
    decode_attention's split_keys; every chunk is merged, one alone included) and
    ``attention_threads`` (its threads per block, 128 or 512): the step's attention then has
    decode_attention's bits. Launched on the current stream; records into a plan.

    ``trace``: None, or a uint64 array [SMs, trace_marks(L)] that receives each block's global
    timer (ns) at the marks of its timeline and at its first STAGE_TRACE ring stages
    (split_trace; decode_step.cu's Trace)."""
    x = _checks.float_array(x, "x", ndim=2)
    if x.dtype.itemsize != 2:
        raise TypeError(f"x must be float16 or bfloat16, got {x.dtype}")
    if x.shape[0] != 1:
        raise ValueError(f"the fused decode step runs one sequence, got x of shape {x.shape}")
    C = x.shape[1]
    L, B_cache, H, S_max, D = k_cache.shape
    if D != HEAD_DIM or H * D != C or C > MAX_C:
        raise ValueError(f"k_cache {k_cache.shape} does not match x {x.shape} (heads of {HEAD_DIM}, C <= {MAX_C})")
    if B_cache != 1 or v_cache.shape != k_cache.shape or k_cache.dtype != x.dtype or v_cache.dtype != x.dtype:
        raise ValueError(f"k_cache / v_cache must be [L, 1, H, S_max, 64] of {x.dtype}")
    if not (k_cache.flags.c_contiguous and v_cache.flags.c_contiguous):
        raise ValueError("k_cache and v_cache must be contiguous")
    if len(layers) != L:
        raise ValueError(f"{len(layers)} layers for a cache of {L}")
    if attention_threads not in ATTENTION_THREADS:
        raise ValueError(f"attention_threads must be one of {ATTENTION_THREADS}, got {attention_threads!r}")
    if not isinstance(split_keys, (int, numpy.integer)) or split_keys < 1:
        raise ValueError(f"split_keys must be a positive integer, got {split_keys!r}")
    splits = _build.cdiv(S_max, split_keys)
    for name, a, shape, dtype in (("tokens", tokens, (1,), numpy.int32), ("positions", positions, (1,), numpy.int32),
                                  ("seq_lens", seq_lens, (1,), numpy.int32), ("qkv", qkv, (1, 3 * C), x.dtype),
                                  ("f", f, (1, 4 * C), x.dtype), ("stats", stats, (1, C // 16, 2), numpy.float32),
                                  ("wte", wte, (wte.shape[0], C), x.dtype), ("wpe", wpe, (wpe.shape[0], C), x.dtype),
                                  ("lm_head", lm_head, (lm_head.shape[0], C), x.dtype),
                                  ("head_u", head_u, (lm_head.shape[0],), numpy.float32),
                                  ("head_c", head_c, (lm_head.shape[0],), numpy.float32)):
        if not isinstance(a, cupy.ndarray) or a.shape != shape or a.dtype != dtype or not a.flags.c_contiguous:
            raise ValueError(f"{name} must be a contiguous {numpy.dtype(dtype)} array of shape {shape}")
    shapes = {"attn_w": (3 * C, C), "attn_b": (3 * C,), "attn_u": (3 * C,), "attn_c": (3 * C,), "proj_w": (C, C),
              "proj_b": (C,), "fc_w": (4 * C, C), "fc_u": (4 * C,), "fc_c": (4 * C,), "mlp_w": (C, 4 * C),
              "mlp_b": (C,)}
    table = numpy.zeros((L, _LAYER_PTRS), dtype=numpy.uint64)
    for i, layer in enumerate(layers):
        for j, key in enumerate(LAYER_KEYS):
            a = layer[key]
            dtype = numpy.float32 if key.endswith(("_u", "_c")) else x.dtype
            if not isinstance(a, cupy.ndarray) or a.shape != shapes[key] or a.dtype != dtype or not a.flags.c_contiguous:
                raise ValueError(f"layer {i} {key} must be a contiguous {numpy.dtype(dtype)} array of shape "
                                 f"{shapes[key]}")
            table[i, j] = a.data.ptr
    grid = _build.sm_count(cupy.cuda.Device().id)
    marks = trace_marks(L)
    if trace is not None and (not isinstance(trace, cupy.ndarray) or trace.dtype != numpy.uint64
                              or trace.shape != (grid, marks) or not trace.flags.c_contiguous):
        raise ValueError(f"trace must be a contiguous uint64 array of shape {(grid, marks)}")
    kern = _build.kernel(_SRC, _name(x.dtype, attention_threads))
    stages = ring_stages(kern)
    if stages < MIN_STAGES:
        raise RuntimeError(f"the fused decode step needs {MIN_STAGES} weight-ring slots of {STAGE_BYTES} bytes of "
                           f"shared memory; this GPU has room for {stages}")
    _build.set_smem(kern, stages * STAGE_BYTES)
    part_o = cupy.empty(splits * H * D, dtype=numpy.float32)
    part_lse = cupy.empty(splits * H, dtype=numpy.float32)
    best_val = cupy.empty(grid, dtype=numpy.float32)
    best_idx = cupy.empty(grid, dtype=numpy.int32)
    # the barrier, blocks done, then per head splits done and q|k|v tiles done; the kernel leaves it zero
    sync = cupy.zeros(2 + 2 * H, dtype=numpy.uint32)
    kern((grid,), (THREADS,),
         (tokens, positions, seq_lens, x, qkv, f, stats, part_o, part_lse, best_val, best_idx, sync, k_cache, v_cache,
          cupy.asarray(table), wte, wpe, lm_head, head_u, head_c, i32(L), i32(C), i32(H), i32(S_max),
          i32(lm_head.shape[0]), i32(splits), i32(split_keys), i32(_mma_warps(C)), i32(_mma_warps(4 * C)),
          i32(stages), f32(eps),
          f32(1.0 / numpy.sqrt(D)), 0 if trace is None else trace, i32(marks)), shared_mem=stages * STAGE_BYTES)
