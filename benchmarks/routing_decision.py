"""Routing decision time: median and p99 of ``zml.routing.route`` at 100 and 10,000 nodes.

Budget (DESIGN.md): median <= 20 us at 100 nodes, <= 1 ms at 10,000 nodes (3 families).
The fleet is built from plain slotted dataclasses (the shape fleet.py's NodeState has), with
random loads, observed latencies on most nodes and a few circuit-open or unhealthy nodes.
Run: ``uv run python benchmarks/routing_decision.py [--runs N]``. Always exits 0: the numbers
are for reading (and for the overhead benchmark, which imports ``measure``), not a gate.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from zml.routing import Decision, route

FAMILIES = ("H100", "MI300X", "H100_PCIe")
COSTS = {"H100": 2.5, "MI300X": 3.0, "H100_PCIe": 1.8}
MODEL = "meta-llama/llama-3-8b-instruct"
BUDGET_NS = {100: 20_000, 10_000: 1_000_000}


@dataclass(slots=True)
class BenchNode:
    id: str
    family: str
    max_concurrency: int
    max_queue: int
    load: int
    health: float
    ttft_ms: float | None
    service_ms: float | None
    open_until: float = 0.0

    def circuit_allows(self, now: float) -> bool:
        return now >= self.open_until


@dataclass(slots=True)
class BenchFleet:
    index: dict[tuple[str, str], list[BenchNode]] = field(default_factory=dict)

    def families(self) -> Sequence[str]:
        return FAMILIES

    def family_cost(self, family: str) -> float | None:
        return COSTS.get(family)

    def nodes_for(self, model: str, family: str) -> Sequence[BenchNode]:
        return self.index.get((model, family), ())


@dataclass(frozen=True, slots=True)
class BenchPolicy:
    name: str
    accelerator_chain: tuple[str, ...]
    latency_target_ms: float | None
    cost_priority: str
    health_threshold: float = 0.5


def build_fleet(n_nodes: int, seed: int = 0, busy: float = 0.6) -> BenchFleet:
    """n_nodes spread over 3 families; load uniform in [0, 2 * busy * slots]."""
    rng = random.Random(seed)
    fleet = BenchFleet()
    for i in range(n_nodes):
        family = FAMILIES[i % len(FAMILIES)]
        slots = rng.choice((8, 16, 32))
        node = BenchNode(
            id=f"{family.lower()}-{i}",
            family=family,
            max_concurrency=slots,
            max_queue=slots,
            load=rng.randint(0, int(2 * busy * slots)),
            health=1.0 if rng.random() > 0.02 else 0.2,
            ttft_ms=rng.uniform(80.0, 400.0) if rng.random() > 0.1 else None,
            service_ms=rng.uniform(500.0, 4000.0) if rng.random() > 0.1 else None,
            open_until=1e18 if rng.random() < 0.01 else 0.0,
        )
        fleet.index.setdefault((MODEL, family), []).append(node)
    return fleet


def measure(
    n_nodes: int,
    runs: int,
    cost_priority: str | None = "balanced",
    *,
    latency_target_ms: float | None = 500.0,
    busy: float = 0.6,
    seed: int = 0,
) -> dict[str, object]:
    """Time ``runs`` routing decisions on a fleet of ``n_nodes``; ``cost_priority=None`` means
    no policy. Returns median/p99/mean in ns, the budget, and how many decisions found a node."""
    fleet = build_fleet(n_nodes, seed=seed, busy=busy)
    policy = (
        None
        if cost_priority is None
        else BenchPolicy("bench", FAMILIES, latency_target_ms, cost_priority)
    )
    rng = random.Random(seed)
    now = 1000.0
    for _ in range(min(runs, 50)):  # warm up
        route(policy, MODEL, fleet, now=now, rng=rng)  # type: ignore[arg-type]
    samples: list[int] = []
    routed = 0
    clock = time.perf_counter_ns
    for _ in range(runs):
        t0 = clock()
        result = route(policy, MODEL, fleet, now=now, rng=rng)  # type: ignore[arg-type]
        samples.append(clock() - t0)
        routed += isinstance(result, Decision)
    samples.sort()
    return {
        "n_nodes": n_nodes,
        "cost_priority": cost_priority,
        "runs": runs,
        "median_ns": statistics.median(samples),
        "p99_ns": samples[min(len(samples) - 1, int(len(samples) * 0.99))],
        "mean_ns": statistics.fmean(samples),
        "budget_median_ns": BUDGET_NS.get(n_nodes),
        "routed": routed,
    }


def _fmt(ns: float) -> str:
    return f"{ns / 1000:9.1f} us"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=2000, help="decisions timed per size")
    args = parser.parse_args(argv)
    print(f"{'nodes':>6}  {'mode':<10} {'median':>12} {'p99':>12} {'budget':>12}  verdict")
    for n_nodes in (100, 10_000):
        runs = args.runs if n_nodes <= 100 else max(args.runs // 10, 50)
        for mode in ("cost", "latency", "balanced", None):
            r = measure(n_nodes, runs, mode)
            budget = r["budget_median_ns"]
            median = float(r["median_ns"])  # type: ignore[arg-type]
            p99 = float(r["p99_ns"])  # type: ignore[arg-type]
            verdict = "-" if budget is None else ("ok" if median <= budget else "OVER")  # type: ignore[operator]
            print(
                f"{n_nodes:>6}  {mode or 'no policy':<10} {_fmt(median)} {_fmt(p99)} "
                f"{_fmt(float(budget)) if budget else '':>12}  {verdict}"  # type: ignore[arg-type]
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
