"""The performance model of one inference node: a clock-free, event-driven imitation of vLLM.

One model serves both the live simulated node (:mod:`zml.sim.node`, on an asyncio loop) and
trace replay in virtual time (:mod:`zml.sim.replay`): the caller owns the clock and passes
``now`` to every call; nothing here sleeps, reads a clock or does I/O. The loop is::

    node.admit(request, now)          # "queued" | "running" | "queue_full" | "exceeds_kv_cache"
    t = node.next_event_time()        # inf when nothing is pending
    events = node.advance(t)          # NodeEvent("started" | "first_token" | "finished", ...)

so a discrete-event simulation jumps from event to event, and a live node sleeps until
``next_event_time()`` (re-computed whenever a request arrives or leaves).

What a request goes through (times in seconds, every duration multiplied by ``time_scale``):

1. **Queue.** FIFO, strictly in order: the head starts (takes a slot) once fewer than
   ``max_concurrency`` requests run and the KV cache has room for its ``prompt + output``
   tokens (reserved for its whole life, as vLLM would need them at the end). ``admit`` answers
   ``queue_full`` when the node already holds ``max_concurrency + queue_size`` requests, and
   ``exceeds_kv_cache`` when the request could never fit.
2. **Overhead.** Holding its slot, the request spends ``ttft_ms`` (the fixed part of the time
   to first token: scheduling, tokenization) before it joins the prefill lane; overheads of
   several requests run side by side.
3. **Prefill.** Running requests are prefilled one after another (the prefill lane), each for
   ``uncached / prefill_tokens_per_s``. ``uncached`` is the prompt minus its leading blocks
   found in the prefix cache (at least one token is always computed). The first token is out
   when the prefill ends.
4. **Decode (continuous batching).** All decoding sequences advance together, one token per
   step; a step takes ``(1 + batch_slowdown x (n - 1)) / tokens_per_s`` seconds plus
   ``context_ms_per_1k_tokens`` per 1,000 tokens of context held by the ``n`` decoding sequences
   (each counts ``prompt + output / 2``, its mean context while it decodes). So tokens/s per
   request fall as the node fills. A request is finished after ``output_tokens - 1`` steps.

Prefix cache: blocks of ``BLOCK_TOKENS`` (512) prompt tokens, identified by the caller (replay:
the trace's block hashes; live: :func:`prompt_blocks`). Only full blocks are cached. When a
request's prefill starts, its leading blocks present in the cache are hits (the run stops at
the first miss); when the prefill ends, its full blocks are inserted (most recently used). The
cache holds at most ``(kv_cache_tokens - reserved by running requests) / 512`` blocks, least
recently used evicted first. ``cached_tokens_total / prompt_tokens_total`` is the node's
prefix-cache hit rate (in tokens, as vLLM reports it).

Simplifications, on purpose: prefill does not slow the decode steps running beside it, there
is no preemption (KV is reserved up front), and one prefill runs at a time.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

from zml.prefix import BLOCK_TOKENS, prompt_blocks
from zml.sim.profiles import FamilyProfile
from zml.validation import check_scale

__all__ = [
    "BLOCK_TOKENS",
    "Admission",
    "ModelRequest",
    "NodeEvent",
    "NodeModel",
    "prompt_blocks",
]


Admission = Literal["queued", "running", "queue_full", "exceeds_kv_cache"]

_INF = math.inf
_WAITING, _TRANSIT, _PREFILL, _DECODE, _DONE = range(5)


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """One request as the node model sees it."""

    key: Hashable
    """The caller's id for the request (unique among the node's requests in flight)."""
    prompt_tokens: int
    """Prompt length in tokens (at least 1)."""
    output_tokens: int
    """Tokens the request generates (at least 1)."""
    blocks: tuple[Hashable, ...] = ()
    """Ids of the prompt's 512-token blocks, in prompt order (equal ids = equal prefix)."""


