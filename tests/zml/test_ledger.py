"""The cross-process slot ledger seam (zml.ledger), with an in-memory ledger standing in."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx2
import pytest

import zml
from zml.fleet import NodeState

CONFIG = """
[accelerators.H100]
[accelerators.MI300X]

[[nodes]]
id = "h100-a"
family = "H100"
url = "http://h100-a:8000"
models = ["m"]
max_concurrency = 2

[[nodes]]
id = "mi-a"
family = "MI300X"
url = "http://mi-a:8000"
models = ["m"]
max_concurrency = 2

[policies.prod]
accelerator_chain = ["H100", "MI300X"]
"""
MSGS = [{"role": "user", "content": "hi"}]


class MemoryLedger:
    """Grants leases while fewer than capacity are held, like a shared store would."""

    def __init__(self, held_elsewhere: dict[str, int]) -> None:
        self.held: Counter[str] = Counter(held_elsewhere)
        self.granted: list[str] = []
        self.released: list[str] = []

    def acquire(self, node: NodeState, lease_id: str) -> bool:
        if self.held[node.id] >= node.max_concurrency + node.max_queue:
            return False
        self.held[node.id] += 1
        self.granted.append(lease_id)
        return True

    async def aacquire(self, node: NodeState, lease_id: str) -> bool:
        return self.acquire(node, lease_id)

    def release(self, node: NodeState, lease_id: str) -> None:
        self.held[node.id] -= 1
        self.released.append(lease_id)


def handler(request: httpx2.Request) -> httpx2.Response:
    body = json.loads(request.content)
    return httpx2.Response(200, json={
        "id": "x", "model": body["model"], "choices": [
            {"index": 0, "message": {"role": "assistant", "content": request.url.host},
             "finish_reason": "stop"}]})


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "zml.toml"
    path.write_text(CONFIG)
    return path


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_node_full_elsewhere_is_skipped_and_nothing_leaks(config: Path, kind: str) -> None:
    ledger = MemoryLedger({"h100-a": 2})  # other processes hold both H100 slots

    def run() -> list[Any]:
        transport = httpx2.MockTransport(handler)
        if kind == "sync":
            with zml.Client(config=config, http_client=httpx2.Client(transport=transport)) as c:
                c.fleet.ledger = ledger
                out = [c.infer("m", MSGS, policy="prod") for _ in range(3)]
                assert c.fleet.in_flight == 0
                return out

        async def main() -> list[Any]:
            async with zml.AsyncClient(config=config, probe_interval_s=None,
                                       http_client=httpx2.AsyncClient(transport=transport)) as c:
                c.fleet.ledger = ledger
                out = [await c.infer("m", MSGS, policy="prod") for _ in range(3)]
                assert c.fleet.in_flight == 0
                return out

        return asyncio.run(main())

    results = run()
    assert [r.routing.node_id for r in results] == ["mi-a", "mi-a", "mi-a"]
    assert results[0].routing.evaluated[0]["rejected_reason"] == "all_nodes_over_capacity"
    assert sorted(ledger.granted) == sorted(ledger.released)
    assert len(ledger.granted) == 3
    assert ledger.held["mi-a"] == 0


def test_streams_release_their_lease_when_closed(config: Path) -> None:
    ledger = MemoryLedger({})
    sse = "".join(
        f"data: {json.dumps(c)}\n\n" for c in [
            {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {"content": "a"}}]},
            {"id": "c", "model": "m", "choices": [{"index": 0, "delta": {},
                                                   "finish_reason": "stop"}]},
        ]) + "data: [DONE]\n\n"
    transport = httpx2.MockTransport(
        lambda r: httpx2.Response(200, text=sse, headers={"content-type": "text/event-stream"}))
    with zml.Client(config=config, http_client=httpx2.Client(transport=transport)) as c:
        c.fleet.ledger = ledger
        for _chunk in c.infer_stream("m", MSGS, policy="prod"):
            break
        with c.infer_stream("m", MSGS, policy="prod") as stream:
            assert "".join(ch.choices[0].delta.content or "" for ch in stream) == "a"
    assert len(ledger.granted) == 2 and sorted(ledger.granted) == sorted(ledger.released)


class Routed:
    """Records the node of every zml_request_routed."""

    def __init__(self) -> None:
        self.nodes: list[str] = []

    @zml.hookimpl
    def zml_request_routed(self, routing: Any) -> None:
        self.nodes.append(routing.node_id)


def test_a_node_whose_lease_is_refused_is_never_reported_routed(config: Path) -> None:
    """The hook is "called once per attempt, before the request is sent": it fired for the
    node whose lease was refused too, which a plugin counting load per node never saw end."""
    ledger = MemoryLedger({"h100-a": 2})
    routed = Routed()
    transport = httpx2.MockTransport(handler)
    with zml.Client(config=config, http_client=httpx2.Client(transport=transport)) as c:
        c.fleet.ledger = ledger
        c.plugins.register(routed, name="routed")
        assert c.infer("m", MSGS, policy="prod").routing.node_id == "mi-a"
    assert routed.nodes == ["mi-a"]
