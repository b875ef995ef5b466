"""``zml sim serve``, ``zml route``, ``zml policy check`` and ``zml fleet status``."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
from urllib.parse import urlsplit

import httpx2
from rich.text import Text

from zml import routing
from zml.cli.output import CommandError, print_error, stderr_console, stdout_console, table
from zml.client import Client
from zml.config import Registry, discover_path, load_registry, suggest
from zml.errors import PolicyConfigError
from zml.node_urls import redact_url
from zml.probe import Prober

__all__ = ["fleet_status", "policy_check", "route", "sim_serve"]


def _client(config: str | None) -> Client:
    if discover_path(config) is None:
        raise PolicyConfigError(
            "no zml.toml found: pass --config PATH, set ZML_CONFIG, or run where a zml.toml is "
            "(`zml demo --dir .` writes an example)",
            field="config",
        )
    return Client(config=config)


def _check_port(node_id: str, host: str, port: int, config: str) -> None:
    """Fail with a message naming the node when its port cannot be listened on."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1)
    except OSError as exc:
        why = ("the port is already in use (another `zml sim serve`, or another server?)"
               if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc))
        raise CommandError(
            f"node {node_id!r} cannot listen on {host}:{port}: {why}; stop what uses it, or "
            f"change the node's url in {config}"
        ) from None
    finally:
        sock.close()


def _check_servable(registry: Registry, simulated: set[str], config: str) -> None:
    """Every simulated node is served where its ``url`` says, or the command stops naming it:
    plain http, on 127.0.0.1 (or localhost), on the port written, one node per port. A node
    served elsewhere than its url (a random port, plain http for https, 127.0.0.1 for ::1)
    would be unreachable for every client of the same file."""
    taken: dict[int, str] = {}
    for node in registry.nodes:
        if node.id not in simulated:
            continue
        parts = urlsplit(node.url)
        problem = None
        if parts.scheme != "http":
            problem = (f"is {parts.scheme}://, and zml sim serve serves plain http: write "
                       "http://")
        elif parts.hostname not in ("127.0.0.1", "localhost"):
            problem = (f"is on {parts.hostname}, and zml sim serve listens on 127.0.0.1: "
                       "write 127.0.0.1 (or localhost)")
        elif parts.port is None:
            problem = ("has no port, and zml sim serve must listen where clients will "
                       "connect: write one, as http://127.0.0.1:8001")
        elif parts.port in taken:
            problem = (f"has port {parts.port}, as node {taken[parts.port]!r} has: give each "
                       "simulated node its own port")
        if problem is not None:
            raise CommandError(f"node {node.id!r} in {config}: url {node.url!r} {problem}")
        assert parts.port is not None
        taken[parts.port] = node.id


def sim_serve(config: str, *, time_scale: float = 1.0) -> int:
    """Serve every loopback node of ``config`` as a simulated node, until interrupted."""
    from zml.sim import SimFleet
    from zml.sim.from_config import specs_from_registry

    console = stdout_console()
    registry = load_registry(discover_path(config) or config)  # a directory, a bad name: typed
    specs, ports = specs_from_registry(registry)
    if not specs:
        raise PolicyConfigError(
            f"{config} has no [[nodes]] on loopback (127.0.0.1/localhost) to simulate",
            field="nodes", source=config,
        )
    _check_servable(registry, {spec.id for spec in specs}, config)
    for node_id, port in ports.items():
        if port:
            _check_port(node_id, "127.0.0.1", port, config)
    try:
        fleet = SimFleet(specs, ports=ports, time_scale=time_scale)
    except OSError as exc:
        raise CommandError(f"cannot listen on the nodes' ports: {exc.strerror or exc}") from None
    t = table("node", "family", "url", "models", "slots", title="simulated fleet",
              whole=("node", "url"))
    for spec in specs:
        t.add_row(spec.id, spec.family, fleet.url(spec.id), ", ".join(spec.models),
                  str(spec.max_concurrency))
    console.print(t)
    console.print("serving; press Ctrl-C to stop")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(fleet.serve())
    return 0


