"""Client-side overhead of zml against bare httpx2 on the same nodes (issue "Hot path").

Everything is a ratio measured in one run on one machine, so a busy machine shifts both sides:

* client CPU per non-streamed request: ``zml.AsyncClient.infer`` vs a bare ``httpx2.AsyncClient``
  POST + ``json``, at 1 and at 64 requests in flight (budget <= 1.1x);
* client CPU per streamed request of 32 content chunks: ``infer_stream`` vs the floor, bare
  ``client.stream(...)`` + ``aiter_lines()`` + ``json.loads`` of each ``data:`` line, at 1 and
  at 64 in flight (budget <= 1.3x);
* the same for a *fresh* client's first 2,000 requests at 64 in flight ("cold"), against a
  fresh bare client's;
* for scale, each client's own Python per JSON request with no network at all (both send
  through ``httpx2.MockTransport``): the part of the JSON ratio that zml can change;
* routing decision time at 100 and 10,000 nodes, and at 10,000 nodes with every family full
  (budget: median <= 10 us and <= 100 us);
* a fresh process doing import + client + one request to a local node, zml vs bare httpx2
  (interpreter start subtracted, bytecode cached as after an install; budget <= 1.5x), and for
  scale bare httpx2 plus one pydantic response model (the floor of a pydantic-typed client),
  that floor in its steps (importing pydantic, defining the models, validating), and the
  openai SDK;
* memory per in-flight stream with 1,000 concurrent streams (budget <= 8 KB of zml's own),
  as Python allocations (tracemalloc) per open stream, for zml and for bare httpx2 holding the
  same streams: the difference is what zml itself adds per stream.

The simulated nodes run in another process (``zml sim serve``) with no artificial delays, so
only this process's CPU (``time.process_time``) is counted. Each round measures zml and bare
back to back (which goes first alternates), so that noise from other work on the machine falls
on both; a ratio is the median of the rounds' ratios, a time the median of the rounds' times.
With one request in flight a round is short, so there are three times as many. A round cut
short by a transport error (a loopback connection reset under load) is measured again, and
the report says so. Always exits 0: figures, not a gate. The last lines have a fixed format
(``overhead stream C=64: 1.20x`` ...) for the issue notes.

Run: ``uv run python benchmarks/overhead.py [--requests N] [--rounds R] [--streams S]``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx2

MODEL = "bench-model"
MESSAGES = [{"role": "user", "content": "benchmark"}]
NODES = 3
CHUNKS = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(ports: list[int], slots: int, tokens_per_s: float | None = None) -> str:
    # A node that never slows down with its batch or context and never runs out of KV cache
    # (the simulator's defaults model a real GPU: with 1,000 streams open, its first tokens
    # would come minutes late). Only the pace of tokens is set, for the memory benchmark.
    sim = ("\n[nodes.sim]\nqueue_size = 4096\nbatch_slowdown = 0\ncontext_ms_per_1k_tokens = 0\n"
           "kv_cache_tokens = 1000000000\nttft_ms = 1\n")
    if tokens_per_s:
        sim += f"tokens_per_s = {tokens_per_s}\n"
    nodes = "".join(
        f"\n[[nodes]]\nid = \"bench{i}\"\nfamily = \"H100\"\nurl = \"http://127.0.0.1:{port}\"\n"
        f"models = [\"{MODEL}\"]\nmax_concurrency = {slots}\n{sim}"
        for i, port in enumerate(ports)
    )
    return f"[accelerators.H100]\n{nodes}\n[policies.bench]\naccelerator_chain = [\"H100\"]\n"


@contextmanager
def sim_nodes(count: int, slots: int, time_scale: float,
              tokens_per_s: float | None = None) -> Iterator[Path]:
    """Simulated nodes in a child process; yields the zml.toml that points at them."""
    ports = [_free_port() for _ in range(count)]
    folder = Path(tempfile.mkdtemp(prefix="zml-bench-"))
    config = folder / "zml.toml"
    config.write_text(_config(ports, slots, tokens_per_s))
    proc = subprocess.Popen(
        [sys.executable, "-m", "zml", "sim", "serve", str(config), "--time-scale",
         str(time_scale)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        for port in ports:
            while time.monotonic() < deadline:
                try:
                    if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code \
                            == 200:
                        break
                except httpx2.HTTPError:
                    time.sleep(0.1)
            else:
                raise SystemExit("the simulated node did not start")
        yield config
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# --- request and stream CPU, async, 1 and 64 in flight -----------------------------------


class Side:
    """One client (zml or bare) and its two operations: a JSON request and a stream."""

    def __init__(self, config: Path, zml_side: bool) -> None:
        import zml

        self.zml = zml_side
        registry = zml.Client(config=config).registry
        self.urls = [n.url + "/v1/chat/completions" for n in registry.nodes]
        self.turn = 0
        self.config = config
        self.body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 16}).encode()
        self.sbody = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": CHUNKS,
                                 "ignore_eos": True, "stream": True,
                                 "stream_options": {"include_usage": True}}).encode()
        self.headers = {"content-type": "application/json"}
        self.client: Any = None

    async def __aenter__(self) -> Side:
        import zml

        if self.zml:
            self.client = zml.AsyncClient(config=self.config, probe_interval_s=None)
        else:
            # The simulated nodes (uvicorn) close a connection idle for 5 s, httpx2's default
            # keep-alive expiry: a connection left idle that long while the zml side ran its
            # round could be reused just as the node closes it (an httpx2.ReadError that ends
            # the run). Expiring it a second earlier leaves no such moment; zml's clients
            # expire theirs at 4 s as well.
            self.client = httpx2.AsyncClient(
                limits=httpx2.Limits(max_connections=None, max_keepalive_connections=256,
                                     keepalive_expiry=4.0))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()

    def _url(self) -> str:
        self.turn += 1
        return self.urls[self.turn % len(self.urls)]

    async def json(self) -> object:
        if self.zml:
            return await self.client.infer(MODEL, MESSAGES, policy="bench", max_tokens=16)
        r = await self.client.post(self._url(), content=self.body, headers=self.headers)
        r.raise_for_status()
        return r.json()

    async def stream(self) -> int:
        n = 0
        if self.zml:
            async for _ in self.client.infer_stream(MODEL, MESSAGES, policy="bench",
                                                    max_tokens=CHUNKS,
                                                    extra_body={"ignore_eos": True}):
                n += 1
            return n
        async with self.client.stream("POST", self._url(), content=self.sbody,
                                      headers=self.headers) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    if data != "[DONE]":
                        json.loads(data)
                        n += 1
        return n


async def _run(op: Callable[[], Awaitable[object]], n: int, concurrency: int) -> float:
    """CPU seconds per operation for ``n`` operations, ``concurrency`` in flight."""
    per = n // concurrency

    async def worker() -> None:
        for _ in range(per):
            await op()

    for attempt in range(1, _ROUND_TRIES + 1):
        gc.collect()
        start = time.process_time()
        tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
        try:
            await asyncio.gather(*tasks)
        except (httpx2.TransportError, OSError) as exc:
            # A loopback connection reset under load (seen once, on the bare side, in many
            # runs): the round is measured again, and the run says so at the end.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            REDONE.append(f"{type(exc).__name__} ({'zml' if _is_zml(op) else 'bare'} side)")
            if attempt == _ROUND_TRIES:
                raise
            continue
        return (time.process_time() - start) / (per * concurrency)
    raise AssertionError("unreachable")


_ROUND_TRIES = 3
REDONE: list[str] = []
"""The rounds measured again after a transport error, for the end of the report."""


def _is_zml(op: Callable[[], Awaitable[object]]) -> bool:
    side = getattr(op, "__self__", None)
    return bool(getattr(side, "zml", False))


Figures = tuple[float, float, float]
"""(zml median, bare median, median ratio): CPU seconds per operation, and the median of the
rounds' ratios. Each round measures zml and bare back to back, so its ratio holds for that
moment of the machine; the median over rounds is the figure (the noise of a shared machine
moves both sides of a round, not the ratio)."""


def _figures(zs: list[float], bs: list[float]) -> Figures:
    return (statistics.median(zs), statistics.median(bs),
            statistics.median(z / b for z, b in zip(zs, bs, strict=True)))


async def _pair(config: Path, mode: str, n: int, concurrency: int, rounds: int) -> Figures:
    """Settled figures: rounds alternate the two sides (which goes first alternates too)."""
    async with Side(config, True) as z, Side(config, False) as b:
        zop, bop = getattr(z, mode), getattr(b, mode)
        for op in (zop, bop):  # warm up connections, caches, lazy imports
            await _run(op, 2 * concurrency, concurrency)
        zs, bs = [], []
        for i in range(rounds):
            if i % 2:
                bs.append(await _run(bop, n, concurrency))
                zs.append(await _run(zop, n, concurrency))
            else:
                zs.append(await _run(zop, n, concurrency))
                bs.append(await _run(bop, n, concurrency))
    return _figures(zs, bs)


async def _cold(config: Path, mode: str, n: int, concurrency: int, rounds: int) -> Figures:
    """A fresh client's first ``n`` operations, zml and bare in each round.

    As many rounds as for the settled figures, and which side goes first alternates (as in
    :func:`_pair`): one cold round's ratio is noisy (0.99-1.33x for streams over 12 rounds of
    the same code on this 2-core machine), so the median of a few is the figure."""
    zs: list[float] = []
    bs: list[float] = []
    for i in range(rounds):
        sides = ((True, zs), (False, bs)) if i % 2 == 0 else ((False, bs), (True, zs))
        for side, out in sides:
            async with Side(config, side) as s:
                out.append(await _run(getattr(s, mode), n, concurrency))
    return _figures(zs, bs)


def bench_requests(n: int, rounds: int,
                   cold_n: int) -> tuple[dict[str, Figures], tuple[float, float]]:
    """The request and stream figures, and :func:`bench_python_cost` on the same nodes."""
    out: dict[str, Figures] = {}
    with sim_nodes(NODES, slots=256, time_scale=1e-9) as config:
        async def main() -> None:
            async with Side(config, True) as z:
                chunks = await z.stream()
                assert chunks >= CHUNKS, chunks
            for mode in ("json", "stream"):
                for c in (1, 64):
                    # One in flight: more, shorter rounds (each is cheap, and a short burst of
                    # other work on the machine then spoils one round, not the median).
                    count, reps = (n, rounds) if c == 64 else (max(50, n // 4), 3 * rounds)
                    out[f"{mode} C={c}"] = await _pair(config, mode, count, c, reps)
                out[f"{mode} C=64 cold"] = await _cold(config, mode, cold_n, 64, rounds)

        asyncio.run(main())
        python = bench_python_cost(config)
    return out, python


# --- client Python per request, without the network ---------------------------------------


def _mock_answer(request: httpx2.Request) -> httpx2.Response:
    """A whole answer of 16 tokens, shaped as an OpenAI-compatible node's."""
    body = json.loads(request.content)
    return httpx2.Response(200, headers={"content-type": "application/json"}, json={
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 1,
        "model": body["model"],
        "choices": [{"index": 0, "finish_reason": "length",
                     "message": {"role": "assistant", "content": "token " * 16}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 16, "total_tokens": 20},
    })


def bench_python_cost(config: Path, n: int = 400, rounds: int = 15) -> tuple[float, float]:
    """CPU seconds per JSON request (zml, bare httpx2) when both send through
    ``httpx2.MockTransport``: no sockets, no event-loop waits, no node. What is left is each
    client's own Python, a steadier figure than a ratio over loopback (where the kernel's share
    of a request, 600-900 us here, moves with the machine's load)."""
    import zml

    async def main() -> tuple[float, float]:
        async with httpx2.AsyncClient(transport=httpx2.MockTransport(_mock_answer)) as http, \
                zml.AsyncClient(config=config, probe_interval_s=None,
                                http_client=http) as client, \
                httpx2.AsyncClient(transport=httpx2.MockTransport(_mock_answer)) as bare:
            url = client.registry.nodes[0].url + "/v1/chat/completions"
            body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 16}).encode()
            headers = {"content-type": "application/json"}

            async def zop() -> object:
                return await client.infer(MODEL, MESSAGES, policy="bench", max_tokens=16)

            async def bop() -> object:
                r = await bare.post(url, content=body, headers=headers)
                r.raise_for_status()
                return r.json()

            for op in (zop, bop):
                await _run(op, 100, 1)
            zs: list[float] = []
            bs: list[float] = []
            for i in range(rounds):
                for op, out in ((zop, zs), (bop, bs))[:: 1 if i % 2 else -1]:
                    out.append(await _run(op, n, 1))
            return statistics.median(zs), statistics.median(bs)

    return asyncio.run(main())


