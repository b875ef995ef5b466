"""What the gateway (``zml serve``) adds to a request, against calling the node directly.

One simulated node (``zml.sim.SimNode`` under uvicorn, no artificial delays) is called four ways, each from
this process with the same httpx2 load generator:

* ``direct``: the node itself (the baseline);
* ``gateway``: ``zml serve`` in front of it (one worker, default policy, no gateway keys);
* ``passthrough``: a bare uvicorn pass-through proxy written for this benchmark (raw ASGI,
  httpx2 forwards the body and streams the node's bytes back: no routing, no parsing);
* ``litellm``: LiteLLM's proxy (``litellm --config``), when it is installed in a separate
  environment: ``uv venv /tmp/litellm-venv && uv pip install --python
  /tmp/litellm-venv/bin/python 'litellm[proxy]'`` (or ``--litellm PATH`` to its ``litellm``).

at 1 and 64 requests in flight, non-streamed (``max_tokens`` 16) and streamed (32 chunks,
``stream_options.include_usage``). Latency is measured per request end to end (a stream: until
``[DONE]`` was read); a proxy's *added* latency is its p50 (p99) minus the direct p50 (p99) of
the same run. CPU per request is the proxy process's own user+system CPU (``/proc``, so
Linux only), divided by the requests it served. Rounds alternate the targets so that noise
from other work on the machine falls on all of them; every figure is from one run on one
machine, and a loaded machine moves all of them.

Output: a table per mode, then one line per figure, in this stable format (for scripts)::

    <target> added p50 <json|stream> C=<n>: <ms> ms
    <target> added p99 <json|stream> C=<n>: <ms> ms
    <target> cpu/request <json|stream> C=<n>: <ms> ms
    gateway cpu vs <litellm|passthrough> <json|stream> C=<n>: <ratio>x

with ``<target>`` one of ``gateway``, ``passthrough``, ``litellm``. Targets (DESIGN.md):
gateway added p50 json C=1 <= 1 ms; gateway CPU per request <= 1/5 of LiteLLM's (<= 0.2x), or,
without LiteLLM, <= 2x the pass-through proxy's. Always exits 0: figures, not a gate.

Run: ``uv run python benchmarks/gateway_overhead.py [--requests N] [--rounds R]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2

MODEL = "bench-model"
MESSAGES = [{"role": "user", "content": "benchmark"}]
LITELLM_DEFAULT = Path("/tmp/litellm-venv/bin/litellm")
LITELLM_KEY = "sk-bench-3f9a1c7e5d2b8a604c1e9f7d3b5a2c8e"  # LiteLLM refuses to start open
CONCURRENCY = (1, 64)
MODES = ("json", "stream")
KEEPALIVE_S = 3.0  # below uvicorn's 5 s keep-alive timeout: never reuse a connection being closed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            if httpx2.get(url, timeout=2).status_code < 500:
                return
        except httpx2.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not start within {timeout:.0f}s")


@contextmanager
def _process(args: list[str], health: str, what: str,
             env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    log = tempfile.NamedTemporaryFile(prefix="zml-bench-", suffix=".log", delete=False)  # noqa: SIM115 - kept for the run
    proc = subprocess.Popen(args, stdout=log, stderr=log, env=env)
    try:
        try:
            _wait_http(health, proc, what)
        except RuntimeError:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-3000:])
            raise
        print(f"  {what}: pid {proc.pid}, log {log.name}", file=sys.stderr)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _cpu_seconds(pid: int) -> float:
    """User+system CPU of a process and its descendants, from /proc (Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    stack = [pid]
    while stack:
        p = stack.pop()
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
        for task in Path(f"/proc/{p}/task").glob("*/children"):
            with suppress(OSError):
                stack += [int(c) for c in task.read_text().split()]
    return total


# --- the bare pass-through proxy (run as a subprocess of this script) -----------------------


def passthrough_app(node_url: str) -> Callable[..., Awaitable[None]]:
    """A raw ASGI proxy: forwards the body, streams the node's bytes back, nothing else."""
    state: dict[str, httpx2.AsyncClient] = {}
    target = node_url + "/v1/chat/completions"
    forward = {"content-type": "application/json"}

    async def app(scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    state["http"] = httpx2.AsyncClient(
                        limits=httpx2.Limits(max_connections=None, max_keepalive_connections=256,
                                            keepalive_expiry=KEEPALIVE_S),
                        timeout=httpx2.Timeout(60.0))
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await state["http"].aclose()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        http = state["http"]
        r = await http.send(http.build_request("POST", target, content=b"".join(parts),
                                               headers=forward), stream=True)
        try:
            await send({"type": "http.response.start", "status": r.status_code,
                        "headers": [(b"content-type",
                                     r.headers.get("content-type", "").encode())]})
            async for chunk in r.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await r.aclose()

    return app


def _serve_node(config: str) -> None:
    """The simulated node under ``uvicorn.run`` (its own listening socket, with TCP_NODELAY on
    accepted connections, as every real server has it)."""
    from urllib.parse import urlsplit

    import uvicorn

    from zml.config import load_registry
    from zml.sim import SimNode
    from zml.sim.from_config import specs_from_registry

    registry = load_registry(config)
    (spec,), _ = specs_from_registry(registry)
    port = urlsplit(registry.nodes[0].url).port
    uvicorn.run(SimNode(spec, time_scale=0.0), host="127.0.0.1", port=port, log_level="warning",
                access_log=False, lifespan="on")


def _serve_passthrough(port: int, node_url: str) -> None:
    import uvicorn

    uvicorn.run(passthrough_app(node_url), host="127.0.0.1", port=port, log_level="warning",
                access_log=False, lifespan="on")


# --- targets ------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    url: str  # the chat completions URL
    pid: int | None  # the proxy process (None: the node itself)
    latencies: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    cpu: dict[tuple[str, int], float] = field(default_factory=dict)
    served: dict[tuple[str, int], int] = field(default_factory=dict)


def _config(folder: Path, node_port: int) -> Path:
    path = folder / "zml.toml"
    path.write_text(
        "[accelerators.H100]\n\n[[nodes]]\nid = \"bench\"\nfamily = \"H100\"\n"
        f"url = \"http://127.0.0.1:{node_port}\"\nmodels = [\"{MODEL}\"]\n"
        "max_concurrency = 256\n\n[nodes.sim]\nqueue_size = 4096\n\n"
        "[policies.bench]\naccelerator_chain = [\"H100\"]\n\n"
        "[gateway]\ndefault_policy = \"bench\"\n")
    return path


def _litellm_config(folder: Path, node_port: int) -> Path:
    path = folder / "litellm.yaml"
    path.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: http://127.0.0.1:{node_port}/v1\n"
        "      api_key: sk-bench\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  drop_params: true\n"
        "general_settings:\n"
        f"  master_key: {LITELLM_KEY}\n"
        "  disable_spend_logs: true\n")
    return path


def _body(mode: str) -> bytes:
    import json

    if mode == "json":
        return json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 16}).encode()
    return json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 32,
                       "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


