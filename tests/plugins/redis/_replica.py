"""One replica of an application, for the multi-process tests (run as a script).

``python _replica.py CONFIG POLICY COUNT MODE``: builds its own ``zml.AsyncClient`` from CONFIG
(with zml-redis when ``ZML_REDIS_URL`` is set), prints ``{"ready": ...}``, waits for a line on
stdin, then sends COUNT concurrent requests under POLICY and prints one JSON line with each
request's outcome (node id, or ``error:<final_error>``). MODE ``hold`` sends them and waits
forever (the test kills the process).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import zml

MODEL = "meta-llama/llama-3-8b-instruct"


async def one(client: zml.AsyncClient, policy: str) -> str:
    try:
        r = await client.infer(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                               policy=policy, max_tokens=4)
    except zml.RoutingError as exc:
        return f"error:{exc.routing_context['final_error']}"
    return r.routing.node_id


async def main(config: str, policy: str, count: int, mode: str) -> None:
    async with zml.AsyncClient(config=config) as client:
        ledger = client.fleet.ledger
        print(json.dumps({"ready": True, "ledger": type(ledger).__name__ if ledger else None}),
              flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        started = time.monotonic()
        results = await asyncio.gather(*(one(client, policy) for _ in range(count)))
        if mode == "hold":  # pragma: no cover - killed before
            await asyncio.sleep(3600)
        print(json.dumps({"results": results, "elapsed_s": time.monotonic() - started}),
              flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