# --- first request in a fresh process ----------------------------------------------------


# What bare httpx2 does, plus one response validated by a small pydantic model tree: the least
# a client whose answers are pydantic models (as zml's, and openai's, are) can do.
_PYDANTIC_FLOOR = """\
from pydantic import BaseModel, ConfigDict
class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", defer_build=True)
class Message(_Open):
    role: str
    content: str | None = None
class Choice(_Open):
    index: int
    message: Message
    finish_reason: str | None = None
class Completion(_Open):
    id: str
    model: str
    choices: list[Choice]
"""


def bench_first_request(runs: int = 21) -> dict[str, float]:
    """A fresh process: import, client, one request; zml, bare httpx2, bare httpx2 with a
    pydantic response model (the floor of a pydantic-typed client), and the openai SDK."""
    with sim_nodes(1, slots=8, time_scale=1e-9) as config:
        import zml

        base_url = zml.Client(config=config).registry.nodes[0].url
        url = base_url + "/v1/chat/completions"
        body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 4})

        def plain(validate: str) -> str:
            return (f"import httpx2\nwith httpx2.Client() as c:\n"
                    f"    r = c.post({url!r}, content={body!r}, "
                    f"headers={{'content-type': 'application/json'}})\n"
                    f"    r.raise_for_status(); {validate}\n")

        statements = {
            "base": "pass",
            "bare": plain("r.json()"),
            # The floor in its three steps: importing pydantic's BaseModel, then defining the
            # response models (validators deferred), then validating the answer.
            "pydantic_import": "from pydantic import BaseModel\n" + plain("r.json()"),
            "pydantic_classes": _PYDANTIC_FLOOR + plain("r.json()"),
            "pydantic": _PYDANTIC_FLOOR + plain("Completion.model_validate(r.json())"),
            "zml": (f"import zml\nwith zml.Client(config={str(config)!r}) as c:\n"
                    f"    c.infer({MODEL!r}, [{{'role': 'user', 'content': 'x'}}], "
                    f"max_tokens=4)\n"),
            "openai": (f"import openai\nwith openai.OpenAI(base_url={base_url + '/v1'!r}, "
                       f"api_key='unused') as c:\n"
                       f"    c.chat.completions.create(model={MODEL!r}, "
                       f"messages=[{{'role': 'user', 'content': 'x'}}], max_tokens=4)\n"),
        }

        # As installed packages run (pip and ``uv pip --compile`` write bytecode): a first,
        # discarded run of each statement leaves the modules' bytecode cached, even where the
        # environment says PYTHONDONTWRITEBYTECODE (then every run would compile from source).
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}

        def timed(stmt: str) -> float:
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", stmt], check=True, env=env)
            return time.perf_counter() - start

        # A round runs the statements back to back, in an order that rotates from round to
        # round, and gives one ratio per client: (client - interpreter) / (bare - interpreter).
        # A figure is the median of the rounds' ratios (as for the request rounds: a busy
        # moment moves one round, not the median).
        for stmt in statements.values():
            timed(stmt)
        names = list(statements)
        times: dict[str, list[float]] = {name: [] for name in statements}
        ratios: dict[str, list[float]] = {name: [] for name in names if name not in ("base", "bare")}
        for i in range(runs):
            took = {}
            k = i % len(names)
            for name in names[k:] + names[:k]:
                took[name] = timed(statements[name])
                times[name].append(took[name])
            for name, values in ratios.items():
                values.append((took[name] - took["base"]) / (took["bare"] - took["base"]))
        base = statistics.median(times["base"])
        out = {f"{name}_ms": (statistics.median(times[name]) - base) * 1e3
               for name in names if name != "base"}
        out.update({name: statistics.median(values) for name, values in ratios.items()})
    return out


