"""Under uvloop (what ``zml serve`` runs on), the watchdog still cuts a response off.

uvloop's transport sockets refuse ``shutdown()`` (a TypeError, not an OSError); the watchdog
then shuts the connection down through a duplicate of its descriptor. Without that, the drain
after ``[DONE]`` lasted the 60 s idle timeout and a request deadline was not kept while a node
trickled its headers. A node on loopback misbehaves on purpose; each case has a generous guard
(a hang fails it), no timing assertion.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import zml

uvloop = pytest.importorskip("uvloop")  # installed with zmlai[gateway], as in the dev set

_CHUNK = json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                     "choices": [{"index": 0, "delta": {"content": "hi"},
                                  "finish_reason": "stop"}]})


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    body = await reader.readexactly(length)
    try:
        if b"trickle" in body:  # headers one byte at a time, never finished
            for byte in b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-pad: " + \
                    b"a" * 10_000:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(0.2)
        else:  # a whole answer, [DONE], then the response is never ended
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            event = f"data: {_CHUNK}\n\ndata: [DONE]\n\n".encode()
            writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
            await writer.drain()
            await asyncio.sleep(3600)
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[Path]:
    """A node that misbehaves as the request's ``mode`` says; the zml.toml naming it."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict[str, object] = {}

    async def serve() -> None:
        server = await asyncio.start_server(_handle, "127.0.0.1", 0)
        box["port"] = server.sockets[0].getsockname()[1]
        box["server"] = server
        started.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(serve()),
                                              loop.run_forever()), daemon=True)
    thread.start()
    assert started.wait(10)
    path = tmp_path / "zml.toml"
    path.write_text('[accelerators.H100]\n[[nodes]]\nid = "bad"\nfamily = "H100"\n'
                    f'url = "http://127.0.0.1:{box["port"]}"\nmodels = ["m"]\n'
                    'max_concurrency = 4\n')
    yield path

    async def stop() -> None:
        server = box["server"]
        assert isinstance(server, asyncio.Server)
        server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


MSGS = [{"role": "user", "content": "hi"}]


def test_a_stream_that_stays_open_after_done_ends_at_once_under_uvloop(hostile: Path) -> None:
    async def main() -> str:
        async with zml.AsyncClient(config=hostile, probe_interval_s=None) as client:
            async with client.infer_stream("m", MSGS, extra_body={"mode": "after_done"}) as s:
                text = "".join([c.choices[0].delta.content or "" async for c in s])
            assert client.fleet.in_flight == 0
            return text

    async def guarded() -> str:
        return await asyncio.wait_for(main(), 30)  # the idle timeout (60 s) would trip this

    assert uvloop.run(guarded()) == "hi"


@pytest.mark.parametrize("stream", [False, True])
def test_the_deadline_holds_while_a_node_trickles_its_headers_under_uvloop(
        hostile: Path, stream: bool) -> None:
    async def main() -> None:
        async with zml.AsyncClient(config=hostile, probe_interval_s=None, timeout=1.0) as client:
            with pytest.raises(zml.ZMLTimeoutError, match=r"deadline of 1\.0s"):
                if stream:
                    async with client.infer_stream("m", MSGS, extra_body={"mode": "trickle"}) \
                            as s:
                        async for _ in s:
                            pass
                else:
                    await client.infer("m", MSGS, extra_body={"mode": "trickle"})
            assert client.fleet.in_flight == 0

    async def guarded() -> None:
        await asyncio.wait_for(main(), 30)  # 10,000 header bytes at 0.2 s: about 33 min

    uvloop.run(guarded())
