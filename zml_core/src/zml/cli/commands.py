"""``zml sim serve``, ``zml route``, ``zml policy check`` and ``zml fleet status``."""

from __future__ import annotations

import asyncio
import contextlib

import httpx2
from rich.console import Console
from rich.table import Table

from zml import routing
from zml.client import Client
from zml.config import discover_path, load_registry
from zml.errors import PolicyConfigError
from zml.probe import Prober

__all__ = ["fleet_status", "policy_check", "route", "sim_serve"]

console = Console()


def _client(config: str | None) -> Client:
    if discover_path(config) is None:
        raise PolicyConfigError(
            "no zml.toml found: pass --config PATH, set ZML_CONFIG, or run where a zml.toml is "
            "(`zml demo --dir .` writes an example)",
            field="config",
        )
    return Client(config=config)


def sim_serve(config: str, *, time_scale: float = 1.0) -> int:
    """Serve every loopback node of ``config`` as a simulated node, until interrupted."""
    from zml.sim import SimFleet
    from zml.sim.from_config import specs_from_registry

    registry = load_registry(config)
    specs, ports = specs_from_registry(registry)
    if not specs:
        raise PolicyConfigError(
            f"{config} has no [[nodes]] on loopback (127.0.0.1/localhost) to simulate",
            field="nodes", source=config,
        )
    fleet = SimFleet(specs, ports=ports, time_scale=time_scale)
    table = Table("node", "family", "url", "models", "slots", title="simulated fleet")
    for spec in specs:
        table.add_row(spec.id, spec.family, fleet.url(spec.id), ", ".join(spec.models),
                      str(spec.max_concurrency))
    console.print(table)
    console.print("serving; press Ctrl-C to stop")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(fleet.serve())
    return 0


def route(config: str | None, policy: str | None, model: str, accelerator: str | None,
          *, explain: bool, probe: bool) -> int:
    """Print the decision routing would make now (nothing is sent, nothing reserved)."""
    with _client(config) as client:
        resolved = client.policy(policy) if policy else None
        if probe:
            with httpx2.Client() as http:
                Prober(client.fleet).probe_all(http)
        decision = client.explain(model, policy=resolved, accelerator=accelerator)
        if isinstance(decision, routing.Decision):
            console.print(
                f"[green]would route to[/] [bold]{decision.node.id}[/] "
                f"({decision.family}), predicted TTFT {decision.predicted_ttft_ms:.0f} ms"
            )
            trace = [e.as_dict() for e in decision.evaluated]
            status = 0
        else:
            console.print(f"[red]no route:[/] {decision.final_error} — {decision.recommendation}")
            trace = [e.as_dict() for e in decision.evaluated]
            status = 1
        if explain:
            table = Table("family", "nodes checked", "result", title="evaluation (chain order)")
            for entry in trace:
                reason = entry["rejected_reason"]
                table.add_row(str(entry["family"]), str(entry["nodes_checked"]),
                              "[green]chosen[/]" if reason is None else str(reason))
            console.print(table)
        return status


def policy_check(config: str | None) -> int:
    """Validate the configuration and its policies; list them."""
    with _client(config) as client:
        table = Table("policy", "chain", "latency target", "cost priority", "queue",
                      title=f"policies in {client.registry.source}")
        for name, p in client.policies.items():
            table.add_row(name, " → ".join(p.accelerator_chain),
                          "-" if p.latency_target_ms is None else f"{p.latency_target_ms:g} ms",
                          p.cost_priority, "yes" if p.queue_on_saturation else "no")
        console.print(table)
        console.print(f"[green]ok[/]: {len(client.registry.families)} families, "
                      f"{len(client.registry.nodes)} nodes, {len(client.policies)} policies")
    return 0


def fleet_status(config: str | None) -> int:
    """Probe every node and show health, load and circuit state."""
    with _client(config) as client, httpx2.Client() as http:
        results = {r.node_id: r for r in Prober(client.fleet).probe_all(http)}
        table = Table("node", "family", "url", "health", "running", "waiting", "slots",
                      title="fleet status")
        for node in client.fleet:
            r = results[node.id]
            table.add_row(
                node.id, node.family, node.url,
                "[green]up[/]" if r.healthy else f"[red]down[/] {r.error or ''}",
                "-" if r.running is None else str(r.running),
                "-" if r.waiting is None else str(r.waiting),
                str(node.max_concurrency),
            )
        console.print(table)
        return 0 if all(r.healthy for r in results.values()) else 1