def route(config: str | None, policy: str | None, model: str, accelerator: str | None,
          *, explain: bool, probe: bool) -> int:
    """Print the decision routing would make now (nothing is sent, nothing reserved)."""
    console = stdout_console()
    with _client(config) as client:
        families = client.registry.families
        if accelerator is not None and accelerator not in families:
            hint = suggest(accelerator, families)
            raise CommandError(
                f"--accelerator {accelerator}: unknown accelerator family (registered: "
                + (", ".join(families) or "none") + ")"
                + (f"; did you mean {hint}?" if hint else "")
            )
        resolved = client.policy(policy) if policy else None
        if probe:
            with httpx2.Client() as http:
                Prober(client.fleet).probe_all(http)
        decision = client.explain(model, policy=resolved, accelerator=accelerator)
        if isinstance(decision, routing.Decision):
            line = Text("would route to ", style="green")
            line.append(decision.node.id, style="bold")
            line.append(f" ({decision.family}), predicted TTFT "
                        f"{decision.predicted_ttft_ms:.0f} ms")
            console.print(line, soft_wrap=True)
            status = 0
        else:
            line = Text("no route: ", style="red")
            line.append(f"{decision.final_error} — {decision.recommendation}")
            console.print(line, soft_wrap=True)
            status = 1
        if explain:
            t = table("family", "nodes checked", "result", title="evaluation (chain order)",
                      whole=("family",))
            for entry in (e.as_dict() for e in decision.evaluated):
                reason = entry["rejected_reason"]
                t.add_row(str(entry["family"]), str(entry["nodes_checked"]),
                          Text("chosen", style="green") if reason is None else str(reason))
            console.print(t)
        return status


def policy_check(config: str | None) -> int:
    """Validate the configuration and its policies: list every problem, or the policies."""
    from zml.cli.check import config_problems

    path = discover_path(config)
    if path is None:
        _client(config)  # raises the "no zml.toml found" error
        return 2  # pragma: no cover
    problems = config_problems(path)
    if problems:
        err = stderr_console()
        for problem in problems:
            print_error(err, "PolicyConfigError", problem)
        err.print(Text(f"{len(problems)} problem{'s' if len(problems) > 1 else ''} in {path}"),
                  soft_wrap=True)
        return 2
    console = stdout_console()
    with _client(str(path)) as client:
        _check_gateway_names(client)
        t = table("policy", "chain", "latency target", "cost priority", "queue",
                  title=f"policies in {client.registry.source}", whole=("policy",))
        for name, p in client.policies.items():
            t.add_row(name, " → ".join(p.accelerator_chain),
                      "-" if p.latency_target_ms is None else f"{p.latency_target_ms:g} ms",
                      p.cost_priority, "yes" if p.queue_on_saturation else "no")
        console.print(t)
        ok = Text("ok", style="green")
        ok.append(f": {len(client.registry.families)} families, {len(client.registry.nodes)} "
                  f"nodes, {len(client.policies)} policies")
        console.print(ok, soft_wrap=True)
    return 0


def _check_gateway_names(client: Client) -> None:
    """What ``zml serve`` checks of ``[gateway]`` once the policies are known (plugins' too):
    ``default_policy`` and each alias name a known policy and a served model."""
    registry = client.registry
    if not registry.gateway:
        return
    from zml.gateway.selection import Selector
    from zml.gateway.settings import gateway_settings

    served = {model for node in registry.nodes for model in node.models}
    Selector(gateway_settings(registry), served, client.policies).check(registry.source)


def fleet_status(config: str | None) -> int:
    """Probe every node (its ``/health`` and ``/metrics``) and show whether it is up and its
    load; circuit state is a client's own, in ``client.fleet.status()``.

    One table line per node; why a node is down (``ConnectError: [Errno 111] Connection
    refused``) is printed whole below the table, one line per down node, so the table keeps
    one line per node at 80 columns and when piped."""
    console = stdout_console()
    with _client(config) as client, httpx2.Client() as http:
        results = {r.node_id: r for r in Prober(client.fleet).probe_all(http)}
        t = table("node", "family", "url", "health", "running", "waiting", "slots",
                  title="fleet status", whole=("node", "family", "url", "health"))
        reasons: list[Text] = []
        for node in client.fleet:
            r = results[node.id]
            t.add_row(
                node.id, node.family, redact_url(node.url),
                Text("up", style="green") if r.healthy else Text("down", style="red"),
                "-" if r.running is None else str(r.running),
                "-" if r.waiting is None else str(r.waiting),
                str(node.max_concurrency),
            )
            if not r.healthy:
                reason = Text(f"{node.id}: ")
                reason.append("down", style="red")
                reason.append(f" {r.error}" if r.error else "")
                reasons.append(reason)
        console.print(t)
        for reason in reasons:
            console.print(reason, soft_wrap=True)
        return 0 if all(r.healthy for r in results.values()) else 1
