"""Two ``zml serve`` replicas share node capacity through zml-redis and a real redis-server.

Each replica is its own process with its own AsyncClient; with ``ZML_REDIS_URL`` set, the
zml-redis plugin leases node slots in Redis, so that together they never put more requests on
a node than its slots. The same burst without Redis shows the oversubscription the plugin
prevents (each replica believes it has the whole fleet to itself), so the test can fail.

Without the ``redis-server`` binary the test FAILS (see tests/plugins/redis/conftest.py).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx2
import pytest

from tests.conftest import MODEL, LoadPeaks, SimSetup
from tests.plugins.redis.conftest import RedisServer, _binary

from .test_cli import free_port, stop, wait_ready

ROOT = Path(__file__).parents[2]
SLOTS = 4
NODES = [{"id": f"h100-{i}", "family": "H100", "max_concurrency": SLOTS,
          "sim": {"ttft_ms": 150, "tokens_per_s": 1000, "queue_size": 64}} for i in (1, 2)]
POLICY = {"burst": {"accelerator_chain": ["H100"], "queue_on_saturation": True,
                    "max_queue_ms": 60_000}}
PER_REPLICA = 24


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(_binary()).start()
    yield server
    server.stop()


def replica_env(**extra: str) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    out.update(extra)
    return out


async def _send(urls: list[str]) -> list[str]:
    async with httpx2.AsyncClient(timeout=60, limits=httpx2.Limits(max_connections=None)) as h:

        async def one(url: str) -> str:
            r = await h.post(f"{url}/v1/chat/completions",
                             json={"model": MODEL, "messages": [{"role": "user",
                                                                 "content": "hi"}],
                                   "max_tokens": 8})
            return r.headers["x-zml-node-id"] if r.status_code == 200 else \
                f"error:{r.status_code}:{r.text[:200]}"

        return await asyncio.gather(*(one(u) for u in urls for _ in range(PER_REPLICA)))


def burst(setup: SimSetup, environ: dict[str, str]) -> tuple[dict[str, int], dict[str, int],
                                                             list[str], str]:
    ports = [free_port(), free_port()]
    procs = [subprocess.Popen(
        [sys.executable, "-m", "zml", "serve", "--config", str(setup.path), "--port", str(p)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ,
        cwd=str(ROOT)) for p in ports]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    err = ""
    try:
        for proc, url in zip(procs, urls, strict=True):
            wait_ready(proc, url)
        with LoadPeaks(dict(setup.fleet.nodes)) as peaks:
            results = asyncio.run(_send(urls))
    finally:
        err = "".join(stop(p) for p in procs)
    running = {i: n.stats.running_peak for i, n in setup.fleet.nodes.items()}
    return peaks.peaks, running, results, err


def test_two_replicas_never_oversubscribe_a_node_with_redis(
        sim_fleet: Callable[..., SimSetup], redis_server: RedisServer,
        capsys: pytest.CaptureFixture[str]) -> None:
    setup = sim_fleet(NODES, POLICY)
    setup.path.write_text(setup.path.read_text() + '\n[gateway]\ndefault_policy = "burst"\n')
    prefix = f"gw{uuid.uuid4().hex[:8]}"
    shared, shared_running, shared_results, err = burst(
        setup, replica_env(ZML_REDIS_URL=redis_server.url, ZML_REDIS_PREFIX=prefix))
    alone, alone_running, alone_results, _ = burst(setup, replica_env())
    with capsys.disabled():
        print(f"\n  zml-redis: node load peak {shared}, running_peak {shared_running}"
              f"\n  no Redis:  node load peak {alone}, running_peak {alone_running}")
    assert len(shared_results) == 2 * PER_REPLICA
    assert sorted(set(shared_results)) == ["h100-1", "h100-2"], shared_results  # no errors
    assert "unreachable" not in err  # no replica fell back to local state
    assert all(peak <= SLOTS for peak in shared.values()), shared
    assert all(peak <= SLOTS for peak in shared_running.values()), shared_running
    assert sorted(set(alone_results)) == ["h100-1", "h100-2"], alone_results
    assert max(alone.values()) > SLOTS, alone  # what the shared leases prevent
    assert not redis_server.client().keys(f"{prefix}:lease:*")  # every lease given back
