"""The attempt flow, driven by hand: outcomes are sent into it, with no transport at all.

Each test builds a real fleet and dispatcher (the common operations are carried out by
:class:`zml.dispatch.Effects`), then answers the flow's Wait, Lease and Send operations itself,
on a clock it advances. Every failover rule of ``zml.dispatch.flow``'s docstring has a test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import zml
from zml.config import AcceleratorConfig, NodeConfig, Registry
from zml.dispatch import (
    QUEUE_LIMIT,
    RETRY_AFTER_MAX_S,
    Call,
    Dispatcher,
    Lease,
    Send,
    Step,
    Timeouts,
    Wait,
)
from zml.policy import policy_from_mapping

MODEL = "m"


def registry(*nodes: tuple[str, str, int]) -> Registry:
    families = {fam: AcceleratorConfig(cost_per_hour=1.0) for _, fam, _ in nodes}
    return Registry(
        families,
        tuple(
            NodeConfig(id=i, family=f, url=f"http://127.0.0.1:{9000 + n}", models=(MODEL,),
                       max_concurrency=c)
            for n, (i, f, c) in enumerate(nodes)
        ),
    )


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    """A dispatcher on a fake clock, and a driver that answers Sends from a script."""

    reg: Registry
    clock: Clock = field(default_factory=Clock)
    max_attempts: int = 3

    def __post_init__(self) -> None:
        self.d = Dispatcher(self.reg, {}, api_key=None, timeouts=Timeouts(total=10.0),
                            max_attempts=self.max_attempts, clock=self.clock)
        self.sent: list[str] = []
        self.waits: list[Wait] = []

    def policy(self, **fields: Any) -> zml.Policy:
        fields.setdefault("name", "p")
        return policy_from_mapping(fields, self.reg)

    def call(self, policy: zml.Policy | None = None, timeout: float | None = 10.0, *,
             stream: bool = False, content: str = "hi") -> Call:
        return self.d.start(model=MODEL, messages=[{"role": "user", "content": content}],
                            policy=policy, accelerator=None, params={}, stream=stream,
                            metadata=None, timeouts=Timeouts(total=timeout))

    def run(self, call: Call, answer: Callable[[Step], object],
            lease: Callable[[Step], bool] | None = None) -> tuple[Step, object]:
        """Drive ``call``'s flow: Wait advances the clock, Send asks ``answer``."""
        flow = call.flow()
        try:
            op, value = call.advance(flow, None)
            while op is not None:
                if isinstance(op, Wait):
                    self.waits.append(op)
                    step_to = op.until if op.ticket is None else min(op.until, self.clock.now + 1)
                    self.clock.now = max(self.clock.now, step_to)
                    result: object = None
                elif isinstance(op, Lease):
                    result = True if lease is None else lease(op.step)
                else:
                    assert isinstance(op, Send)
                    self.sent.append(op.step.node.id)
                    self.clock.now += 0.01
                    result = answer(op.step)
                op, value = call.advance(flow, result)
            return value  # type: ignore[no-any-return]
        except BaseException as exc:
            call.ended(exc)
            raise


def script(*outcomes: object) -> Callable[[Step], object]:
    it: Iterator[object] = iter(outcomes)
    return lambda step: next(it)


def unavailable(node: str = "") -> zml.NodeUnavailableError:
    return zml.NodeUnavailableError("503", status_code=503, node_id=node or None)


