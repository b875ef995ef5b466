"""The node's bounded FIFO queue and slots, and abort on disconnect, driven through raw ASGI so
each test decides exactly when a client goes away."""

from __future__ import annotations

import asyncio
import json

SLOW = {"time_scale": 1.0, "ttft_ms": 20, "tokens_per_s": 200}


def _body(tk, stream=False, **extra):
    return {"model": "m1", "messages": tk.user("hi"), "stream": stream, "max_tokens": 20, **extra}


async def test_queue_full_answers_503_at_once(make_node, tk):
    node = make_node(max_concurrency=1, queue_size=1, **SLOW)
    first = tk.RawConnection(node, _body(tk))
    second = tk.RawConnection(node, _body(tk))
    await tk.wait_for(lambda: node.stats.running == 1 and node.stats.waiting == 1)
    third = tk.RawConnection(node, _body(tk))
    await asyncio.wait_for(third.task, 1)
    assert third.status == 503
    error = json.loads(third.body)["error"]
    assert error["code"] == "queue_full" and error["message"]
    await asyncio.wait_for(asyncio.gather(first.task, second.task), 5)
    assert first.status == second.status == 200
    stats = node.stats
    assert stats.completed_total == 2 and stats.rejected_total == 1 and stats.running_peak == 1


async def test_queue_size_zero_rejects_when_busy(make_node, tk):
    node = make_node(max_concurrency=1, queue_size=0, **SLOW)
    first = tk.RawConnection(node, _body(tk))
    await tk.wait_for(lambda: node.stats.running == 1)
    second = tk.RawConnection(node, _body(tk))
    await second.task
    assert second.status == 503
    await first.task
    assert first.status == 200


async def test_slots_are_fifo(make_node, tk):
    node = make_node(max_concurrency=1, **SLOW)
    order = []
    connections = []
    for i in range(4):
        conn = tk.RawConnection(node, _body(tk, max_tokens=2))
        conn.task.add_done_callback(lambda _t, i=i: order.append(i))
        connections.append(conn)
        await asyncio.sleep(0)
    await asyncio.wait_for(asyncio.gather(*(c.task for c in connections)), 5)
    assert order == [0, 1, 2, 3]
    assert node.stats.running_peak == 1


async def test_disconnect_while_queued_leaves_the_queue(make_node, tk):
    node = make_node(max_concurrency=1, **SLOW)
    running = tk.RawConnection(node, _body(tk, max_tokens=40))
    queued = tk.RawConnection(node, _body(tk))
    behind = tk.RawConnection(node, _body(tk))
    await tk.wait_for(lambda: node.stats.waiting == 2)
    queued.disconnect()
    await asyncio.wait_for(queued.task, 1)
    assert queued.status is None
    assert node.stats.waiting == 1 and node.stats.aborted_total == 1
    await asyncio.wait_for(asyncio.gather(running.task, behind.task), 5)
    assert running.status == behind.status == 200
    stats = node.stats
    assert (stats.running, stats.waiting, stats.completed_total, stats.aborted_total) == (0, 0, 2, 1)


async def test_disconnect_mid_stream_frees_the_slot(make_node, tk):
    node = make_node(max_concurrency=1, **SLOW)
    streaming = tk.RawConnection(node, _body(tk, stream=True, max_tokens=400))
    waiting = tk.RawConnection(node, _body(tk, max_tokens=2))
    await tk.wait_for(lambda: streaming.body.count(b"data:") >= 3)
    assert node.stats.waiting == 1
    streaming.disconnect()
    await asyncio.wait_for(streaming.task, 1)
    assert not streaming.complete and b"[DONE]" not in streaming.body
    assert node.stats.aborted_total == 1
    await asyncio.wait_for(waiting.task, 2)
    assert waiting.status == 200
    stats = node.stats
    assert (stats.running, stats.waiting, stats.completed_total) == (0, 0, 1)


async def test_disconnect_of_a_non_streamed_request_while_generating(make_node, tk):
    node = make_node(max_concurrency=2, time_scale=1.0, ttft_ms=10_000)
    conn = tk.RawConnection(node, _body(tk))
    await tk.wait_for(lambda: node.stats.running == 1)
    conn.disconnect()
    await asyncio.wait_for(conn.task, 1)
    assert conn.sent == []
    assert (node.stats.running, node.stats.aborted_total) == (0, 1)


async def test_disconnect_before_the_body_counts_as_aborted(make_node, tk):
    node = make_node()

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        raise AssertionError("nothing should be sent")

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    await node(scope, receive, send)
    assert node.stats.aborted_total == 1 and node.stats.requests_total == 1


async def test_running_peak_and_reset(make_node, tk):
    node = make_node(max_concurrency=3, **SLOW)
    conns = [tk.RawConnection(node, _body(tk)) for _ in range(5)]
    await tk.wait_for(lambda: node.stats.running == 3)
    assert node.stats.waiting == 2
    await asyncio.wait_for(asyncio.gather(*(c.task for c in conns)), 5)
    assert node.stats.running_peak == 3
    node.reset_peak()
    assert node.stats.running_peak == 0


async def test_server_cancellation_is_not_swallowed(make_node, tk):
    node = make_node(time_scale=1.0, ttft_ms=10_000)
    conn = tk.RawConnection(node, _body(tk))
    await tk.wait_for(lambda: node.stats.running == 1)
    conn.task.cancel()
    await asyncio.gather(conn.task, return_exceptions=True)
    assert conn.task.cancelled()
    assert node.stats.running == 0 and node.stats.aborted_total == 0


async def test_lifespan_scope(make_node):
    node = make_node()
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message["type"])

    await node({"type": "lifespan"}, receive, send)
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
