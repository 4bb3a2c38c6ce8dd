"""The generation engine: what turns the model's prefill and decode step into a stream
of tokens without stalling the GPU.

A :class:`Session` holds everything one shape of generation needs (the decode buffers, a
KV cache, the recorded LM head and decode step, the decode step's CUDA graphs, a stream
of its own and a pinned ring for token read-back). Sessions are kept per model and
reused by later calls whose batch and cache length round up to the same bucket, so a
warm call records nothing and captures nothing. A session's graphs: one step, and
``STEPS_PER_GRAPH`` steps in a row, whose kernels chain from one step into the next with
programmatic dependent launch (the next step's first product starts while the step before
ends, as the kernels inside a step do; in greedy 16-bit steps the argmax before it wrote its
embedding) and without a graph launch between them, and, captured at the first call that
reads every step (``generate`` without an end-of-text token or a stop string), the same chain of
``STEPS_PER_GRAPH_FIXED_LENGTH`` steps. :meth:`Engine.steps` runs the longest one the call
may take wherever it has that many steps left. Tokens come back asynchronously: the host
queues up to two launches of the longest graph (continuous batching: ``LOOKAHEAD`` steps),
each launch followed by an event, and reads a step's tokens only when the event after it
has fired. A kernel after each step
(``publish_tokens``; in the longer graphs on a branch beside the chain, PUBLISH_ASIDE) writes
the step's tokens straight into the next slot of a ring of pinned host memory: a
device-to-host copy after each step cost 9-10 us of wall time a step (H100, GPT-2 small
float16, 512 steps: 245.4 against 235.9 us at batch 1, 613.1 against 604.2 at batch 64; the
copy as a node of the step's graph measured the same). The first tokens of a prefill are copied.
A sequence that ends (end-of-text) may cost a few steps of wasted GPU work; the tokens
returned are exact.

Continuous batching (:meth:`Engine.continuous`): more prompts than slots. A session of
``max_batch`` slots and one captured step; the next prompts are prefilled together into
the free slots (their first tokens from an LM head over their rows) while the other slots
keep their place in the pipeline, and a slot is refilled when its sequence ends. Every
sequence gets the tokens it gets alone (greedy): neither the prefill's numbers nor the
step's depend on the batch.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

import cupy
import cupyx
import numpy

import cupy_kernels as K
from cupy_kernels import _build

LOOKAHEAD = 4  # decode steps continuous batching queues ahead of the host's read-back
# Decode steps one launch of a session's longer graph runs (Engine.steps; 1: one graph a step).
# H100, float16, us a step over 512 steps from 8 cached keys on one session's buffers and the
# wall time a token of a 512-token call, 4 / 1 / 2 / 8 steps a graph (benchmarks/results/
# steps_per_graph-h100.json, publish_tokens in the chain): GPT-2 small at batch 1 185.76 /
# 188.27 / 186.69 / 185.30 (calls 187.3 / 189.7 / 188.2 / 186.9), XL 1508.91 / 1511.42 /
# 1510.04 / 1507.48 (1513.1 / 1515.9 / 1514.4 / 1511.8). Eight would take 0.25% more off GPT-2
# small's step at twice the wasted steps after an end-of-text. H200, 4 / 8 / 16 steps a graph
# (benchmarks/results/steps_per_graph-h200.json, sweeps): GPT-2 small float16 at batch 1 165.06
# / 164.20 / 163.84, at batch 8 219.56 / 218.37 / 217.72, XL 1295.07 / 1293.97 / 1293.03. 16
# would save GPT-2 small 1.2 us a token (0.6 ms over 512 tokens), but a call that ends on an
# end-of-text token can run up to two graphs past it (the host learns of a graph's tokens at its
# end): about 31 steps, 5 ms of GPT-2 small's or 40 ms of XL's, against 7 steps at 4.
STEPS_PER_GRAPH = 4
# Decode steps a launch of a session's graph for calls whose every step is read: generate
# without an end-of-text token or a stop string (Engine.steps' fixed_length), where nothing can
# stop the call early, so that a graph launch of more steps wastes none. H200, us a token of a
# 512-token call on one session's buffers, 16 / 4 / 32 steps a graph (benchmarks/results/
# fixed_length_graph-h200.json): GPT-2 small float16 at batch 1 161.8 / 162.9 / 162.1, bfloat16
# 167.3 / 168.2 / 167.6, float16 at batch 8 218.7 / 220.1 / 218.2, XL 1298.7 / 1299.8 / 1298.7.
STEPS_PER_GRAPH_FIXED_LENGTH = 16
# In the graph of several steps, each step's publish_tokens runs on a branch of the graph beside
# the chain (after its step's argmax), joining the chain before the next step's LM head (whose
# argmax rewrites the tokens it reads) and at the graph's end, so that the next step follows the
# argmax directly. H100, 4 steps a graph, branch / chain, us a step as above:
# GPT-2 small at batch 1 186.30 / 186.67 (calls 187.7 / 188.2), XL 1515.71 / 1517.02 (1520.2 /
# 1521.4; benchmarks/results/publish_join-h100.json, with the join; racecheck on 3 layers of
# GPT-2 small, 10 tokens at batch 1 and 3: no hazard, publish_join_racecheck-h100.log); without
# the join (publish_aside-h100.json, another machine) 185.32 / 186.11, at batch 8 235.92 /
# 236.59, XL 1525.56 / 1526.47.
PUBLISH_ASIDE = True
MAX_SESSIONS = 4  # sessions kept per model (least recently used idle ones go first)
MIN_CACHE = 64  # smallest cache-length bucket
# Continuous batching refills free slots once 1 / REFILL_FRACTION of them are free: a prefill
# costs the host milliseconds of launches whatever it packs, so refilling slot by slot left
# the GPU waiting. 1,000-prompt workload, GPT-2 small float16, H100, 64 / 256 slots: 29,777 /
# 53,033 tok/s refilled one by one, 49,570 / 68,668 with 8 (benchmarks/results/
# e2e_workload-h100.json; the first figures are in the file's previous commit).
REFILL_FRACTION = 8


def batch_bucket(B: int) -> int:
    """Rows a session runs for B sequences: the next power of two."""
    return 1 << (B - 1).bit_length()


def length_bucket(n: int, n_positions: int) -> int:
    """Cache rows a session holds for sequences of up to n tokens: the next power of two
    (at least MIN_CACHE), at most the model's positions."""
    return min(n_positions, max(MIN_CACHE, 1 << (n - 1).bit_length()))


