"""What a Redis slot lease adds to a request, on loopback.

Per dispatch a client with zml-redis makes ONE round trip on the request path (the acquire
script) and one call that only queues work (``release``; the worker thread deletes the lease
and announces the new count, off the request path). Printed, in microseconds (min / median /
p90 / p99):

* ``acquire (sync)``: ``RedisLedger.acquire``, the sync clients' path;
* ``aacquire (async)``: ``RedisLedger.aacquire`` awaited in an event loop (the round trip
  runs on the hub's small thread pool);
* ``release (caller)``: what ``release`` costs the request (a queue append);
* ``release (worker)``: the worker's round trip that deletes the lease (for information);
* ``request, no ledger`` / ``request, ledger``: a whole non-streamed ``zml.Client.infer``
  on a node that answers at once (``httpx2.MockTransport``), without and with the plugin; the
  difference of the medians is the latency the plugin adds per request, as a caller sees it.

Run: ``uv run python plugins/redis/benchmarks/reservation_latency.py [--runs N]``. Uses
``$ZML_REDIS_URL`` if set, else starts ``redis-server`` on a free loopback port (and stops it).
Numbers are for reading, never a gate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2

MODEL = "m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def redis_url() -> Iterator[str]:
    """``$ZML_REDIS_URL``, or a redis-server of our own for the duration."""
    url = os.environ.get("ZML_REDIS_URL")
    if url:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("set ZML_REDIS_URL or install redis-server")
    port = _free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    import redis

    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                sys.exit("redis-server did not start")
            time.sleep(0.02)
    try:
        yield url
    finally:
        proc.kill()
        proc.wait()


def row(name: str, samples_s: list[float]) -> str:
    us = sorted(s * 1e6 for s in samples_s)
    q = statistics.quantiles(us, n=100)
    return (f"  {name:<22} min {us[0]:8.1f}  median {statistics.median(us):8.1f}  "
            f"p90 {q[89]:8.1f}  p99 {q[98]:8.1f}")


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def answer(request: httpx2.Request) -> httpx2.Response:
    """A node that answers at once (so the client's own costs are what is measured)."""
    return httpx2.Response(200, json={
        "id": "c", "object": "chat.completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    })


def requests(plain: Any, leased: Any, runs: int) -> tuple[list[float], list[float]]:
    """Time ``runs`` requests of each client, in alternating blocks (so that both see the
    same machine), after a warm-up."""
    messages = [{"role": "user", "content": "hi"}]
    bare: list[float] = []
    with_ledger: list[float] = []
    for client in (plain, leased):
        for _ in range(200):
            client.infer(model=MODEL, messages=messages)
    block = max(1, runs // 10)
    for _ in range(10):
        bare += timed(lambda: plain.infer(model=MODEL, messages=messages), block)
        with_ledger += timed(lambda: leased.infer(model=MODEL, messages=messages), block)
    return bare, with_ledger


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3000)
    args = parser.parse_args()
    runs = args.runs

    with redis_url() as url, tempfile.TemporaryDirectory() as d:
        config = Path(d) / "zml.toml"
        config.write_text('[accelerators.H100]\n[[nodes]]\nid = "bench-1"\nfamily = "H100"\n'
                          f'url = "http://bench-1:8000"\nmodels = ["{MODEL}"]\n'
                          "max_concurrency = 64\n")
        from zml_redis import RedisLedger
        from zml_redis.plugin import reset

        import zml

        os.environ.pop("ZML_REDIS_URL", None)
        plain = zml.Client(config=config,
                           http_client=httpx2.Client(transport=httpx2.MockTransport(answer)))
        os.environ["ZML_REDIS_URL"] = url
        os.environ["ZML_REDIS_PREFIX"] = f"bench-{uuid.uuid4().hex[:8]}"
        client = zml.Client(config=config,
                            http_client=httpx2.Client(transport=httpx2.MockTransport(answer)))
        assert plain.fleet.ledger is None
        bare, leased = requests(plain, client, runs)
        plain.close()
        with client:
            ledger = client.fleet.ledger
            assert isinstance(ledger, RedisLedger)
            node = client.fleet.node("bench-1")
            acquire, release = [], []
            for i in range(runs):
                lease = f"s{i}"
                t0 = time.perf_counter()
                ledger.acquire(node, lease)
                t1 = time.perf_counter()
                ledger.release(node, lease)
                t2 = time.perf_counter()
                acquire.append(t1 - t0)
                release.append(t2 - t1)

            async def async_runs() -> list[float]:
                out = []
                for i in range(runs):
                    lease = f"a{i}"
                    t0 = time.perf_counter()
                    await ledger.aacquire(node, lease)
                    out.append(time.perf_counter() - t0)
                    ledger.release(node, lease)
                return out

            aacquire = asyncio.run(async_runs())

            import redis as redis_lib

            raw = redis_lib.Redis.from_url(url, decode_responses=True)
            key = ledger.keys[node]
            worker = []
            for i in range(runs // 3):
                raw.zadd(key, {f"w{i}": 1e15})
                t0 = time.perf_counter()
                raw.zrem(key, f"w{i}")
                worker.append(time.perf_counter() - t0)
            raw.close()
        reset()

    print(f"zml-redis reservation latency on loopback, {runs} runs (microseconds)")
    print(row("acquire (sync)", acquire))
    print(row("aacquire (async)", aacquire))
    print(row("release (caller)", release))
    print(row("release (worker)", worker))
    print(row("request, no ledger", bare))
    print(row("request, ledger", leased))
    added = statistics.median(leased) - statistics.median(bare)
    print(f"  added per request (median difference): {added * 1e6:.1f} us")


if __name__ == "__main__":
    main()
