"""CPU per request to drain the saturation queue, at 125 and 1,000 queued requests (issue 13).

A policy with ``queue_on_saturation = true`` sends N requests at once to a single node with 4
slots: 4 run, the rest wait in zml's client-side queue and are let through as slots free. If
each freed slot costs O(1), the CPU per request is the same at 125 and at 1,000 requests (a
ratio near 1x; the budget is at most 2x); if every freed slot wakes every waiter, it grows
with N.

The node is an in-process ``httpx2.MockTransport`` whose handler holds each request for 1 ms
(``asyncio.sleep``), so no socket or second process adds noise, and what grows with N is
zml's own work. CPU is ``time.process_time`` over the whole burst, divided by N; each size
runs ``--rounds`` times and the median is printed. Always exits 0: figures, not a gate.

Run: ``uv run python benchmarks/queue_drain.py [--rounds R]``. Prints::

    queue drain 125: N us/request
    queue drain 1000: N us/request
    queue drain ratio: N.NNx
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx2

import zml

MODEL = "bench-model"
MESSAGES = [{"role": "user", "content": "drain"}]
SLOTS = 4
CONFIG = f"""
[accelerators.H100]

[[nodes]]
id = "bench"
family = "H100"
url = "http://bench:8000"
models = ["{MODEL}"]
max_concurrency = {SLOTS}

[policies.drain]
accelerator_chain = ["H100"]
queue_on_saturation = true
max_queue_ms = 600000
"""
COMPLETION = {
    "id": "c", "object": "chat.completion", "created": 1, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                 "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}


async def _handler(request: httpx2.Request) -> httpx2.Response:
    await asyncio.sleep(0.001)
    return httpx2.Response(200, json=COMPLETION)


async def _drain(config: Path, n: int) -> float:
    """CPU seconds to send ``n`` requests at once through the 4-slot node."""
    http = httpx2.AsyncClient(transport=httpx2.MockTransport(_handler))
    async with zml.AsyncClient(config=config, http_client=http, timeout=None,
                               probe_interval_s=None) as client:
        await client.infer(MODEL, MESSAGES, policy="drain")  # warm up
        start = time.process_time()
        results = await asyncio.gather(
            *(client.infer(MODEL, MESSAGES, policy="drain") for _ in range(n)),
            return_exceptions=True)
        cpu = time.process_time() - start
    await http.aclose()
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise SystemExit(f"{len(failed)} of {n} requests failed, e.g. {failed[0]!r}")
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "zml.toml"
        config.write_text(CONFIG)
        per_request: dict[int, float] = {}
        for n in (125, 1000):
            samples = [asyncio.run(_drain(config, n)) / n for _ in range(args.rounds)]
            per_request[n] = statistics.median(samples)
            print(f"queue drain {n}: {per_request[n] * 1e6:.0f} us/request", flush=True)
    print(f"queue drain ratio: {per_request[1000] / per_request[125]:.2f}x")


if __name__ == "__main__":
    main()