def _emit(tokens, done: list[bool], eos_token_id) -> list[int | None]:
    """One step's new token per sequence (None where it had finished); marks the sequences
    that just produced ``eos_token_id`` as done."""
    step = []
    for b, finished in enumerate(done):
        if finished:
            step.append(None)
            continue
        t = int(tokens[b])
        step.append(t)
        done[b] = eos_token_id is not None and t == eos_token_id
    return step


def free_bytes() -> int:
    """GPU memory this process can still allocate: free on the device plus what CuPy's pool
    holds unused."""
    return cupy.cuda.runtime.memGetInfo()[0] + cupy.get_default_memory_pool().free_bytes()


class DecodeBuffers:
    """Everything one decode step reads or writes, allocated before the first step."""

    def __init__(self, config, batch: int, dtype):
        B, C = batch, config.n_embd
        self.tokens = cupy.zeros(B, dtype=numpy.int32)  # the token each sequence feeds next
        self.x = cupy.zeros((B, C), dtype=dtype)  # residual stream
        self.qkv = cupy.zeros((B, 3 * C), dtype=dtype)
        self.att = cupy.zeros((B, config.n_head, config.head_dim), dtype=dtype)
        self.f = cupy.zeros((B, 4 * C), dtype=dtype)
        self.logits = cupy.zeros((B, config.vocab_size), dtype=numpy.float32)
        self.offsets = cupy.zeros(B, dtype=numpy.uint64)  # sampling counters
        self.stats = cupy.zeros((B, -(-C // 16), 2), dtype=numpy.float32)  # row statistics of x (linear's stats_out)


class Session:
    """Buffers, cache, recorded launches and graph for one (batch, cache length, KV-cache
    dtype, sampling settings) bucket of one model, on a stream of its own."""

    def __init__(self, model, batch: int, max_len: int, kv_dtype, sampling: dict | None, cuda_graph: bool):
        from .model import KVCache

        self.batch, self.max_len = batch, max_len
        self.stream = cupy.cuda.Stream(non_blocking=True)
        with self.stream:
            self.buf = DecodeBuffers(model.config, batch, model.dtype)
            self.cache = KVCache(model.config, batch, max_len, model.dtype, kv_dtype)
            with _build.recording() as self.head:
                model.head(self.buf, sampling)
            self.step = model.record_step(self.cache, self.buf, sampling)
        # (The step's rows split into groups replayed on parallel branches of one graph, each
        # group reading every weight, measured on the H100, GPT-2 small float16, 264 cached
        # keys, us a step, one group / two / four: batch 8 297 / 348, batch 64 658 / 697 / 882,
        # batch 256 2073 / 1930 / 2075; GPT-2 XL at 64 6016 / 5826. Not used.)
        # (The weights requested into L2 ahead of the products, by l2_prefetch launches on a
        # branch of the graph beside the chain, were measured slower on the H100 at every lead
        # (0.2 / 0.4 / 0.6 of the L2 past the weights read, against none; the step with PDL at 264
        # cached keys, us): GPT-2 small float16 at batch 1 244.6 / 242.7 / 247.3 against 239.3, 64
        # 636.7 / 638.7 / 645.1 against 608.3; GPT-2 XL at 1 2064.6 / 2158.3 / 2155.1 against
        # 1873.7. The branch itself costs nothing: its 193 launches with 26 KB each left XL's step
        # at 1882.1 us, as without them (1882.1; a 0.2 lead 2065.1, same run): the requests'
        # traffic lengthens the chain, which waits on memory latency more than on bandwidth.
        # Commit 20cfc30 holds the kernel, the schedule and benchmarks/l2_prefetch.py;
        # benchmarks/results/l2_prefetch-h100.json its results.)
        self.busy = False
        self._model, self._sampling, self._heads = model, sampling, {}
        self._cuda_graph = cuda_graph
        self.set_steps_per_graph(STEPS_PER_GRAPH)

    def set_steps_per_graph(self, n: int, fixed_length: int | None = None) -> None:
        """Make the ring of read-back slots, ``publish_tokens``'s launch and the graphs for
        ``n`` steps a launch of the longer graph and ``fixed_length`` (default
        STEPS_PER_GRAPH_FIXED_LENGTH, at least ``n``) of the graph for calls that read every
        step, captured by :meth:`prepare_fixed_length` (without CUDA graphs, or with ``n`` 1,
        one step a launch for every call)."""
        fixed_length = STEPS_PER_GRAPH_FIXED_LENGTH if fixed_length is None else fixed_length
        for what, v in (("steps a graph", n), ("steps a fixed-length graph", fixed_length)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{what} must be a positive int, got {v!r}")
        self.per_graph = n if self._cuda_graph else 1
        self.per_graph_fixed = max(fixed_length, n) if self.per_graph > 1 else self.per_graph
        with self.stream:
            # the longer graph's first step (its argmax embedding the next step's tokens where the
            # model does that: embeds_in_argmax) and the steps after it (record_step's chained)
            model, many = self._model, self.per_graph > 1
            self.step_lead = model.record_step(self.cache, self.buf, self._sampling, embed_next=True) \
                if many and model.embeds_in_argmax(self._sampling) else self.step
            self.step_next = model.record_step(self.cache, self.buf, self._sampling, chained=True) if many else None
            # the ring: a step's tokens go to row slot[0], which moves on; two longest graphs'
            # worth of rows, so that the host reads one's tokens while the next runs
            self.slots = max(LOOKAHEAD, 2 * self.per_graph_fixed)
            self.pinned = cupyx.empty_pinned((self.slots, self.batch), dtype=numpy.int32)
            self.slot = cupy.zeros(1, dtype=numpy.int32)
            with _build.recording() as self.publish:
                K.publish_tokens(self.buf.tokens, self.pinned, self.slot)
        self._next_slot = 0
        pdl = _build.pdl_supported()
        self.graph = self.capture(pdl) if self._cuda_graph else None
        self.graph_many = self.capture_many(pdl, self.per_graph) if self.per_graph > 1 else None
        self.graph_fixed = self.graph_many if self.per_graph_fixed == self.per_graph else None
        self.events = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(self.slots)]
        self._event_of = list(range(self.slots))  # slot -> the event recorded after its launch

    def capture(self, pdl: bool, publish: bool = True):
        """The decode step (and ``publish_tokens``) as a CUDA graph on the session's stream,
        with programmatic dependent launch where ``pdl``."""
        self.stream.synchronize()
        return _build.capture(self.stream, self.step, *([self.publish] if publish else []), pdl=pdl)

    def prepare_fixed_length(self) -> None:
        """Capture the graph of ``per_graph_fixed`` steps (a call that reads every step), once."""
        if self.graph_fixed is None and self.per_graph_fixed > 1:
            self.graph_fixed = self.capture_many(_build.pdl_supported(), self.per_graph_fixed)

    def capture_many(self, pdl: bool, n: int):
        """``n`` decode steps in a row, each followed by ``publish_tokens``, as one
        CUDA graph: the first step as ``step_lead``, the others as ``step_next``; with
        PUBLISH_ASIDE, each ``publish_tokens`` on a branch that joins the chain before the next
        step's LM head (``head_at`` of a recorded step; a step without it joins at its start)."""
        steps = [self.step_lead] + [self.step_next] * (n - 1)
        self.stream.synchronize()
        if not PUBLISH_ASIDE:
            return _build.capture(self.stream, *[p for step in steps for p in (step, self.publish)], pdl=pdl)
        side = cupy.cuda.Stream(non_blocking=True)

        def mark(stream):
            event = cupy.cuda.Event(block=False, disable_timing=True)
            event.record(stream)
            return event

        self.stream.begin_capture()
        try:
            with self.stream:
                published = None  # the event after the step before's publish_tokens, on the branch
                for step in steps:
                    at = getattr(step, "head_at", 0)
                    _build.Plan(step[:at]).replay(pdl=pdl)
                    if published is not None:
                        self.stream.wait_event(published)  # its tokens read before this step rewrites them
                    _build.Plan(step[at:]).replay(pdl=pdl)
                    side.wait_event(mark(self.stream))
                    with side:
                        self.publish.replay()
                    published = mark(side)
                self.stream.wait_event(published)
        finally:
            graph = self.stream.end_capture()
        return graph

    def rows_head(self, k: int):
        """(buffers of batch_bucket(k) rows, the LM head recorded on them): the first tokens
        of k refilled slots, from rows 0 .. k - 1 of its x."""
        rows = batch_bucket(k)
        if rows not in self._heads:
            with self.stream:
                buf = DecodeBuffers(self._model.config, rows, self._model.dtype)
                with _build.recording() as plan:
                    self._model.head(buf, self._sampling)
            self._heads[rows] = (buf, plan)
        return self._heads[rows]

    def run_step(self, slot: int, n: int = 1) -> None:
        """``n`` decode steps (1, ``per_graph``: the longer graph, or ``per_graph_fixed``: the
        fixed-length calls' graph, once prepared) on the session's stream, their tokens into
        pinned slots ``slot``, ``slot + 1``, ... (modulo ``slots``), marked by one event after
        them."""
        graphs = {self.per_graph: self.graph_many, self.per_graph_fixed: self.graph_fixed}
        if n != 1 and graphs.get(n) is None:
            runs = sorted({1} | {k for k, g in graphs.items() if g is not None})
            raise ValueError(f"this session runs {' or '.join(map(str, runs))} steps a launch, not {n}")
        if slot != self._next_slot:  # (a prefill's tokens took the slots in between)
            with self.stream:
                self.slot.fill(slot)
        if n != 1:
            graphs[n].launch(stream=self.stream)
        elif self.graph is not None:
            self.graph.launch(stream=self.stream)
        else:
            with self.stream:
                self.step.replay()
                self.publish.replay()
        last = (slot + n - 1) % self.slots
        self._next_slot = (last + 1) % self.slots
        self.events[last].record(self.stream)
        for j in range(n):
            self._event_of[(slot + j) % self.slots] = last

    def send_tokens(self, slot: int) -> None:
        """Queue a copy of the current tokens (a prefill's) into pinned slot ``slot`` and mark it."""
        nbytes = self.batch * 4
        dst = self.pinned[slot].ctypes.data
        cupy.cuda.runtime.memcpyAsync(dst, self.buf.tokens.data.ptr, nbytes,
                                      cupy.cuda.runtime.memcpyDeviceToHost, self.stream.ptr)
        self.events[slot].record(self.stream)
        self._event_of[slot] = slot

    def receive_tokens(self, slot: int) -> numpy.ndarray:
        self.events[self._event_of[slot]].synchronize()
        return self.pinned[slot].copy()


class Engine:
    """The sessions of one model, and the generation loop over them."""

    def __init__(self, model):
        self.model = model
        self._sessions: collections.OrderedDict[tuple, list[Session]] = collections.OrderedDict()

    def _key(self, B: int, n_max: int, kv_dtype, sampling, cuda_graph) -> tuple:
        """The session bucket of a call: (batch rows, cache rows, kv dtype, sampling, graph, the
        model's fused_step, which changes the step it records)."""
        return (batch_bucket(B), length_bucket(n_max, self.model.config.n_positions), kv_dtype,
                None if sampling is None else tuple(sorted(sampling.items())), bool(cuda_graph),
                bool(self.model.fused_step))

    def _acquire(self, B: int, n_max: int, kv_dtype, sampling, cuda_graph) -> Session:
        key = self._key(B, n_max, kv_dtype, sampling, cuda_graph)
        pool = self._sessions.setdefault(key, [])
        self._sessions.move_to_end(key)
        for s in pool:
            if not s.busy:
                s.busy = True
                return s
        while sum(len(p) for p in self._sessions.values()) >= MAX_SESSIONS:
            if not self._evict_one():
                break
        s = Session(self.model, key[0], key[1], kv_dtype, sampling, cuda_graph)
        s.busy = True
        self._sessions.setdefault(key, []).append(s)
        return s

    def _evict_one(self) -> bool:
        for key, pool in self._sessions.items():  # oldest key first
            for s in pool:
                if not s.busy:
                    pool.remove(s)
                    if not pool:
                        del self._sessions[key]
                    return True
        return False

    def sessions(self) -> int:
        """How many sessions are kept now."""
        return sum(len(p) for p in self._sessions.values())

    def steps(self, rows, max_new_tokens: int, sampling: dict | None, eos_token_id, cuda_graph: bool, kv_dtype,
              fixed_length: bool = False):
        """Iterator over decoding steps: a list with one new token id per sequence (None
        for a sequence that has finished). Inputs were checked by the model. ``fixed_length``:
        the caller reads every step (no end-of-text token, nothing that stops it early), so
        the session's graph of ``per_graph_fixed`` steps runs where that many are left."""
        B = len(rows)
        s = self._acquire(B, max(r.size for r in rows) + max_new_tokens, kv_dtype, sampling, cuda_graph)
        seqs_done = [False] * B
        try:
            sizes = [s.per_graph, 1]  # steps a launch, the largest first
            if fixed_length and eos_token_id is None and max_new_tokens - 1 >= s.per_graph_fixed > s.per_graph:
                s.prepare_fixed_length()
                sizes.insert(0, s.per_graph_fixed)
            with s.stream:
                # the prompts packed: prompt b's keys and values into cache row b, its last residual into row b of x
                self.model._prefill(rows, s.cache, list(range(B)), s.buf.x[:B])
                positions = numpy.zeros(s.batch, dtype=numpy.int32)  # rows past B: idle sequences at 0
                positions[:B] = [r.size for r in rows]
                s.cache.positions.set(positions)
                if sampling is not None:
                    s.buf.offsets.fill(0)
                s.head.replay()
            s.send_tokens(0)
            issued, read = 1, 0  # steps' tokens queued (the prefill's first) / read back
            while read < max_new_tokens:
                while issued < max_new_tokens:
                    n = next(k for k in sizes if max_new_tokens - issued >= k)
                    if issued + n - read > s.slots:
                        break
                    s.run_step(issued % s.slots, n)
                    issued += n
                tokens = s.receive_tokens(read % s.slots)
                read += 1
                yield _emit(tokens, seqs_done, eos_token_id)
                if all(seqs_done):
                    return
        finally:
            s.busy = False

    def continuous(self, rows, budgets: list[int], sampling: dict | None, eos_token_id, max_batch: int,
                   cuda_graph: bool, kv_dtype, stop: Callable[[int, int], bool] | None = None,
                   progress: bool = False) -> Iterator[tuple[int, int]]:
        """Continuous batching: yields (prompt index, token) as tokens come back, for every
        prompt, through ``min(max_batch, len(rows))`` slots. ``budgets[p]``: prompt p's
        new tokens at most; ``stop(p, token)`` True ends prompt p after that token (as
        end-of-text does). Inputs were checked by the model, the memory by ``fits``."""
        n = len(rows)
        slots = min(max_batch, n)
        s = self._acquire(slots, max(r.size + m for r, m in zip(rows, budgets)), kv_dtype, sampling, cuda_graph)
        pending = collections.deque(p for p in range(n) if budgets[p] > 0)
        holder: list[int | None] = [None] * s.batch  # the prompt each slot holds at issue time
        issued, got = [0] * n, [0] * n  # tokens issued / read back per prompt
        done = [budgets[p] == 0 for p in range(n)]
        idle = dict.fromkeys(range(s.batch), 0)  # free slot -> steps since it was parked at row 0
        inflight: collections.deque[tuple[int, dict[int, int]]] = collections.deque()
        ring = 0
        bar = None

        def send(attrib: dict[int, int], step: bool) -> None:  # a step's tokens, or a prefill's
            nonlocal ring
            if step:
                s.run_step(ring)
            else:
                s.send_tokens(ring)
            inflight.append((ring, attrib))
            ring = (ring + 1) % s.slots

        def release(slot: int) -> None:  # park the slot at row 0 (its position stays inside the cache)
            holder[slot] = None
            with s.stream:
                s.cache.positions[slot:slot + 1].fill(0)
            idle[slot] = 0

        try:
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=n, unit="prompt", initial=sum(done))
            with s.stream:
                s.cache.positions.fill(0)
                s.buf.tokens.fill(0)
            while pending or inflight or any(h is not None for h in holder):
                free = [slot for slot in range(slots) if holder[slot] is None]
                # refill once 1 / REFILL_FRACTION of the slots (or every pending prompt) can go in at once
                want = min(len(pending), max(1, slots // REFILL_FRACTION))
                if pending and len(free) >= want and len(inflight) < LOOKAHEAD:
                    # the next prompts into the free slots: prefilled together, first tokens from a head of their rows
                    take = free[:len(pending)]
                    ps = [pending.popleft() for _ in take]
                    buf, head = s.rows_head(len(ps))
                    k = len(ps)
                    with s.stream:
                        self.model._prefill([rows[p] for p in ps], s.cache, take, buf.x[:k])
                        if sampling is not None:  # random numbers (offset, row): prompt p's own offsets
                            buf.offsets[:k].set(numpy.asarray(ps, dtype=numpy.uint64) << numpy.uint64(32))
                        head.replay()
                        at = cupy.asarray(numpy.asarray(take, dtype=numpy.int32))
                        s.buf.tokens[at] = buf.tokens[:k]
                        if sampling is not None:
                            s.buf.offsets[at] = buf.offsets[:k]
                        s.cache.positions[at] = cupy.asarray(numpy.asarray([rows[p].size for p in ps], numpy.int32))
                    attrib = dict(zip(take, ps))
                    for slot, p in attrib.items():
                        holder[slot], issued[p] = p, 1
                        del idle[slot]
                    send(attrib, step=False)
                    for slot, p in attrib.items():
                        if issued[p] >= budgets[p]:
                            release(slot)
                elif any(h is not None for h in holder) and len(inflight) < LOOKAHEAD:
                    attrib = {slot: p for slot, p in enumerate(holder) if p is not None}
                    send(attrib, step=True)
                    for slot, p in attrib.items():
                        issued[p] += 1
                        if issued[p] >= budgets[p]:
                            release(slot)
                    for slot in idle:  # free slots step too: back to row 0 before the cache ends
                        idle[slot] += 1
                        if idle[slot] >= s.max_len - 1:
                            release(slot)
                else:
                    at, attrib = inflight.popleft()
                    tokens = s.receive_tokens(at)
                    for slot, p in attrib.items():
                        if done[p]:
                            continue  # steps issued after its end
                        t = int(tokens[slot])
                        got[p] += 1
                        yield p, t
                        if got[p] >= budgets[p] or (eos_token_id is not None and t == eos_token_id) or (
                                stop is not None and stop(p, t)):
                            done[p] = True
                            if bar is not None:
                                bar.update(1)
                            if holder[slot] == p:
                                release(slot)
        finally:
            s.busy = False
            if bar is not None:
                bar.close()

    def fits(self, batch: int, n_max: int, prefill_tokens: int, kv_dtype, sampling, cuda_graph) -> None:
        """MemoryError, before anything runs, when a session for ``batch`` sequences of up to
        ``n_max`` tokens (prefills of up to ``prefill_tokens`` tokens at once) cannot be
        allocated in the GPU memory free now. An idle session of the same bucket is reused: nothing to check."""
        from cupy_kernels import kv_storage_dtype

        from .model import RECORD_TOKENS

        cfg, dtype = self.model.config, self.model.dtype
        key = self._key(batch, n_max, kv_dtype, sampling, cuda_graph)
        B, S = key[0], key[1]
        if any(not s.busy for s in self._sessions.get(key, ())):
            return
        storage = kv_storage_dtype(kv_dtype, dtype)
        rows = cfg.n_layer * B * cfg.n_head * S
        need = 2 * rows * cfg.head_dim * storage.itemsize + (2 * rows * 4 if storage != dtype else 0)
        # the step's and the heads' buffers (9 C values a row, and C / 2 bytes of row statistics)
        need += 3 * B * (cfg.vocab_size * 4 + 10 * cfg.n_embd * dtype.itemsize)
        need += prefill_tokens * 16 * cfg.n_embd * 4  # a prefill's activations (q|k|v, MLP, attention; float32 bound)
        need += RECORD_TOKENS * 12 * cfg.n_embd * dtype.itemsize  # recorded prefills' buffers (11 C a token)
        free = free_bytes()
        if need > free:  # idle sessions give their memory back first
            while self._evict_one():
                pass
            free = free_bytes()
        if need > free:
            raise MemoryError(
                f"a KV cache for {B} slots of {S} tokens needs {need / 2**30:.2f} GiB and {free / 2**30:.2f} GiB "
                "of GPU memory are free: lower max_batch or max_new_tokens")

    def steps_without_cache(self, rows, max_new_tokens: int, sampling: dict | None, eos_token_id):
        """Like :meth:`steps`, recomputing every sequence in full for each new token."""
        m = self.model
        B = len(rows)
        buf = DecodeBuffers(m.config, B, m.dtype)
        with _build.recording() as head:
            m.head(buf, sampling)
        seqs = [list(map(int, r)) for r in rows]
        done = [False] * B
        for _ in range(max_new_tokens):
            m._prefill([numpy.asarray(sq) for sq in seqs], None, None, buf.x)
            head.replay()
            step = _emit(buf.tokens.get(), done, eos_token_id)
            for b, t in enumerate(step):
                if t is not None:
                    seqs[b].append(t)
            yield step
            if all(done):
                return


__all__ = ["DecodeBuffers", "Engine", "Session", "LOOKAHEAD", "PUBLISH_ASIDE", "REFILL_FRACTION", "STEPS_PER_GRAPH",
           "batch_bucket", "free_bytes", "length_bucket"]
