"""``--live`` against simulated nodes on loopback agrees with virtual-time replay.

The same 300-request slice of the Azure trace is replayed twice under one policy: in virtual
time (the production core against node models) and live (zml.AsyncClient over real loopback
HTTP to `zml.sim` nodes running the same model at ``time_scale``). The two must agree within 5
points on each family's share and within 25% on TTFT p50 — the check that replay models the
live path. The run is bounded: 300 requests, the trace compressed by ``RATE`` and the nodes'
time by ``TIME_SCALE`` (about 90 s in all; a smaller time scale packs the same CPU work
into less time and the loaded machine, not the model, then decides the TTFT), each request
with the client's timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

import zml
from zml.config import load_registry
from zml.policy import validate_policy_tables
from zml.sim.live import replay_live
from zml.sim.report import summarize
from zml.sim.traces import read_trace
from zml.sim.virtual import replay_policy

TRACE = Path(__file__).parents[1] / "fixtures" / "traces" / "azure-conv-300.csv"
MODEL = "m"
RATE = 2.0
TIME_SCALE = 1.0
FLEET = """
[accelerators.L4]
cost_per_hour = 0.8
[accelerators.A100]
cost_per_hour = 1.8

[[nodes]]
id = "l4-1"
family = "L4"
url = "{l4}"
models = ["m"]
max_concurrency = 4
max_queue = 0

[[nodes]]
id = "a100-1"
family = "A100"
url = "{a100}"
models = ["m"]
max_concurrency = 48
max_queue = 0

[policies.cheap-first]
accelerator_chain = ["L4", "A100"]
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def sim_serve(config: Path) -> Iterator[None]:
    """``zml sim serve CONFIG`` in its own process (its CPU is not this client's)."""
    proc = subprocess.Popen([sys.executable, "-m", "zml", "sim", "serve",
                             str(config), "--time-scale", str(TIME_SCALE)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        urls = [n.url for n in load_registry(config).nodes]
        for _ in range(300):  # up to 30 s for the process to listen
            try:
                for url in urls:
                    httpx2.get(f"{url}/health", timeout=1.0).raise_for_status()
                break
            except httpx2.HTTPError:
                assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                time.sleep(0.1)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.slow_e2e
def test_live_and_virtual_replay_of_the_same_slice_agree(tmp_path: Path) -> None:
    arrivals = list(read_trace(TRACE))
    assert len(arrivals) == 300
    config = tmp_path / "zml.toml"
    config.write_text(FLEET.format(l4=f"http://127.0.0.1:{_free_port()}",
                                   a100=f"http://127.0.0.1:{_free_port()}"))
    registry = load_registry(config)
    with sim_serve(config):

        async def live() -> dict:
            async with zml.AsyncClient(config=config, timeout=60.0) as client:
                run = await replay_live(arrivals, client, registry, name="cheap-first",
                                        kind="policy", policy="cheap-first",
                                        default_model=MODEL, rate_scale=RATE,
                                        time_scale=TIME_SCALE, concurrency=128)
            return summarize(run)

        live_row = asyncio.run(live())
    policies = validate_policy_tables(registry)
    virtual_row = summarize(replay_policy(arrivals, registry, policies, policies["cheap-first"],
                                          name="cheap-first", default_model=MODEL,
                                          rate_scale=RATE))
    for row in (live_row, virtual_row):
        assert row["completed"] + sum(row["errors"].values()) == 300, row
    for family in ("L4", "A100"):
        live_share = live_row["share_by_family"].get(family, 0.0)
        virtual_share = virtual_row["share_by_family"].get(family, 0.0)
        assert abs(live_share - virtual_share) <= 0.05, (family, live_row, virtual_row)
    live_p50, virtual_p50 = live_row["ttft_ms"]["p50"], virtual_row["ttft_ms"]["p50"]
    assert live_p50 == pytest.approx(virtual_p50, rel=0.25), (live_p50, virtual_p50)