def test_a_retryable_failure_marks_the_node_and_fails_over() -> None:
    h = Harness(registry(("a", "H100", 1), ("b", "MI300X", 1)))
    call = h.call(h.policy(accelerator_chain=["H100", "MI300X"]))
    step, answer = h.run(call, script(unavailable(), {"ok": True}))
    assert h.sent == ["a", "b"] and step.node.id == "b" and answer == {"ok": True}
    assert [a.node_id for a in step.routing.attempts] == ["a"]
    assert h.d.fleet.node("a").health < 1.0 and h.d.fleet.node("a").in_flight == 0
    assert h.d.fleet.node("b").in_flight == 1  # held until the call succeeds
    call.succeeded(step, None, zml.dispatch.ResponseSummary(None, None, "stop"))
    assert h.d.fleet.node("b").in_flight == 0 and call.record.outcome == "completed"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_client_errors_are_raised_at_once_and_do_not_mark_the_node(status: int) -> None:
    h = Harness(registry(("a", "H100", 1), ("b", "H100", 1)))
    err = zml.errors.status_error(status, "no", node_id=None)
    with pytest.raises(type(err)):
        h.run(h.call(h.policy(accelerator_chain=["H100"])), script(err))
    assert len(h.sent) == 1
    assert all(n.health == 1.0 and n.in_flight == 0 for n in h.d.fleet)


def test_a_failure_that_is_not_the_nodes_fault_is_not_retried_nor_marked() -> None:
    h = Harness(registry(("a", "H100", 1), ("b", "H100", 1)))

    class ClientSide(zml.NodeConnectionError):
        node_fault = False

    with pytest.raises(ClientSide):
        h.run(h.call(), script(ClientSide("bad header value")))
    assert len(h.sent) == 1 and all(n.health == 1.0 for n in h.d.fleet)


def test_attempts_run_out_into_attempts_exhausted_chained_from_the_last_error() -> None:
    h = Harness(registry(("a", "H100", 1), ("b", "H100", 1), ("c", "H100", 1), ("d", "H100", 1)))
    last = unavailable()
    with pytest.raises(zml.RoutingError) as info:
        h.run(h.call(), script(unavailable(), unavailable(), last))
    ctx = info.value.routing_context
    assert ctx["final_error"] == "attempts_exhausted" and len(ctx["attempts"]) == 3
    assert info.value.__cause__ is last and len(h.sent) == 3
    assert all(n.in_flight == 0 for n in h.d.fleet)


def test_retry_after_on_the_only_node_waits_then_tries_it_again() -> None:
    h = Harness(registry(("a", "H100", 1)))
    limited = zml.RateLimitError("429", status_code=429, retry_after=2.0)
    start = h.clock.now
    step, _ = h.run(h.call(), script(limited, {"ok": 1}))
    assert h.sent == ["a", "a"] and h.clock.now >= start + 2.0
    assert any(w.until == pytest.approx(start + 0.01 + 2.0) for w in h.waits)
    assert h.d.fleet.node("a").health == 1.0  # rate limiting is load, not ill health
    assert step.routing.attempts[0].error == "rate_limited"


def test_retry_after_beyond_the_deadline_is_not_waited_for() -> None:
    h = Harness(registry(("a", "H100", 1)))
    limited = zml.RateLimitError("429", status_code=429, retry_after=60.0)
    with pytest.raises(zml.RoutingError) as info:
        h.run(h.call(timeout=5.0), script(limited))
    assert info.value.routing_context["final_error"] == "attempts_exhausted"
    assert h.waits == []


def test_retry_after_is_capped_even_without_a_deadline() -> None:
    h = Harness(registry(("a", "H100", 1)))
    limited = zml.RateLimitError("429", status_code=429, retry_after=999999.0)
    call = h.d.start(model=MODEL, messages=[{"role": "user", "content": "x"}], policy=None,
                     accelerator=None, params={}, stream=False, metadata=None,
                     timeouts=Timeouts(total=None))
    h.run(call, script(limited, {"ok": 1}))
    assert h.waits[0].until <= call.request.started_at + RETRY_AFTER_MAX_S + 1


def test_the_deadline_ends_the_flow_with_a_timeout() -> None:
    h = Harness(registry(("a", "H100", 1), ("b", "H100", 1)))

    def slow(step: Step) -> object:
        h.clock.now += 6.0
        return unavailable()

    with pytest.raises(zml.ZMLTimeoutError):
        h.run(h.call(timeout=5.0), slow)
    assert all(n.in_flight == 0 for n in h.d.fleet)