async def _run(target: Target, mode: str, concurrency: int, count: int,
               http: httpx2.AsyncClient) -> None:
    body = _body(mode)
    headers = {"content-type": "application/json", "authorization": f"Bearer {LITELLM_KEY}"}
    latencies = target.latencies.setdefault((mode, concurrency), [])
    remaining = count

    async def one() -> None:
        start = time.perf_counter()
        if mode == "json":
            r = await http.post(target.url, content=body, headers=headers)
            if r.status_code != 200:
                raise RuntimeError(f"{target.name}: HTTP {r.status_code}: {r.text[:300]}")
        else:
            async with http.stream("POST", target.url, content=body, headers=headers) as r:
                data = b"".join([chunk async for chunk in r.aiter_bytes()])
                if r.status_code != 200 or b"[DONE]" not in data:
                    raise RuntimeError(f"{target.name}: HTTP {r.status_code}: {data[-300:]!r}")
        latencies.append(time.perf_counter() - start)

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            await one()

    before = _cpu_seconds(target.pid) if target.pid else 0.0
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    after = _cpu_seconds(target.pid) if target.pid else 0.0
    key = (mode, concurrency)
    target.cpu[key] = target.cpu.get(key, 0.0) + after - before
    target.served[key] = target.served.get(key, 0) + count