# --- memory per open stream ----------------------------------------------------------------


async def _hold_streams(config: Path, count: int, bare: bool) -> dict[str, float]:
    """Hold ``count`` streams open (first chunk received); Python memory grown per stream."""
    import zml

    # Connections are opened in batches: a thousand simultaneous connects would overflow the
    # simulated node's listen backlog, which measures the kernel, not the client.
    timeouts = zml.Timeouts(total=None, connect=60.0, idle=None)
    async with zml.AsyncClient(config=config, timeout=timeouts, probe_interval_s=None) as client, \
            httpx2.AsyncClient(limits=httpx2.Limits(max_connections=None),
                               timeout=httpx2.Timeout(60.0)) as http:
        url = client.registry.nodes[0].url + "/v1/chat/completions"
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 10_000, "ignore_eos": True,
                "stream": True}

        async def open_bare() -> tuple[httpx2.Response, object]:
            response = await http.send(http.build_request("POST", url, json=body), stream=True)
            lines = response.aiter_lines().__aiter__()
            while not (await lines.__anext__()).startswith("data:"):
                pass
            return response, lines

        async def open_zml() -> object:
            stream = client.infer_stream(MODEL, MESSAGES, policy="bench", max_tokens=10_000,
                                         extra_body={"ignore_eos": True})
            await anext(stream)
            return stream

        opener = open_bare if bare else open_zml
        await asyncio.gather(*(opener() for _ in range(4)))  # warm up both paths' lazy state
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        held: list[object] = []
        for start in range(0, count, 50):
            held += await asyncio.gather(*(opener() for _ in range(min(50, count - start))))
        gc.collect()
        after = tracemalloc.take_snapshot()
        tracemalloc.stop()
        grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
        in_flight = count if bare else client.fleet.in_flight
        for item in held:
            if isinstance(item, tuple):
                await item[0].aclose()
            else:
                await item.aclose()  # type: ignore[attr-defined]
        return {"streams": float(in_flight), "bytes_per_request": grown / count}