def test_a_stalled_non_streamed_attempt_leaves_time_to_fail_over() -> None:
    h = Harness(registry(("a", "H100", 1), ("b", "H100", 1)))
    seen: list[float | None] = []

    def answer(step: Step) -> object:
        seen.append(step.timeout["read"])
        return unavailable() if len(seen) == 1 else {"ok": 1}

    h.run(h.call(timeout=9.0), answer)
    assert seen[0] is not None and seen[0] <= 9.0 / 3 + 1e-6


def test_a_node_s_usual_service_time_is_never_cut_short_by_the_share() -> None:
    """With 9 s left and 3 attempts the share is 3 s; a node that usually takes 4 s gets 8 s
    (twice that), and one that takes 6 s all the time left: a tight budget must not turn
    answers as slow as usual into failures (and marks) on every node of the chain."""
    h = Harness(registry(("a", "H100", 1), ("b", "H100", 1)))
    seen: list[float | None] = []

    def answer(step: Step) -> object:
        seen.append(step.timeout["read"])
        return {"ok": 1}

    for usual in (4.0, 6.0):
        for node in h.d.fleet:
            node.service_ms = usual * 1000
        h.run(h.call(timeout=9.0), answer)
    assert seen == [pytest.approx(8.0), pytest.approx(9.0, abs=1e-6)]


def test_saturation_queue_waits_for_capacity_then_routes() -> None:
    h = Harness(registry(("a", "H100", 1)))
    policy = h.policy(accelerator_chain=["H100"], queue_on_saturation=True)
    holder = h.call(policy)
    held, _ = h.run(holder, script({"ok": 1}))
    queued = h.call(policy)
    flow = queued.flow()
    op, _ = queued.advance(flow, None)
    assert isinstance(op, Wait) and op.for_capacity
    assert h.d.effects.queues.depth("p") == 1
    holder.succeeded(held, None, zml.dispatch.ResponseSummary(None, None, None))
    op, _ = queued.advance(flow, None)
    assert isinstance(op, Send) and op.step.node.id == "a"
    assert h.d.effects.queues.depth("p") == 0
    assert op.step.routing.queued_ms >= 0


def test_the_queue_times_out_and_refuses_past_its_limit() -> None:
    h = Harness(registry(("a", "H100", 1)))
    policy = h.policy(accelerator_chain=["H100"], queue_on_saturation=True, max_queue_ms=500)
    h.run(h.call(policy), script({"ok": 1}))  # holds the only slot
    with pytest.raises(zml.RoutingError) as info:
        h.run(h.call(policy), script())
    assert info.value.routing_context["final_error"] == "queue_timeout"
    assert h.d.effects.queues.depth("p") == 0
    flows = []
    for _ in range(QUEUE_LIMIT):
        c = h.call(policy)
        f = c.flow()
        c.advance(f, None)
        flows.append((c, f))
    with pytest.raises(zml.RoutingError) as full:
        h.run(h.call(policy), script())
    assert full.value.routing_context["final_error"] == "queue_full"
    for c, _ in flows:
        c.ended(None)
    assert h.d.effects.queues.depth("p") == 0


def test_requests_queued_first_go_first() -> None:
    h = Harness(registry(("a", "H100", 1)))
    policy = h.policy(accelerator_chain=["H100"], queue_on_saturation=True)
    holder = h.call(policy)
    held, _ = h.run(holder, script({"ok": 1}))
    first, second = h.call(policy), h.call(policy)
    f1, f2 = first.flow(), second.flow()
    assert isinstance(first.advance(f1, None)[0], Wait)
    assert isinstance(second.advance(f2, None)[0], Wait)
    holder.succeeded(held, None, zml.dispatch.ResponseSummary(None, None, None))
    # the second is still behind the first, although a slot is free
    op2, _ = second.advance(f2, None)
    assert isinstance(op2, Wait)
    op1, _ = first.advance(f1, None)
    assert isinstance(op1, Send)


