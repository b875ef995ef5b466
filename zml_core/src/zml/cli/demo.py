"""``zml demo``: the whole idea in under a minute, on a simulated fleet on this machine.

It writes a ``zml.toml`` (three accelerator families, the release post's ``llama3-production``
policy) and shows it, serves those nodes as simulated vLLM servers on free loopback ports, and
sends traffic in three phases:

1. quiet traffic from the sync ``Client``: everything lands on the first family, H100;
2. a concurrent burst from ``AsyncClient`` (plain and streamed): H100 fills past its high-water
   mark and the rest falls back to MI300X (then H100_PCIe); a burst larger than the fleet's 20
   slots has requests refused with a ``RoutingError`` (the policy does not queue), counted in
   one line;
3. saturation: long streams hold every slot of every family, one more request gets a
   ``RoutingError`` whose ``routing_context`` is printed, then the held streams are cancelled
   and the nodes report the aborted requests.

Then a table of where every request went and why. Without ``--dir`` the ``zml.toml`` lives in a
temporary folder that is removed at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.progress import Progress
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from zml.cli.output import CommandError, stdout_console, table
from zml.client import AsyncClient, Client
from zml.config import load_registry
from zml.errors import RoutingError
from zml.types import RoutingInfo

__all__ = ["DEMO_MODEL", "demo_config", "run_demo"]

DEMO_MODEL = "meta-llama/llama-3-8b-instruct"
POLICY = "llama3-production"
# (node id, family, slots): 20 slots in all
NODES = [
    ("h100-1", "H100", 4), ("h100-2", "H100", 4),
    ("mi300x-1", "MI300X", 4), ("mi300x-2", "MI300X", 4),
    ("h100-pcie-1", "H100_PCIe", 4),
]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_HEADER = "# zml.toml written by `zml demo`"
"""The first line of the demo's zml.toml (how a later demo knows it may replace the file)."""


def demo_config(ports: dict[str, int] | None = None) -> str:
    """The demo's zml.toml text, with each node on the given (or a free) loopback port."""
    ports = ports or {}
    lines = [
        f"{_HEADER}: three accelerator families of simulated vLLM nodes",
        "# on loopback, and the policy from the zml 0.3 release post.",
        "",
        "[accelerators.H100]",
        "cost_per_hour = 4.00",
        "",
        "[accelerators.MI300X]",
        "cost_per_hour = 3.20",
        "",
        "[accelerators.H100_PCIe]",
        "cost_per_hour = 2.40",
        "",
    ]
    for node_id, family, slots in NODES:
        port = ports.get(node_id) or _free_port()
        lines += [
            "[[nodes]]",
            f'id = "{node_id}"',
            f'family = "{family}"',
            f'url = "http://127.0.0.1:{port}"',
            f'models = ["{DEMO_MODEL}"]',
            f"max_concurrency = {slots}",
            "",
        ]
    lines += [
        f"[policies.{POLICY}]",
        'accelerator_chain = ["H100", "MI300X", "H100_PCIe"]',
        "latency_target_ms = 500",
        'cost_priority = "balanced"',
        "",
    ]
    return "\n".join(lines)