def bench_memory(count: int) -> dict[str, float]:
    with sim_nodes(1, slots=2 * count + 64, time_scale=1.0, tokens_per_s=0.5) as config:
        bare = asyncio.run(_hold_streams(config, count, bare=True))
        ours = asyncio.run(_hold_streams(config, count, bare=False))
    return {"streams": ours["streams"], "zml": ours["bytes_per_request"],
            "bare": bare["bytes_per_request"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1024, help="requests per round at C=64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cold", type=int, default=2000, help="a fresh client's first N")
    parser.add_argument("--streams", type=int, default=1000, help="concurrent streams held")
    parser.add_argument("--only", choices=("requests", "routing", "first", "memory"))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from routing_decision import measure

    print(f"zml overhead benchmark — {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, "
          f"Python {sys.version.split()[0]}")
    lines: list[str] = []
    if args.only in (None, "requests"):
        req, (zpy, bpy) = bench_requests(args.requests, args.rounds, args.cold)
        print(f"\n{'client CPU per request':<28}{'zml us':>10}{'bare us':>10}{'ratio':>8}")
        for name, (z, b, ratio) in req.items():
            print(f"{name:<28}{z * 1e6:>10.0f}{b * 1e6:>10.0f}{ratio:>7.2f}x")
            lines.append(f"overhead {name}: {ratio:.2f}x")
        print(f"without the network (httpx2.MockTransport), a JSON request: zml {zpy * 1e6:.0f} us,"
              f" bare httpx2 {bpy * 1e6:.0f} us -> zml's own Python {(zpy - bpy) * 1e6:.0f} us")
        order = ["json C=1", "json C=64", "stream C=1", "stream C=64", "json C=64 cold",
                 "stream C=64 cold"]
        lines.sort(key=lambda line: order.index(line[len("overhead "):line.index(":")]))
    if args.only in (None, "routing"):
        print(f"\n{'routing decision':<28}{'median us':>10}{'p99 us':>10}")
        for label, n, mode, busy in (("100 nodes", 100, "balanced", 0.6),
                                     ("10000 nodes", 10_000, "balanced", 0.6),
                                     ("10000 nodes, all full", 10_000, "latency", 0.95)):
            m = measure(n, runs=2000 if n == 100 else 200, cost_priority=mode,  # type: ignore[arg-type]
                        busy=busy)
            med, p99 = float(m["median_ns"]) / 1e3, float(m["p99_ns"]) / 1e3  # type: ignore[arg-type]
            print(f"{label:<28}{med:>10.1f}{p99:>10.1f}")
            key = "worst 10000 nodes" if "full" in label else f"p50 {label}"
            lines.append(f"routing {key}: {med:.0f} us")
    if args.only in (None, "first"):
        first = bench_first_request()
        print(f"\nfirst request in a fresh process (interpreter start subtracted): "
              f"zml {first['zml_ms']:.0f} ms, bare httpx2 {first['bare_ms']:.0f} ms\n"
              f"  bare httpx2 + a pydantic response model {first['pydantic_ms']:.0f} ms "
              f"({first['pydantic']:.2f}x bare: the floor of a pydantic-typed client), "
              f"openai SDK {first['openai_ms']:.0f} ms ({first['openai']:.2f}x)\n"
              f"  the floor step by step: `from pydantic import BaseModel` "
              f"{first['pydantic_import']:.2f}x, + four response models "
              f"{first['pydantic_classes']:.2f}x, + validating the answer "
              f"{first['pydantic']:.2f}x")
        lines.append(f"first request: {first['zml']:.2f}x")
    if args.only in (None, "memory"):
        mem = bench_memory(args.streams)
        own = (mem["zml"] - mem["bare"]) / 1024
        print(f"\nmemory per in-flight stream ({mem['streams']:.0f} concurrent): zml "
              f"{mem['zml'] / 1024:.1f} KB, bare httpx2 {mem['bare'] / 1024:.1f} KB -> zml's own "
              f"{own:.1f} KB")
        lines.append(f"memory per stream: {own:.1f} KB")
    if REDONE:
        print(f"\nrounds measured again after a transport error: {', '.join(REDONE)}")
    print()
    for line in lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