async def _measure(targets: list[Target], requests: int, rounds: int) -> None:
    limits = httpx2.Limits(max_connections=None, max_keepalive_connections=256,
                           keepalive_expiry=KEEPALIVE_S)
    async with httpx2.AsyncClient(limits=limits, timeout=httpx2.Timeout(120.0)) as http:
        for mode in MODES:
            for concurrency in CONCURRENCY:
                count = requests if concurrency == 1 else requests * 4
                for t in targets:  # warm-up: connections, lazy imports, caches
                    await _run(t, mode, concurrency, min(count, 2 * concurrency + 20), http)
                    t.latencies.pop((mode, concurrency))
                    t.cpu.pop((mode, concurrency))
                    t.served.pop((mode, concurrency))
                for i in range(rounds):
                    order = targets if i % 2 == 0 else targets[::-1]
                    for t in order:
                        await _run(t, mode, concurrency, count, http)
                print(f"  measured {mode} C={concurrency}", file=sys.stderr, flush=True)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _report(targets: list[Target]) -> None:
    direct = targets[0]
    proxies = targets[1:]
    lines: list[str] = []
    for mode in MODES:
        for c in CONCURRENCY:
            key = (mode, c)
            print(f"\n{mode}, {c} in flight ({len(direct.latencies[key])} requests per target)")
            print(f"  {'target':<12} {'p50 ms':>9} {'p99 ms':>9} {'added p50':>10} "
                  f"{'added p99':>10} {'CPU/req ms':>11}")
            d50 = statistics.median(direct.latencies[key])
            d99 = _pct(direct.latencies[key], 0.99)
            print(f"  {'direct':<12} {d50 * 1e3:9.3f} {d99 * 1e3:9.3f} {'':>10} {'':>10} "
                  f"{'':>11}")
            for t in proxies:
                p50 = statistics.median(t.latencies[key])
                p99 = _pct(t.latencies[key], 0.99)
                cpu = t.cpu[key] / t.served[key]
                print(f"  {t.name:<12} {p50 * 1e3:9.3f} {p99 * 1e3:9.3f} "
                      f"{(p50 - d50) * 1e3:10.3f} {(p99 - d99) * 1e3:10.3f} {cpu * 1e3:11.3f}")
                lines.append(f"{t.name} added p50 {mode} C={c}: {(p50 - d50) * 1e3:.2f} ms")
                lines.append(f"{t.name} added p99 {mode} C={c}: {(p99 - d99) * 1e3:.2f} ms")
                lines.append(f"{t.name} cpu/request {mode} C={c}: {cpu * 1e3:.3f} ms")
            gateway = next(t for t in proxies if t.name == "gateway")
            for other in proxies:
                if other is gateway:
                    continue
                ratio = (gateway.cpu[key] / gateway.served[key]) / \
                    max(other.cpu[key] / other.served[key], 1e-9)
                lines.append(f"gateway cpu vs {other.name} {mode} C={c}: {ratio:.2f}x")
    print()
    for line in lines:
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400,
                        help="requests per target per round at 1 in flight (x4 at 64)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--litellm", default=str(LITELLM_DEFAULT),
                        help="the litellm executable of a separate environment")
    parser.add_argument("--no-litellm", action="store_true")
    parser.add_argument("--serve-passthrough", nargs=2, metavar=("PORT", "NODE_URL"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--serve-node", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_node:
        _serve_node(args.serve_node)
        return 0
    if args.serve_passthrough:
        _serve_passthrough(int(args.serve_passthrough[0]), args.serve_passthrough[1])
        return 0

    folder = Path(tempfile.mkdtemp(prefix="zml-gw-bench-"))
    node_port, gw_port, pt_port, ll_port = (_free_port() for _ in range(4))
    config = _config(folder, node_port)
    node_url = f"http://127.0.0.1:{node_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    litellm = shutil.which(args.litellm) or (args.litellm if Path(args.litellm).is_file()
                                             else None)
    print(f"zml gateway overhead benchmark — {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, Python "
          f"{sys.version.split()[0]}")
    with ExitStack() as stack:
        stack.enter_context(_process(
            [sys.executable, __file__, "--serve-node", str(config)],
            f"{node_url}/health", "the simulated node", env))
        targets = [Target("direct", f"{node_url}/v1/chat/completions", None)]
        gw = stack.enter_context(_process(
            [sys.executable, "-m", "zml", "serve", "--config", str(config), "--port",
             str(gw_port)], f"http://127.0.0.1:{gw_port}/health", "zml serve", env))
        targets.append(Target("gateway", f"http://127.0.0.1:{gw_port}/v1/chat/completions",
                              gw.pid))
        pt = stack.enter_context(_process(
            [sys.executable, __file__, "--serve-passthrough", str(pt_port), node_url],
            f"http://127.0.0.1:{pt_port}/health", "the pass-through proxy", env))
        targets.append(Target("passthrough", f"http://127.0.0.1:{pt_port}/v1/chat/completions",
                              pt.pid))
        if args.no_litellm or litellm is None:
            print("LiteLLM proxy: not measured ("
                  + ("--no-litellm" if args.no_litellm else f"no litellm at {args.litellm}")
                  + "); the gateway is compared with the pass-through proxy")
        else:
            ll_env = {**env, "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False",
                      "DISABLE_SCHEMA_UPDATE": "true"}
            try:
                ll = stack.enter_context(_process(
                    [litellm, "--config", str(_litellm_config(folder, node_port)), "--host",
                     "127.0.0.1", "--port", str(ll_port), "--num_workers", "1"],
                    f"http://127.0.0.1:{ll_port}/health/liveliness", "the LiteLLM proxy",
                    ll_env))
                targets.append(Target("litellm",
                                      f"http://127.0.0.1:{ll_port}/v1/chat/completions", ll.pid))
                version = subprocess.run([litellm, "--version"], capture_output=True,
                                         text=True, env=ll_env, check=False).stdout.strip()
                print(f"LiteLLM proxy: {litellm} ({version.splitlines()[-1] if version else '?'})")
            except RuntimeError as exc:
                print(f"LiteLLM proxy: not measured ({exc})")
        print(f"targets: {', '.join(t.name for t in targets)}; {args.rounds} rounds of "
              f"{args.requests} requests (x4 at 64 in flight)")
        asyncio.run(_measure(targets, args.requests, args.rounds))
        _report(targets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
