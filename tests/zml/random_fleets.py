"""Random fleets and policies for the routing property tests: a fleet view over plain nodes
(duck-typed as zml.routing's NodeView and FleetView) and hypothesis strategies that draw them,
with few distinct values so that ties and edge cases are common."""

from __future__ import annotations

import typing
from collections.abc import Sequence
from dataclasses import dataclass, field

from hypothesis import strategies as st

MODEL = "m"
POOL = ("H100", "MI300X", "H100_PCIe", "A100")
NOW = 50.0


@dataclass(eq=False)
class Node:
    id: str
    family: str
    max_concurrency: int
    max_queue: int
    load: int
    health: float
    ttft_ms: float | None
    service_ms: float | None
    circuit_is_open: bool
    serves: bool

    def circuit_allows(self, now: float) -> bool:
        return not self.circuit_is_open


@dataclass
class Fleet:
    order: tuple[str, ...]
    nodes: list[Node]
    costs: dict[str, float | None]
    index: dict[str, list[Node]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for n in self.nodes:
            if n.serves:
                self.index.setdefault(n.family, []).append(n)

    def families(self) -> Sequence[str]:
        return self.order

    def family_cost(self, family: str) -> float | None:
        return self.costs.get(family)

    def nodes_for(self, model: str, family: str) -> Sequence[Node]:
        return self.index.get(family, []) if model == MODEL else []


@dataclass(frozen=True)
class Policy:
    name: str
    accelerator_chain: tuple[str, ...]
    latency_target_ms: float | None
    cost_priority: typing.Literal["cost", "latency", "balanced"]
    health_threshold: float


@st.composite
def fleets(draw: st.DrawFn) -> Fleet:
    present = draw(st.lists(st.sampled_from(POOL), unique=True, min_size=1, max_size=len(POOL)))
    nodes: list[Node] = []
    for family in present:
        for _ in range(draw(st.integers(0, 6) if draw(st.booleans()) else st.integers(1, 3))):
            mc = draw(st.integers(1, 4))
            mq = draw(st.integers(0, 4))
            nodes.append(
                Node(
                    id=f"{family}-{len(nodes)}",
                    family=family,
                    max_concurrency=mc,
                    max_queue=mq,
                    load=draw(st.integers(0, mc + mq)),
                    health=draw(st.sampled_from([0.0, 0.5, 0.8, 0.9, 1.0, 1.0])),
                    # few distinct values, so that ties are common
                    ttft_ms=draw(st.sampled_from([None, 50.0, 100.0, 200.0, 400.0])),
                    service_ms=draw(st.sampled_from([None, 200.0, 1000.0])),
                    circuit_is_open=draw(st.integers(0, 6)) == 0,
                    serves=draw(st.integers(0, 8)) > 0,
                )
            )
    costs = {f: draw(st.sampled_from([None, 0.0, 1.0, 2.0, 3.5])) for f in POOL}
    return Fleet(tuple(present), nodes, costs)


policies = st.builds(
    Policy,
    name=st.just("p"),
    accelerator_chain=st.lists(st.sampled_from(POOL), unique=True, min_size=1).map(tuple),
    latency_target_ms=st.sampled_from([None, 150.0, 300.0, 800.0, 3000.0]),
    cost_priority=st.sampled_from(["cost", "latency", "balanced"]),
    health_threshold=st.sampled_from([0.0, 0.5, 0.8]),
)
