"""``zml sim replay --live``: the same trace, sent in real time to the config's nodes.

Virtual-time replay answers "what would routing do" from a model; ``--live`` checks it against
the real path, and doubles as a trace-driven load generator for a user's own fleet. Each
arrival is sent at its (rate-scaled) time with :class:`zml.AsyncClient` as a streamed chat
completion under the row's policy, to whatever the config's URLs are: simulated nodes
(``zml sim serve --config``) or real ones. The results fill the same
:class:`~zml.sim.replay.ReplayRun` rows, so the table and the JSON are the same.

How a trace row becomes a request (so a simulated node sees the row's sizes):

* the prompt is one user message of ``prompt_tokens - PROMPT_OVERHEAD_TOKENS`` words (the
  simulated node counts the role and the message framing as tokens); a row with prefix
  blocks gets, for its i-th block, 512 copies of a word made of that block's id, so two rows
  sharing leading blocks share a leading prompt and the node's prefix cache sees it (the live
  block rule, :func:`zml.sim.model.prompt_blocks`); the rest of the prompt is unique to the row;
* ``max_tokens = output_tokens`` and ``extra_body={"ignore_eos": True}`` (vLLM's field), so
  the answer has the row's length;
* ``time_scale`` (default 1) divides every wait: use the ``--time-scale`` the simulated nodes
  were started with, and TTFT, end-to-end times and time-based costs are reported in the
  trace's own seconds.

Bounds: at most ``concurrency`` requests are in flight (a row that arrives while the bound is
reached waits, and its TTFT counts the wait, as a user's would), each request has the client's
timeout, and the count is the trace's (``--limit``). Errors are keyed like virtual time's
(``final_error``, or the error type). The prefix-cache hit rate is read from the nodes' usage
(``prompt_tokens_details.cached_tokens``, as vLLM reports it) and is ``None`` when they do
not report it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from zml.config import Registry
from zml.errors import ZMLError
from zml.sim.model import BLOCK_TOKENS
from zml.sim.replay import Outcome, ReplayFleet, ReplayRun
from zml.sim.traces import Arrival
from zml.sim.virtual import final_error_of
from zml.validation import check_scale

__all__ = ["PROMPT_OVERHEAD_TOKENS", "prompt_for", "replay_live"]

PROMPT_OVERHEAD_TOKENS = 4
"""Prompt tokens a simulated node counts for one user message beyond its words."""


def prompt_for(a: Arrival) -> str:
    """The prompt text sent for trace row ``a`` (module docs)."""
    words = max(1, a.prompt_tokens - PROMPT_OVERHEAD_TOKENS)
    parts: list[str] = []
    left = words
    for block in a.blocks:
        if left <= 0:
            break
        n = min(BLOCK_TOKENS, left)
        parts.append(f"b{block} " * n)
        left -= n
    if left > 0:
        parts.append(f"r{a.index} " * left)
    return "".join(parts).rstrip()


async def replay_live(
    arrivals: Sequence[Arrival],
    client: Any,
    registry: Registry,
    *,
    name: str,
    kind: str,
    policy: str | None,
    default_model: str,
    rate_scale: float = 1.0,
    time_scale: float = 1.0,
    concurrency: int = 64,
    slo_ms: float | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayRun:
    """Send ``arrivals`` through ``client`` (a :class:`zml.AsyncClient`) in real time.

    ``policy``: the policy each request names (a row's own ``policy`` wins). Returns the row
    (module docs); ``wall_s`` is in ``run.extra``.
    """
    check_scale(rate_scale, "rate_scale", zero_ok=False)
    check_scale(time_scale, "time_scale", zero_ok=False)
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency!r}")
    gate = asyncio.Semaphore(concurrency)
    inv = 1.0 / rate_scale
    outcomes = [Outcome(a, a.arrival_s * inv) for a in arrivals]
    cached = [0, 0, 0]  # cached tokens, prompt tokens, rows whose usage reported it
    done = 0
    begin = time.perf_counter()

    async def one(out: Outcome) -> None:
        nonlocal done
        a = out.arrival
        delay = begin + out.start_s * time_scale - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        t0 = time.perf_counter()
        try:
            async with gate:
                await _send(client, out, a, policy, default_model, t0, time_scale, cached)
        except ZMLError as exc:
            out.error = final_error_of(exc)
        done += 1
        if progress is not None and done % 50 == 0:
            progress(done)

    await asyncio.gather(*(one(out) for out in outcomes))
    if progress is not None:
        progress(done)
    last = max((o.start_s + (o.e2e_s or 0.0) for o in outcomes), default=0.0)
    run = ReplayRun(name, kind, outcomes, ReplayFleet(registry), last, slo_ms)
    run.extra["wall_s"] = time.perf_counter() - begin
    run.extra["prefix_cache_hit_rate"] = cached[0] / cached[1] if cached[2] and cached[1] else None
    return run


async def _send(client: Any, out: Outcome, a: Arrival, policy: str | None, default_model: str,
                t0: float, scale: float, cached: list[int]) -> None:
    first: float | None = None
    usage: Any = None
    stream = client.infer_stream(
        a.model or default_model, [{"role": "user", "content": prompt_for(a)}],
        policy=a.policy or policy, max_tokens=a.output_tokens,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async with stream:
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
        routing = stream.routing
    end = time.perf_counter()
    out.e2e_s = (end - t0) / scale
    out.ttft_s = ((first if first is not None else end) - t0) / scale
    if routing is not None:
        out.node = routing.node_id
        out.family = routing.accelerator
        if routing.cost is not None:
            # time-based costs ran on the scaled clock: report them in the trace's seconds
            amount = routing.cost.amount
            out.cost_usd = amount / scale if routing.cost.basis == "node_seconds" else amount
    details = _get(usage, "prompt_tokens_details")
    hit = _get(details, "cached_tokens")
    if isinstance(hit, int):
        out.cached_tokens = hit
        cached[0] += hit
        cached[1] += a.prompt_tokens
        cached[2] += 1


def _get(obj: Any, key: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)