@dataclass(frozen=True, slots=True)
class NodeEvent:
    """Something that happened to a request at ``time``: it got a slot (``started``), its
    prefill ended (``first_token``), it generated its last token (``finished``)."""

    kind: Literal["started", "first_token", "finished"]
    key: Hashable
    time: float
    cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (on ``first_token``)."""


class _Seq:
    __slots__ = ("admitted", "cached", "ctx", "kv", "req", "start_d", "state", "threshold")

    def __init__(self, req: ModelRequest, admitted: float) -> None:
        self.req = req
        self.admitted = admitted
        self.state = _TRANSIT
        self.kv = req.prompt_tokens + req.output_tokens
        self.ctx = req.prompt_tokens + req.output_tokens / 2
        self.cached = 0
        self.threshold = 0.0
        self.start_d = 0.0


class NodeModel:
    """One node's queue, slots, KV cache, prefix cache and batch (see the module docs).

    ``time_scale`` multiplies every duration (0: everything happens at once, in order).
    """

    def __init__(
        self,
        profile: FamilyProfile,
        max_concurrency: int,
        *,
        queue_size: float = _INF,
        time_scale: float = 1.0,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency!r}")
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {queue_size!r}")
        time_scale = check_scale(time_scale, "time_scale")
        self.profile = profile
        self.max_concurrency = max_concurrency
        self.queue_size = queue_size
        self.time_scale = time_scale
        self._overhead = profile.ttft_ms / 1000 * time_scale
        self._prefill_rate = profile.prefill_tokens_per_s / time_scale if time_scale else _INF
        self._step_base = time_scale / profile.tokens_per_s
        self._step_slope = self._step_base * profile.batch_slowdown
        self._step_ctx = profile.context_ms_per_1k_tokens / 1e6 * time_scale
        self._kv_total = profile.kv_cache_tokens
        self._seqs: dict[Hashable, _Seq] = {}
        self._transit: deque[tuple[float, _Seq]] = deque()
        self._waiting: deque[_Seq] = deque()
        self._lane: deque[_Seq] = deque()
        self._prefill_end = _INF
        self._heap: list[tuple[float, int, _Seq]] = []
        self._counter = 0
        self._decoding = 0
        self._ctx = 0.0
        self._d = 0.0
        self._d_at = 0.0
        self._step = self._step_base
        self._running = 0
        self._kv_reserved = 0
        self._cache: OrderedDict[Hashable, None] = OrderedDict()
        self._pending: list[NodeEvent] = []
        self.prompt_tokens_total: int = 0
        """Prompt tokens of every prefill started."""
        self.cached_tokens_total: int = 0
        """Of those, the tokens found in the prefix cache."""

    # -- state ----------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return self._running

    @property
    def waiting(self) -> int:
        """Requests admitted but not yet holding a slot."""
        return len(self._waiting)

    @property
    def load(self) -> int:
        """Running plus waiting."""
        return self._running + len(self._waiting)

    @property
    def kv_reserved(self) -> int:
        """KV cache tokens reserved by running requests."""
        return self._kv_reserved

    @property
    def cached_blocks(self) -> int:
        """Blocks in the prefix cache."""
        return len(self._cache)

    def has_block(self, block: Hashable) -> bool:
        """Whether a block is in the prefix cache (does not touch its recency)."""
        return block in self._cache

    def __contains__(self, key: object) -> bool:
        return key in self._seqs

    # -- the event interface --------------------------------------------------------------

    def admit(self, request: ModelRequest, now: float) -> Admission:
        """A request arrives at ``now``: queued (or on its way to a slot), or refused."""
        if request.prompt_tokens < 1 or request.output_tokens < 1:
            raise ValueError("prompt_tokens and output_tokens must be >= 1")
        if request.key in self._seqs:
            raise ValueError(f"request {request.key!r} is already on this node")
        self._catch_up(now)
        seq = _Seq(request, now)
        if seq.kv > self._kv_total:
            return "exceeds_kv_cache"
        if self.load >= self.max_concurrency + self.queue_size:
            return "queue_full"
        self._seqs[request.key] = seq
        seq.state = _WAITING
        self._waiting.append(seq)
        self._schedule(now)
        return "queued" if seq.state == _WAITING else "running"

    def cancel(self, key: Hashable, now: float) -> bool:
        """Remove a request wherever it is (the client went away); False if it is not here."""
        seq = self._seqs.get(key)
        if seq is None:
            return False
        self._catch_up(now)
        seq = self._seqs.pop(key, None)
        if seq is None:  # it finished while catching up
            return False
        state = seq.state
        if state == _WAITING:
            self._waiting.remove(seq)
        elif state == _TRANSIT:
            self._transit = deque(item for item in self._transit if item[1] is not seq)
            self._release(seq)
            self._schedule(now)
        elif state == _PREFILL:
            head = self._lane[0] is seq
            self._lane.remove(seq)
            self._release(seq)
            if head:
                self._prefill_end = _INF
                self._start_prefill(now)
            self._schedule(now)
        elif state == _DECODE:
            self._sync(now)
            self._decoding -= 1
            self._ctx -= seq.ctx
            self._restep()
            self._release(seq)
            self._schedule(now)
        seq.state = _DONE
        return True

    def next_event_time(self) -> float:
        """When the next event happens (``inf`` when the node is idle)."""
        if self._pending:
            return self._pending[0].time
        return self._next_internal()

    def advance(self, now: float) -> list[NodeEvent]:
        """Process everything up to ``now``; the events that happened, in time order."""
        self._catch_up(now)
        events, self._pending = self._pending, []
        return events

    # -- live pacing ----------------------------------------------------------------------

    def tokens_out(self, key: Hashable, now: float) -> int:
        """Tokens of a request generated by ``now`` (0 before its first token)."""
        seq = self._seqs.get(key)
        if seq is None:
            return 0
        if seq.state != _DECODE:
            return 0
        d = self._d + ((now - self._d_at) / self._step if self._step > 0 else _INF)
        return 1 + int(min(seq.req.output_tokens - 1, max(0.0, d - seq.start_d) + 1e-9))

    def token_time(self, key: Hashable, index: int) -> float | None:
        """When token ``index`` (0 = the first) of a decoding request is due at the current
        batch speed; None while the request has no first token yet or is gone."""
        seq = self._seqs.get(key)
        if seq is None or seq.state != _DECODE:
            return None
        return self._d_at + max(0.0, seq.start_d + index - self._d) * self._step

    # -- internals ------------------------------------------------------------------------

    def _next_internal(self) -> float:
        t = self._transit[0][0] if self._transit else _INF
        if self._prefill_end < t:
            t = self._prefill_end
        heap = self._heap
        while heap and heap[0][2].state != _DECODE:
            heapq.heappop(heap)
        if heap:
            due = self._d_at + max(0.0, heap[0][0] - self._d) * self._step
            if due < t:
                t = due
        return t

    def _catch_up(self, now: float) -> None:
        while True:
            t = self._next_internal()
            if t > now:
                break
            self._handle(t)
        self._sync(now)

    def _handle(self, t: float) -> None:
        # The earliest internal event at t: an overhead ends, a prefill ends, or a decode ends.
        if self._transit and self._transit[0][0] <= t:
            _, seq = self._transit.popleft()
            seq.state = _PREFILL
            self._lane.append(seq)
            self._start_prefill(t)
            return
        if self._prefill_end <= t:
            seq = self._lane.popleft()
            self._prefill_end = _INF
            self._emit(NodeEvent("first_token", seq.req.key, t, seq.cached))
            self._insert_blocks(seq)
            if seq.req.output_tokens <= 1:
                self._finish(seq, t)
            else:
                self._sync(t)
                seq.state = _DECODE
                seq.start_d = self._d
                seq.threshold = self._d + seq.req.output_tokens - 1
                self._counter += 1
                heapq.heappush(self._heap, (seq.threshold, self._counter, seq))
                self._decoding += 1
                self._ctx += seq.ctx
                self._restep()
            self._start_prefill(t)
            return
        self._sync(t)
        threshold, _, seq = heapq.heappop(self._heap)
        if threshold > self._d:
            self._d = threshold
        self._decoding -= 1
        self._ctx -= seq.ctx
        self._restep()
        self._finish(seq, t)

    def _finish(self, seq: _Seq, t: float) -> None:
        seq.state = _DONE
        self._seqs.pop(seq.req.key, None)
        self._release(seq)
        self._emit(NodeEvent("finished", seq.req.key, t))
        self._schedule(t)

    def _emit(self, event: NodeEvent) -> None:
        self._pending.append(event)

    def _release(self, seq: _Seq) -> None:
        self._running -= 1
        self._kv_reserved -= seq.kv

    def _sync(self, t: float) -> None:
        if t > self._d_at:
            if self._step > 0 and self._decoding:
                self._d += (t - self._d_at) / self._step
            self._d_at = t

    def _restep(self) -> None:
        n = self._decoding
        if n <= 0:
            self._step = self._step_base
            self._ctx = 0.0
            return
        self._step = self._step_base + self._step_slope * (n - 1) + self._step_ctx * self._ctx

    def _schedule(self, t: float) -> None:
        """Move waiting requests into free slots, in order, while the KV cache has room."""
        waiting = self._waiting
        started = False
        while waiting and self._running < self.max_concurrency:
            seq = waiting[0]
            if self._kv_reserved + seq.kv > self._kv_total:
                break
            waiting.popleft()
            self._running += 1
            self._kv_reserved += seq.kv
            self._emit(NodeEvent("started", seq.req.key, t))
            if self._overhead > 0:
                seq.state = _TRANSIT
                self._transit.append((t + self._overhead, seq))
            else:
                seq.state = _PREFILL
                self._lane.append(seq)
            started = True
        if started:
            self._evict()
            self._start_prefill(t)

    def _start_prefill(self, t: float) -> None:
        if not self._lane or self._prefill_end != _INF:
            return
        seq = self._lane[0]
        req = seq.req
        full = min(len(req.blocks), req.prompt_tokens // BLOCK_TOKENS)
        hits = 0
        cache = self._cache
        for block in req.blocks[:full]:
            if block not in cache:
                break
            cache.move_to_end(block)
            hits += 1
        cached = min(hits * BLOCK_TOKENS, req.prompt_tokens - 1)
        seq.cached = cached
        self.prompt_tokens_total += req.prompt_tokens
        self.cached_tokens_total += cached
        self._prefill_end = t + (req.prompt_tokens - cached) / self._prefill_rate

    def _insert_blocks(self, seq: _Seq) -> None:
        req = seq.req
        full = min(len(req.blocks), req.prompt_tokens // BLOCK_TOKENS)
        if not full:
            return
        cache = self._cache
        for block in req.blocks[:full]:
            if block in cache:
                cache.move_to_end(block)
            else:
                cache[block] = None
        self._evict()

    def _evict(self) -> None:
        room = (self._kv_total - self._kv_reserved) // BLOCK_TOKENS
        cache = self._cache
        while len(cache) > room:
            cache.popitem(last=False)


def hit_rate(models: Sequence[NodeModel]) -> float:
    """Prefix-cache hit rate in tokens over several nodes (0.0 when nothing was prefilled)."""
    total = sum(m.prompt_tokens_total for m in models)
    return sum(m.cached_tokens_total for m in models) / total if total else 0.0