def test_cancellation_releases_the_slot_and_notifies_once() -> None:
    h = Harness(registry(("a", "H100", 1)))
    call = h.call()
    flow = call.flow()
    op, _ = call.advance(flow, None)
    assert isinstance(op, Send) and h.d.fleet.node("a").in_flight == 1
    call.ended(None)  # the driver's caller went away
    call.ended(None)
    assert h.d.fleet.node("a").in_flight == 0 and call.record.outcome == "cancelled"


def test_a_refused_lease_releases_and_routes_again() -> None:
    h = Harness(registry(("a", "H100", 1), ("b", "H100", 1)))

    class Ledger:
        def acquire(self, node: object, lease_id: str) -> bool:
            return True

        async def aacquire(self, node: object, lease_id: str) -> bool:
            return True

        def release(self, node: object, lease_id: str) -> None:
            pass

    h.d.fleet.ledger = Ledger()
    refused: list[str] = []

    def lease(step: Step) -> bool:
        if not refused:
            refused.append(step.node.id)
            return False
        return True

    step, _ = h.run(h.call(), script({"ok": 1}), lease=lease)
    assert refused and step.node.id != refused[0]
    assert h.d.fleet.node(refused[0]).in_flight == 0
    assert h.d.fleet.node(refused[0]).load >= 1  # treated as full until the next report


def test_after_the_first_token_a_failure_is_not_retried() -> None:
    h = Harness(registry(("a", "H100", 1), ("b", "H100", 1)))
    call = h.call()
    step, _ = h.run(call, script({"stream": "open"}))
    call.first_token(step)
    err = call.broke(step, zml.IncompleteStreamError("reset", node_id=None))
    call.ended(err)
    assert h.sent == [step.node.id] and err.node_id == step.node.id
    assert step.node.in_flight == 0 and step.node.health < 1.0
    assert call.record.outcome == "failed"


def test_joining_the_queue_notifies_zml_request_queued_once() -> None:
    from zml.plugins.manager import PluginManager

    seen: list[tuple[str, int]] = []

    class Plugin:
        @zml.hookimpl
        def zml_request_queued(self, policy: str, depth: int) -> None:
            seen.append((policy, depth))

    pm = PluginManager()
    pm.register(Plugin(), name="queued")
    h = Harness(registry(("a", "H100", 1)))
    h.d = Dispatcher(h.reg, {}, api_key=None, timeouts=Timeouts(total=10.0), clock=h.clock,
                     plugins=pm)
    policy = h.policy(accelerator_chain=["H100"], queue_on_saturation=True)
    h.run(h.call(policy), script({"ok": 1}))  # holds the only slot
    waiting = h.call(policy)
    flow = waiting.flow()
    assert isinstance(waiting.advance(flow, None)[0], Wait)
    assert isinstance(waiting.advance(flow, None)[0], Wait)  # still waiting: no second event
    assert seen == [("p", 1)]
    waiting.ended(None)


# --- what a call teaches the fleet ---------------------------------------------------------------


DONE = zml.dispatch.ResponseSummary(None, None, "stop")


def answered(h: Harness, call: Call, first_token_after: float, total: float) -> Step:
    """Run ``call`` to an answer whose first token (as the client sees it) comes after
    ``first_token_after`` seconds and whose end after ``total``."""
    step, _ = h.run(call, script({"ok": 1}))
    h.clock.now = step.sent_at + first_token_after
    call.first_token(step)
    h.clock.now = step.sent_at + total
    call.succeeded(step, None, DONE)
    return step


