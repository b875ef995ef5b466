"""Client-side overhead of zml against a bare httpx2 call to the same node (DESIGN.md budget).

Everything is a ratio measured in one run on one machine, so a busy machine shifts both sides:

* client CPU per non-streamed request: ``client.infer`` vs a bare ``httpx2`` POST + ``json``
  (budget <= 1.3x);
* client CPU per streamed request of 32 content chunks: ``client.infer_stream`` vs bare httpx2 +
  ``httpx2.EventSource`` + ``json`` per event (budget <= 1.5x);
* routing decision time at 100 and 10,000 nodes (budget: median <= 20 us and <= 1 ms);
* ``import zml`` vs ``import httpx2`` (budget <= 1.3x), in fresh interpreters;
* memory per in-flight request with 1,000 concurrent streams (budget <= 16 KB), as Python
  allocations (tracemalloc) per open stream, for zml and for bare httpx2 holding the same
  streams: the difference is what zml itself adds per request.

The simulated node runs in another process (``zml sim serve``) with no artificial delays, so
only this process's CPU (``time.process_time``) is counted. Rounds alternate zml and bare so
that noise from other work on the machine falls on both. Always exits 0: figures, not a gate.

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2

MODEL = "bench-model"
MESSAGES = [{"role": "user", "content": "benchmark"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _config(port: int, slots: int, tokens_per_s: float | None = None) -> str:
    sim = f"\n[nodes.sim]\ntokens_per_s = {tokens_per_s}\nqueue_size = 4096\n" if tokens_per_s \
        else "\n[nodes.sim]\nqueue_size = 4096\n"
    return (
        "[accelerators.H100]\n\n[[nodes]]\nid = \"bench\"\nfamily = \"H100\"\n"
        f"url = \"http://127.0.0.1:{port}\"\nmodels = [\"{MODEL}\"]\nmax_concurrency = {slots}\n"
        f"{sim}\n[policies.bench]\naccelerator_chain = [\"H100\"]\n"
    )


@contextmanager
def sim_node(slots: int, time_scale: float, tokens_per_s: float | None = None) -> Iterator[Path]:
    """A simulated node in a child process; yields the zml.toml that points at it."""
    port = _free_port()
    folder = Path(tempfile.mkdtemp(prefix="zml-bench-"))
    config = folder / "zml.toml"
    config.write_text(_config(port, slots, tokens_per_s))
    proc = subprocess.Popen(
        [sys.executable, "-m", "zml", "sim", "serve", str(config), "--time-scale",
         str(time_scale)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx2.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx2.HTTPError:
                time.sleep(0.1)
        else:
            raise SystemExit("the simulated node did not start")
        yield config
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _cpu_per_call(fn: Callable[[], object], n: int) -> float:
    gc.collect()
    start = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - start) / n


def _alternate(zml_fn: Callable[[], object], bare_fn: Callable[[], object], n: int,
               rounds: int) -> tuple[float, float]:
    for fn in (zml_fn, bare_fn):  # warm up connections, caches, lazy imports
        for _ in range(20):
            fn()
    zs, bs = [], []
    for _ in range(rounds):
        zs.append(_cpu_per_call(zml_fn, n))
        bs.append(_cpu_per_call(bare_fn, n))
    return statistics.median(zs), statistics.median(bs)


def bench_requests(n: int, rounds: int) -> dict[str, float]:
    import zml

    with sim_node(slots=64, time_scale=0.0) as config:
        url = zml.Client(config=config).registry.nodes[0].url + "/v1/chat/completions"
        body = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 16}).encode()
        sbody = json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 32,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}).encode()
        headers = {"content-type": "application/json"}
        with zml.Client(config=config) as client, httpx2.Client() as http:

            def zml_call() -> object:
                return client.infer(MODEL, MESSAGES, policy="bench", max_tokens=16)

            def bare_call() -> object:
                r = http.post(url, content=body, headers=headers)
                r.raise_for_status()
                return r.json()

            def zml_stream() -> object:
                n = 0
                for _ in client.infer_stream(MODEL, MESSAGES, policy="bench", max_tokens=32,
                                             extra_body={"ignore_eos": True}):
                    n += 1
                return n

            def bare_stream() -> object:
                n = 0
                with http.stream("POST", url, content=sbody, headers=headers) as r:
                    for event in httpx2.EventSource(r):
                        if event.data == "[DONE]":
                            break
                        json.loads(event.data)
                        n += 1
                return n

            chunks = zml_stream()
            z, b = _alternate(zml_call, bare_call, n, rounds)
            zs, bs = _alternate(zml_stream, bare_stream, max(10, n // 4), rounds)
            assert client.fleet.in_flight == 0
    return {"zml_us": z * 1e6, "bare_us": b * 1e6, "ratio": z / b,
            "zml_stream_us": zs * 1e6, "bare_stream_us": bs * 1e6, "stream_ratio": zs / bs,
            "chunks": float(chunks)}


def bench_import(runs: int = 7) -> dict[str, float]:
    def cost(stmt: str) -> float:
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", stmt], check=True)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    base = cost("pass")
    httpx = cost("import httpx2") - base
    zml_ = cost("import zml") - base
    first_use = cost("import zml; zml.Client") - base
    return {"httpx2_ms": httpx * 1e3, "zml_ms": zml_ * 1e3, "ratio": zml_ / httpx,
            "zml_client_ms": first_use * 1e3}


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
            events = httpx2.EventSource(response).__aiter__()
            await events.__anext__()
            return response, events

        async def open_zml() -> object:
            it = client.infer_stream(MODEL, MESSAGES, policy="bench", max_tokens=10_000,
                                     extra_body={"ignore_eos": True}).__aiter__()
            await it.__anext__()
            return it

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
    with sim_node(slots=2 * count + 64, time_scale=1.0, tokens_per_s=0.5) as config:
        bare = asyncio.run(_hold_streams(config, count, bare=True))
        ours = asyncio.run(_hold_streams(config, count, bare=False))
    return {"streams": ours["streams"], "zml": ours["bytes_per_request"],
            "bare": bare["bytes_per_request"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=1000, help="concurrent streams held")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from routing_decision import measure

    print(f"zml overhead benchmark — {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, "
          f"Python {sys.version.split()[0]}")
    req = bench_requests(args.requests, args.rounds)
    print(f"non-streamed request, client CPU: zml {req['zml_us']:.0f} us, bare httpx2 "
          f"{req['bare_us']:.0f} us -> {req['ratio']:.2f}x (budget <= 1.3x)")
    print(f"streamed request ({req['chunks']:.0f} chunks), client CPU: zml "
          f"{req['zml_stream_us']:.0f} us, bare httpx2+SSE {req['bare_stream_us']:.0f} us -> "
          f"{req['stream_ratio']:.2f}x (budget <= 1.5x)")
    for n, budget in ((100, 20.0), (10_000, 1000.0)):
        m = measure(n, runs=2000 if n == 100 else 200)
        print(f"routing decision at {n} nodes: median {m['median_ns'] / 1e3:.1f} us, p99 "
              f"{m['p99_ns'] / 1e3:.1f} us (budget median <= {budget:g} us)")
    imp = bench_import()
    print(f"import: zml {imp['zml_ms']:.0f} ms, httpx2 {imp['httpx2_ms']:.0f} ms -> "
          f"{imp['ratio']:.2f}x (budget <= 1.3x); zml + first use of zml.Client "
          f"{imp['zml_client_ms']:.0f} ms")
    mem = bench_memory(args.streams)
    print(f"memory per in-flight stream ({mem['streams']:.0f} concurrent): zml "
          f"{mem['zml'] / 1024:.1f} KB, bare httpx2+SSE {mem['bare'] / 1024:.1f} KB -> zml's own "
          f"{(mem['zml'] - mem['bare']) / 1024:.1f} KB (budget <= 16 KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
