"""Under uvloop (what ``zml serve`` runs on), the watchdog still cuts a response off.

uvloop's transport sockets refuse ``shutdown()`` (a TypeError, not an OSError); the watchdog
then shuts the connection down through a duplicate of its descriptor. Without that, the drain
after ``[DONE]`` lasted the 60 s idle timeout and a request deadline was not kept while a node
trickled its headers. The hostile node misbehaves on purpose; each case has a generous guard
(a hang fails it), no timing assertion.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import zml
from tests.e2e.hostile import MODEL, HostileNode, write_config

uvloop = pytest.importorskip("uvloop")  # installed with zmlai[gateway], as in the dev set

MSGS = [{"role": "user", "content": "hi"}]


def test_a_stream_that_stays_open_after_done_ends_at_once_under_uvloop(
        hostile: HostileNode, tmp_path: Path) -> None:
    config = write_config(tmp_path / "zml.toml", hostile, {"held": "done-then-hold"})

    async def main() -> str:
        async with zml.AsyncClient(config=config, probe_interval_s=None) as client:
            async with client.infer_stream(MODEL, MSGS) as stream:
                text = "".join([c.choices[0].delta.content or "" async for c in stream])
            assert client.fleet.in_flight == 0
            return text

    async def guarded() -> str:
        return await asyncio.wait_for(main(), 30)  # the idle timeout (60 s) would trip this

    assert uvloop.run(guarded()) == "hi"


@pytest.mark.parametrize("stream", [False, True])
def test_the_deadline_holds_while_a_node_trickles_its_headers_under_uvloop(
        hostile: HostileNode, tmp_path: Path, stream: bool) -> None:
    config = write_config(tmp_path / "zml.toml", hostile, {"slow": "drip-head"})

    async def main() -> None:
        async with zml.AsyncClient(config=config, probe_interval_s=None, timeout=1.0) as client:
            with pytest.raises(zml.ZMLTimeoutError, match=r"deadline of 1\.0s"):
                if stream:
                    async with client.infer_stream(MODEL, MSGS) as s:
                        async for _ in s:
                            pass
                else:
                    await client.infer(MODEL, MSGS)
            assert client.fleet.in_flight == 0

    async def guarded() -> None:
        await asyncio.wait_for(main(), 30)  # 10,000 header bytes at 0.2 s: about 33 min

    uvloop.run(guarded())
