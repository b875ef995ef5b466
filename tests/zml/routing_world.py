"""The small world the routing unit tests route in: nodes, a fleet view, a policy, and
helpers that call zml.routing.route with a fixed clock and seed."""

from __future__ import annotations

import random
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from zml.routing import Decision, NoRoute, route

MODEL = "meta-llama/llama-3-8b-instruct"
CAPACITY_HINT = "increase fleet capacity or enable queue_on_saturation"


@dataclass
class Node:
    id: str
    family: str = "H100"
    max_concurrency: int = 4
    max_queue: int = 4
    load: int = 0
    health: float = 1.0
    ttft_ms: float | None = 100.0
    service_ms: float | None = 1000.0
    open_until: float = 0.0
    models: tuple[str, ...] = (MODEL,)

    def circuit_allows(self, now: float) -> bool:
        return now >= self.open_until


class Fleet:
    def __init__(
        self,
        nodes: Iterable[Node],
        costs: Mapping[str, float | None] | None = None,
        families: Sequence[str] | None = None,
    ) -> None:
        self.nodes = list(nodes)
        self.costs = costs or {}
        order: list[str] = list(families or [])
        for n in self.nodes:
            if n.family not in order:
                order.append(n.family)
        self._families = tuple(order)
        self.index: dict[tuple[str, str], list[Node]] = {}
        for n in self.nodes:
            for m in n.models:
                self.index.setdefault((m, n.family), []).append(n)

    def families(self) -> Sequence[str]:
        return self._families

    def family_cost(self, family: str) -> float | None:
        return self.costs.get(family)

    def nodes_for(self, model: str, family: str) -> Sequence[Node]:
        return self.index.get((model, family), [])


@dataclass(frozen=True)
class Policy:
    name: str = "p"
    accelerator_chain: tuple[str, ...] = ("H100", "MI300X", "H100_PCIe")
    latency_target_ms: float | None = 500.0
    cost_priority: typing.Literal["cost", "latency", "balanced"] = "balanced"
    health_threshold: float = 0.5


NOW = 1000.0


def go(
    policy: Policy | None,
    fleet: Fleet,
    *,
    seed: int = 0,
    model: str = MODEL,
    **kw: typing.Any,
) -> Decision | NoRoute:
    return route(policy, model, fleet, now=NOW, rng=random.Random(seed), **kw)


def decision(policy: Policy | None, fleet: Fleet, **kw: typing.Any) -> Decision:
    result = go(policy, fleet, **kw)
    assert isinstance(result, Decision), result
    return result


def no_route(policy: Policy | None, fleet: Fleet, **kw: typing.Any) -> NoRoute:
    result = go(policy, fleet, **kw)
    assert isinstance(result, NoRoute), result
    return result


def trace(result: Decision | NoRoute) -> list[tuple[str, int, str | None]]:
    return [(e.family, e.nodes_checked, e.rejected_reason) for e in result.evaluated]


def busy_family(
    family: str, util: float, n: int = 2, slots: int = 10, **kw: typing.Any
) -> list[Node]:
    """n nodes of `slots` slots whose loads add up to util * total slots (nodes keep room)."""
    total = round(util * n * slots)
    loads = [total // n + (1 if i < total % n else 0) for i in range(n)]
    return [
        Node(f"{family.lower()}-{i}", family, slots, slots, load, **kw)
        for i, load in enumerate(loads)
    ]
