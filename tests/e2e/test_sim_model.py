"""The node performance model behind a live simulated node, on real loopback sockets.

Timing comparisons are made within one run and only as "longer" / "slower", with modelled
differences many times larger than any scheduling noise (no absolute thresholds).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import httpx2

from zml.sim import SimFleet, SimNodeSpec

MODEL = "m1"


def _words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


async def _stream(client: httpx2.AsyncClient, url: str, content: str, max_tokens: int) -> dict[str, Any]:
    """One streamed request: TTFT, the time of every content chunk, and the usage."""
    body = {
        "model": MODEL, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": content}],
    }
    sent = time.perf_counter()
    times: list[float] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for event in httpx2.EventSource(response):
            if event.data == "[DONE]":
                break
            chunk = json.loads(event.data)
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                times.append(time.perf_counter())
    return {"ttft": times[0] - sent, "times": times, "usage": usage}


def _per_token(result: dict[str, Any]) -> float:
    times = result["times"]
    return (times[-1] - times[0]) / (len(times) - 1)


def test_a_long_prompt_has_a_longer_time_to_first_token_than_a_short_one() -> None:
    spec = SimNodeSpec(id="n", family="H100", models=(MODEL,), max_concurrency=4,
                       profile_overrides={"prefill_tokens_per_s": 10_000.0})
    with SimFleet([spec], time_scale=1.0) as fleet:

        async def main() -> tuple[dict[str, Any], dict[str, Any]]:
            async with httpx2.AsyncClient(timeout=30) as client:
                short = await _stream(client, fleet.url("n"), _words(196, "s"), 4)
                long = await _stream(client, fleet.url("n"), _words(11_996, "l"), 4)
                return short, long

        short, long = asyncio.run(main())
    assert short["usage"]["prompt_tokens"] == 200
    assert long["usage"]["prompt_tokens"] == 12_000
    # modelled: 10 ms + 200 / 10k tok/s = 30 ms against 10 ms + 1.2 s
    assert long["ttft"] > short["ttft"]


def test_a_full_node_decodes_more_slowly_per_request_than_an_idle_one() -> None:
    spec = SimNodeSpec(id="n", family="H100", models=(MODEL,), max_concurrency=8,
                       tokens_per_s=100.0, profile_overrides={"batch_slowdown": 0.3})
    with SimFleet([spec], time_scale=1.0) as fleet:
        url = fleet.url("n")

        async def main() -> tuple[dict[str, Any], list[dict[str, Any]]]:
            async with httpx2.AsyncClient(timeout=30) as client:
                idle = await _stream(client, url, "hello there", 30)
                full = await asyncio.gather(*(_stream(client, url, f"request {i}", 30)
                                              for i in range(8)))
                return idle, full

        idle, full = asyncio.run(main())
        assert fleet.nodes["n"].stats.running_peak == 8
    # modelled: 10 ms per token alone, (1 + 0.3 x 7) x 10 ms = 31 ms with 8 running
    assert statistics.median(_per_token(r) for r in full) > _per_token(idle)