def test_a_whole_answer_teaches_the_service_time_but_not_the_ttft() -> None:
    h = Harness(registry(("a", "H100", 4)))
    policy = h.policy(accelerator_chain=["H100"], latency_target_ms=500)
    node = h.d.fleet.node("a")
    # The client sees a non-streamed answer's "first token" only once the whole body is in.
    answered(h, h.call(policy), first_token_after=1.3, total=1.3)
    assert node.service_ms == pytest.approx(1300.0)
    assert node.ttft_ms is None and node.observed_ttft_ms is None
    # so the node still meets the policy's 500 ms target, and a stream's first token is learned
    step = answered(h, h.call(policy, stream=True), first_token_after=0.05, total=1.0)
    assert step.node is node and node.observed_ttft_ms == pytest.approx(50.0)
    assert node.ttft_ms is not None and node.ttft_ms <= 50.0


# --- the caller's own deadline ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_timeout_at_the_callers_deadline_is_not_the_nodes_failure(stream: bool) -> None:
    h = Harness(registry(("a", "H100", 1)))

    def at_the_deadline(step: Step) -> object:
        h.clock.now = call.request.started_at + 0.3  # the attempt had all the time left
        return zml.NodeTimeoutError("read timed out", node_id=None)

    call = h.call(timeout=0.3, stream=stream)
    with pytest.raises(zml.ZMLTimeoutError) as info:
        h.run(call, at_the_deadline)
    message = str(info.value)
    assert "deadline of 0.3s expired" in message and "'a'" in message
    assert "failed attempt" not in message and "raise the timeout" in message
    assert isinstance(info.value.__cause__, zml.NodeTimeoutError)
    node = h.d.fleet.node("a")
    assert node.health == 1.0 and node.consecutive_failures == 0 and node.in_flight == 0
    assert call.record.attempts == [] and h.sent == ["a"]


def test_a_node_timeout_before_the_deadline_still_marks_the_node_and_fails_over() -> None:
    h = Harness(registry(("a", "H100", 1), ("b", "H100", 1)))
    outcomes = iter([zml.NodeTimeoutError("first token timed out", node_id=None), {"ok": 1}])
    step, _ = h.run(h.call(timeout=10.0), lambda step: next(outcomes))
    failed = next(n for n in h.d.fleet if n.id != step.node.id)
    assert h.sent == [failed.id, step.node.id] and failed.health < 1.0
    assert [a.error for a in step.routing.attempts] == ["timeout"]


# --- the saturation queue: only requests that capacity could serve wait ----------------------------

BIG = "word " * 4000  # 5,000 tokens: ~180 ms of prefill on an idle H100 (prior 10 ms + 27,712/s)


def test_a_request_no_freed_slot_can_serve_fails_at_once_though_its_policy_queues() -> None:
    h = Harness(registry(("a", "H100", 4), ("b", "H100", 4)))
    policy = h.policy(accelerator_chain=["H100"], latency_target_ms=100,
                      queue_on_saturation=True, max_queue_ms=3000)
    big = h.call(policy, content=BIG)
    with pytest.raises(zml.RoutingError) as info:
        h.run(big, script())
    ctx = info.value.routing_context
    assert ctx["final_error"] == "no_viable_node"
    assert ctx["evaluated"][0]["rejected_reason"] == "latency_target_exceeded"
    assert h.waits == [] and h.d.effects.queues.depth("p") == 0
    # and a small request of the same policy routes at once, with no wait
    step, _ = h.run(h.call(policy), script({"ok": 1}))
    assert step.routing.queued_ms == 0.0 and h.waits == []


def test_a_waiting_request_does_not_hold_up_one_that_cannot_wait() -> None:
    h = Harness(registry(("a", "H100", 1)))
    policy = h.policy(accelerator_chain=["H100"], latency_target_ms=100,
                      queue_on_saturation=True)
    h.run(h.call(policy), script({"ok": 1}))  # holds the only slot
    waiting = h.call(policy)
    flow = waiting.flow()
    assert isinstance(waiting.advance(flow, None)[0], Wait)  # full: it waits for the slot
    with pytest.raises(zml.RoutingError) as info:  # not behind it: it fails at once
        h.run(h.call(policy, content=BIG), script())
    assert info.value.routing_context["final_error"] == "no_viable_node"
    assert h.d.effects.queues.queued("p") == [waiting.record.ticket]
    waiting.ended(None)