def _messages(i: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Request {i}: explain tensor parallelism briefly."}]


async def _burst(config: Path, n: int, records: list[tuple[str, RoutingInfo]],
                 progress: Progress) -> list[RoutingError]:
    """Send ``n`` concurrent requests; record where each went, return the refused ones'
    errors (a burst larger than the fleet's slots finds every node busy: the policy does not
    queue)."""
    task = progress.add_task("burst: AsyncClient, concurrent", total=n)
    async with AsyncClient(config=config) as client:

        async def one(i: int) -> RoutingInfo | RoutingError:
            try:
                if i % 2:
                    stream = client.infer_stream(DEMO_MODEL, _messages(i), policy=POLICY,
                                                 max_tokens=32)
                    async for _ in stream:
                        pass
                    assert stream.routing is not None
                    return stream.routing
                response = await client.infer(DEMO_MODEL, _messages(i), policy=POLICY,
                                              max_tokens=32)
                return response.routing
            except RoutingError as exc:
                return exc
            finally:
                progress.advance(task)

        refused: list[RoutingError] = []
        for info in await asyncio.gather(*(one(i) for i in range(n))):
            if isinstance(info, RoutingError):
                refused.append(info)
            else:
                records.append(("2 burst (async)", info))
        return refused


def _refusals(refused: list[RoutingError], n: int) -> Text:
    """One line on the burst's refused requests: how many, and what routing said."""
    reasons: Counter[str] = Counter()
    finals: Counter[str] = Counter()
    for exc in refused:
        ctx = exc.routing_context
        finals[str(ctx.get("final_error"))] += 1
        for entry in ctx.get("evaluated", ()):
            reasons[f"{entry['family']} {str(entry['rejected_reason']).replace('_', ' ')}"] += 1
    why = ", ".join(reasons) or "no family evaluated"
    slots = sum(s for _, _, s in NODES)
    return Text(
        f"  {len(refused)} of {n} requests refused: zml.RoutingError {', '.join(finals)} "
        f"({why}); the fleet has {slots} slots and {POLICY} does not queue "
        "(queue_on_saturation = true would wait for a slot)"
    )


async def _saturate(config: Path, records: list[tuple[str, RoutingInfo]]
                    ) -> tuple[RoutingError | None, int]:
    """Hold every slot with a stream, send one more request; return its error and how many
    streams were held (and then cancelled)."""
    slots = sum(s for _, _, s in NODES)
    async with AsyncClient(config=config) as client:
        streams = []
        try:
            for i in range(slots):
                # ignore_eos (as vLLM has it): generate all max_tokens, so the stream is still
                # generating when it is cancelled below
                stream = client.infer_stream(DEMO_MODEL, _messages(100 + i), policy=POLICY,
                                             max_tokens=2000, extra_body={"ignore_eos": True})
                iterator = stream.__aiter__()
                await iterator.__anext__()  # dispatched, first token received: slot held
                streams.append((stream, iterator))
                assert stream.routing is not None
                records.append(("3 saturation (held streams)", stream.routing))
            try:
                await client.infer(DEMO_MODEL, _messages(999), policy=POLICY, max_tokens=8)
            except RoutingError as exc:
                return exc, len(streams)
            return None, len(streams)
        finally:
            for stream, iterator in streams:
                await iterator.aclose()  # closes the connection: the node aborts the request
                await stream.aclose()


def _summary(records: list[tuple[str, RoutingInfo]]) -> Table:
    t = table("phase", "family", "requests", "nodes", "why the earlier families were passed",
              title="where the requests went", whole=("family",))
    groups: dict[tuple[str, str], list[RoutingInfo]] = {}
    for phase, info in records:
        groups.setdefault((phase, info.accelerator), []).append(info)
    for (phase, family), infos in groups.items():
        reasons: Counter[str] = Counter()
        for info in infos:
            for entry in info.evaluated:
                if entry["family"] == info.accelerator:
                    break
                reason = str(entry["rejected_reason"]).replace("_", " ")
                reasons[f"{entry['family']} {reason}"] += 1
        why = ", ".join(f"{r} ×{c}" for r, c in reasons.items()) or "first choice"
        nodes = ", ".join(sorted({i.node_id for i in infos}))
        style = "yellow" if reasons else "green"
        t.add_row(phase, Text(family, style=style), str(len(infos)), nodes, why)
    return t


def _wait_idle(fleet: Any, timeout_s: float = 5.0) -> None:
    """Give the nodes a moment to notice the cancelled streams' disconnects."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(n.stats.running == 0 and n.stats.waiting == 0 for n in fleet.nodes.values()):
            return
        time.sleep(0.02)


@contextlib.contextmanager
def _folder(directory: str | None) -> Iterator[Path]:
    """The folder for the demo's zml.toml: ``directory``, or a temporary one removed after."""
    if directory is None:
        with tempfile.TemporaryDirectory(prefix="zml-demo-") as tmp:
            yield Path(tmp)
        return
    folder = Path(directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CommandError(
            f"--dir {directory}: cannot create the folder ({exc.strerror or exc}); pass a "
            "writable folder, or no --dir for a temporary one"
        ) from None
    yield folder


def _refuse_to_overwrite(config: Path, directory: str | None) -> None:
    """A ``zml.toml`` already in ``--dir`` is replaced only if an earlier demo wrote it (its
    ports change from run to run): a project's own configuration is never overwritten."""
    try:
        first = config.read_text(errors="replace").partition("\n")[0]
    except FileNotFoundError:
        return
    except OSError:
        first = ""
    if not first.startswith(_HEADER):
        raise CommandError(
            f"--dir {directory}: {config} exists and was not written by `zml demo`; it is left "
            "as it is: pass another folder, or no --dir for a temporary one"
        )


def run_demo(directory: str | None = None, burst: int = 16, time_scale: float = 1.0) -> int:
    """Run the demo; returns the exit status (0 when it showed a fallback and a routing error)."""
    console = stdout_console()
    with _folder(directory) as folder:
        config = folder / "zml.toml"
        text = demo_config()
        _refuse_to_overwrite(config, directory)
        try:
            config.write_text(text)
        except OSError as exc:
            raise CommandError(
                f"--dir {directory}: cannot write {config} ({exc.strerror or exc}); pass a "
                "writable folder, or no --dir for a temporary one"
            ) from None
        if directory is not None:
            console.print(Text(f"wrote {config}"), soft_wrap=True)
        console.print(Panel(Syntax(text, "toml", theme="ansi_dark", word_wrap=True),
                            title="zml.toml",
                            subtitle="the fleet and the policy live in configuration"))
        fallback, error = _run(console, config, burst, time_scale)
        where = str(config) if directory is not None else "a temporary folder, now removed " \
            "(pass --dir to keep it)"
    console.print(
        f"fallback H100 → MI300X shown: {'yes' if fallback else 'no'}; "
        f"routing error shown: {'yes' if error is not None else 'no'}; config: {where}",
        soft_wrap=True,
    )
    return 0 if fallback and error is not None else 1


def _run(console: Console, config: Path, burst: int,
         time_scale: float) -> tuple[bool, RoutingError | None]:
    from zml.sim import SimFleet
    from zml.sim.from_config import specs_from_registry

    registry = load_registry(config)
    specs, ports = specs_from_registry(registry)
    records: list[tuple[str, RoutingInfo]] = []
    with SimFleet(specs, ports=ports, time_scale=time_scale) as fleet:
        console.rule("1. quiet traffic: zml.Client, one request at a time")
        with Client(config=config) as client:
            for i in range(4):
                r = client.infer(DEMO_MODEL, _messages(i), policy=POLICY, max_tokens=16)
                records.append(("1 quiet (sync)", r.routing))
                line = Text(f"  request {i} → ")
                line.append(r.routing.node_id, style="bold")
                line.append(f" ({r.routing.accelerator}): {r.choices[0].message.content!r}")
                console.print(line)

        console.rule(f"2. a burst of {burst} concurrent requests: zml.AsyncClient")
        with Progress(console=console, transient=False) as progress:
            refused = asyncio.run(_burst(config, burst, records, progress))
        if refused:
            console.print(_refusals(refused, burst), soft_wrap=True)

        console.rule("3. saturation: every slot of every family held by a stream")
        error, held = asyncio.run(_saturate(config, records))
        if error is not None:
            console.print(Text("one more request →", style="bold")
                          + Text(" zml.RoutingError; its routing_context:"))
            console.print_json(data=error.routing_context)
        console.print(f"cancelled {held} held streams; the nodes drop them")

        console.print(_summary(records))
        _wait_idle(fleet)
        stats = table("node", "family", "requests", "aborted by client", title="node counters",
                      whole=("node",))
        for node_id, node in fleet.nodes.items():
            s = node.stats
            stats.add_row(node_id, node.spec.family, str(s.requests_total), str(s.aborted_total))
        console.print(stats)

    fallback = any(i.accelerator != "H100" and p.startswith("2") for p, i in records)
    return fallback, error
