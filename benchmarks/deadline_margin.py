"""Deadline margin: how long after its deadline a call against a node that keeps talking ends.

    uv run --locked python benchmarks/deadline_margin.py [--repeats N] [--gap S] [--timeout S]

A node on loopback (a raw asyncio server in a thread) answers a stream with one token and then
an SSE keep-alive comment every ``--gap`` seconds, and a non-streamed call with a JSON body
dripped one byte every ``--gap`` seconds, never finishing in time. Each client kind (sync,
async) and mode (stream, json) is called ``--repeats`` times with ``timeout=--timeout``; the
margin is the wall time from the call's start past its deadline until ``ZMLTimeoutError``
reached the caller. Prints one line per kind and mode::

    deadline margin sync stream: p50 2 ms, max 3 ms

The budget (issue "Hardening") is at most 100 ms. Without the sync client's watchdog a sync
call ended up to one ``--gap`` late.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import zml

MODEL = "m"
MSGS = [{"role": "user", "content": "hi"}]


class TalkingNode:
    """Streams: one token then keep-alives; JSON: a body dripped a byte at a time."""

    def __init__(self, gap: float) -> None:
        self.gap = gap
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            server = self.loop.run_until_complete(
                asyncio.start_server(self._serve, "127.0.0.1", 0))
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            self.loop.run_forever()

        threading.Thread(target=run, daemon=True).start()
        ready.wait(10)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            body = json.loads(await reader.readexactly(length))
            if body.get("stream"):
                chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1,
                         "model": MODEL, "choices": [{"index": 0, "delta": {"content": "Hi"},
                                                      "finish_reason": None}]}
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"connection: close\r\n\r\n"
                             + b"data: " + json.dumps(chunk).encode() + b"\n\n")
                while True:
                    await writer.drain()
                    await asyncio.sleep(self.gap)
                    writer.write(b": keep-alive\n\n")
            data = json.dumps({"id": "c", "object": "chat.completion", "created": 1,
                               "model": MODEL, "choices": [{
                                   "index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": "x" * 4096}}]})
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                         b"connection: close\r\ncontent-length: "
                         + str(len(data)).encode() + b"\r\n\r\n")
            for byte in data.encode():
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(self.gap)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def config(port: int, folder: Path) -> Path:
    path = folder / "zml.toml"
    path.write_text(f'[accelerators.X]\n[[nodes]]\nid = "talker"\nfamily = "X"\n'
                    f'url = "http://127.0.0.1:{port}"\nmodels = ["{MODEL}"]\n'
                    'max_concurrency = 4\n')
    return path


def sync_margin(cfg: Path, stream: bool, timeout: float) -> float:
    with zml.Client(config=cfg, probe_interval_s=None) as client:
        start = time.monotonic()
        try:
            if stream:
                for _ in client.infer_stream(MODEL, MSGS, timeout=timeout):
                    pass
            else:
                client.infer(MODEL, MSGS, timeout=timeout)
        except zml.ZMLTimeoutError:
            return time.monotonic() - start - timeout
    raise AssertionError("the call did not time out")


async def async_margin(cfg: Path, stream: bool, timeout: float) -> float:
    async with zml.AsyncClient(config=cfg, probe_interval_s=None) as client:
        start = time.monotonic()
        try:
            if stream:
                async for _ in client.infer_stream(MODEL, MSGS, timeout=timeout):
                    pass
            else:
                await client.infer(MODEL, MSGS, timeout=timeout)
        except zml.ZMLTimeoutError:
            return time.monotonic() - start - timeout
    raise AssertionError("the call did not time out")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gap", type=float, default=0.3, help="seconds between the node's sends")
    ap.add_argument("--timeout", type=float, default=1.0, help="the calls' deadline (s)")
    args = ap.parse_args(argv)
    node = TalkingNode(args.gap)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(node.port, Path(tmp))
        for kind in ("sync", "async"):
            for mode in ("stream", "json"):
                stream = mode == "stream"
                margins = []
                for _ in range(args.repeats):
                    if kind == "sync":
                        margins.append(sync_margin(cfg, stream, args.timeout))
                    else:
                        margins.append(asyncio.run(async_margin(cfg, stream, args.timeout)))
                print(f"deadline margin {kind} {mode}: p50 "
                      f"{statistics.median(margins) * 1e3:.0f} ms, max {max(margins) * 1e3:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