def test_queueing_does_not_wait_for_circuit_open_or_unhealthy_nodes() -> None:
    h = Harness(registry(("a", "H100", 1), ("b", "H100", 1)))
    policy = h.policy(accelerator_chain=["H100"], queue_on_saturation=True)
    a, b = h.d.fleet.node("a"), h.d.fleet.node("b")
    for _ in range(zml.fleet.CIRCUIT_FAILURES):
        h.d.fleet.record_failure(a, h.clock.now)
    for _ in range(3):
        h.d.fleet.record_failure(b, h.clock.now)  # health 0.343: below the threshold of 0.5
    with pytest.raises(zml.RoutingError) as info:
        h.run(h.call(policy), script())
    assert info.value.routing_context["final_error"] == "no_viable_node"
    assert h.waits == [] and h.d.effects.queues.depth("p") == 0


def test_a_request_joining_the_queue_as_the_head_leaves_routes_at_once() -> None:
    """Behind the head when it routed, but the head left before it joined the queue: once in
    line it is the head, with a slot free, and must not wait (threads race this way)."""
    h = Harness(registry(("a", "H100", 2)))
    policy = h.policy(accelerator_chain=["H100"], queue_on_saturation=True)
    holders = [h.call(policy) for _ in range(2)]
    held = [h.run(c, script({"ok": 1}))[0] for c in holders]
    head = h.call(policy)
    head_flow = head.flow()
    assert isinstance(head.advance(head_flow, None)[0], Wait)
    queues = h.d.effects.queues
    join = queues.join
    late = h.call(policy)
    head_sent: list[object] = []

    def join_late(ticket: zml.dispatch.Ticket) -> int:
        if ticket is late.record.ticket:  # between its Behind and its Enqueue:
            for c, step in zip(holders, held, strict=True):
                c.succeeded(step, None, DONE)  # two slots free
            head_sent.append(head.advance(head_flow, None)[0])  # the head takes one, leaves
        return join(ticket)

    queues.join = join_late  # type: ignore[method-assign]
    op, _ = late.advance(late.flow(), None)
    assert isinstance(head_sent[0], Send)
    assert isinstance(op, Send), "the late joiner waits at the head of the queue with a free slot"
    assert queues.depth("p") == 0


def test_the_deadline_ending_a_queued_wait_says_the_request_was_queued() -> None:
    h = Harness(registry(("a", "H100", 1)))
    policy = h.policy(accelerator_chain=["H100"], queue_on_saturation=True)
    h.run(h.call(policy), script({"ok": 1}))  # holds the only slot
    with pytest.raises(zml.ZMLTimeoutError) as info:
        h.run(h.call(policy, timeout=1.0), script())
    message = str(info.value)
    assert "deadline of 1.0s expired after" in message and "saturation queue" in message
    assert "H100 all_nodes_over_capacity" in message and "failed attempt" not in message
    assert h.d.effects.queues.depth("p") == 0


def test_the_queue_timeout_says_what_it_waited_for() -> None:
    h = Harness(registry(("a", "H100", 1)))
    policy = h.policy(accelerator_chain=["H100"], queue_on_saturation=True, max_queue_ms=500)
    h.run(h.call(policy), script({"ok": 1}))  # holds the only slot
    head = h.call(policy)
    flow = head.flow()
    assert isinstance(head.advance(flow, None)[0], Wait)
    with pytest.raises(zml.RoutingError) as behind:  # behind the head the whole time
        h.run(h.call(policy), script())
    with pytest.raises(zml.RoutingError) as first:
        h.run(head, script())
    assert behind.value.routing_context["final_error"] == "queue_timeout"
    assert "queued earlier" in behind.value.routing_context["recommendation"]
    recommendation = first.value.routing_context["recommendation"]
    assert "max_queue_ms=500" in recommendation and "H100 all_nodes_over_capacity" in recommendation
