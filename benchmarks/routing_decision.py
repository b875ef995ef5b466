"""Routing decision time: ``zml.routing.route`` at 100 and 10,000 nodes.

Targets (issue 14): median <= 10 us at 100 nodes and <= 100 us at 10,000 nodes (3 families),
the every-family-full worst case included. Decisions read the routing index
(``zml.routing_index.FamilyIndex``, what ``zml.fleet.Fleet`` keeps per (model, family)), as in
production; ``--scan`` times the same decisions on the fleet without its index.

The fleet is made of small slotted dataclasses shaped like fleet.py's node state: 3 families,
8/16/32 slots per node with as much queue room, random loads (uniform in [0, 1.2 x slots] by
default, i.e. about 60% utilisation), observed latencies on most nodes, ~2% unhealthy and ~1%
circuit-open nodes. Each row times ``runs`` decisions with ``time.perf_counter_ns`` and prints
min, median and p99. The "every family" rows use a saturated fleet (~95% utilisation) under
``"latency"``: every family is above high water, so every node of the fleet is scanned; it is
the worst case, printed for information next to the budget.

Run: ``uv run python benchmarks/routing_decision.py [--runs N] [--scan]``. After the table it
prints three lines in a fixed format (``routing p50 100 nodes: N us``, ``routing p50 10000
nodes: N us``, ``routing worst 10000 nodes: N us``; the worst being the every-family case).
Exits 0: the numbers are for reading (and for the overhead benchmark, which imports
``measure``), not a gate.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from zml.routing import Decision, route
from zml.routing_index import FamilyIndex

FAMILIES = ("H100", "MI300X", "H100_PCIe")
COSTS = {"H100": 2.5, "MI300X": 3.0, "H100_PCIe": 1.8}
MODEL = "meta-llama/llama-3-8b-instruct"
BUDGET_NS = {100: 10_000, 10_000: 100_000}

CostPriority = Literal["cost", "latency", "balanced"]
PRIOR = (10.0, 27712.0)  # zml.fleet.FAMILY_PRIORS["H100"]


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
    open_until: float | None = None

    def circuit_allows(self, now: float) -> bool:
        return self.open_until is None or now >= self.open_until


@dataclass(slots=True)
class BenchFleet:
    index: dict[tuple[str, str], list[BenchNode]] = field(default_factory=dict)
    indexes: dict[tuple[str, str], FamilyIndex] = field(default_factory=dict)
    use_index: bool = True

    def families(self) -> Sequence[str]:
        return FAMILIES

    def family_cost(self, family: str) -> float | None:
        return COSTS.get(family)

    def nodes_for(self, model: str, family: str) -> Sequence[BenchNode]:
        return self.index.get((model, family), ())

    def family_prior(self, family: str) -> tuple[float, float | None]:
        return PRIOR

    def family_index(self, model: str, family: str) -> FamilyIndex | None:
        return self.indexes.get((model, family)) if self.use_index else None


@dataclass(frozen=True, slots=True)
class BenchPolicy:
    name: str
    accelerator_chain: tuple[str, ...]
    latency_target_ms: float | None
    cost_priority: CostPriority
    health_threshold: float = 0.5


def build_fleet(
    n_nodes: int, seed: int = 0, busy: float = 0.6, *, index: bool = True
) -> BenchFleet:
    """n_nodes spread over 3 families; each load uniform in [0, 2 x busy x slots]; with
    ``index`` the fleet carries a routing index per family, as zml.fleet.Fleet does."""
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
            open_until=1e18 if rng.random() < 0.01 else None,
        )
        fleet.index.setdefault((MODEL, family), []).append(node)
    fleet.use_index = index
    if index:
        for key, nodes in fleet.index.items():
            fleet.indexes[key] = FamilyIndex(nodes, *PRIOR)
    return fleet


def measure(
    n_nodes: int,
    runs: int,
    cost_priority: CostPriority | None = "balanced",
    *,
    latency_target_ms: float | None = 500.0,
    busy: float = 0.6,
    seed: int = 0,
    index: bool = True,
    prompt_tokens: int = 500,
) -> dict[str, object]:
    """Time ``runs`` routing decisions on a fleet of ``n_nodes`` (``cost_priority=None``: no
    policy). Returns min/median/p99/mean in ns, the median budget for that size (None if the
    design sets none), the families walked by the last decision, and how many found a node."""
    fleet = build_fleet(n_nodes, seed=seed, busy=busy, index=index)
    policy = (
        None
        if cost_priority is None
        else BenchPolicy("bench", FAMILIES, latency_target_ms, cost_priority)
    )
    rng = random.Random(seed)
    now = 1000.0
    for _ in range(min(runs, 50)):  # warm up (and let the interpreter specialise)
        route(policy, MODEL, fleet, now=now, rng=rng, prompt_tokens=prompt_tokens)
    samples: list[int] = []
    routed = 0
    clock = time.perf_counter_ns
    result = None
    for _ in range(runs):
        t0 = clock()
        result = route(policy, MODEL, fleet, now=now, rng=rng, prompt_tokens=prompt_tokens)
        samples.append(clock() - t0)
        routed += isinstance(result, Decision)
    samples.sort()
    return {
        "n_nodes": n_nodes,
        "cost_priority": cost_priority,
        "busy": busy,
        "runs": runs,
        "min_ns": samples[0],
        "median_ns": statistics.median(samples),
        "p99_ns": samples[min(len(samples) - 1, int(len(samples) * 0.99))],
        "mean_ns": statistics.fmean(samples),
        "budget_median_ns": BUDGET_NS.get(n_nodes),
        "families_walked": 0 if result is None else len(result.evaluated),
        "routed": routed,
    }


def _us(ns: object) -> str:
    return f"{float(ns) / 1000:10.1f}" if isinstance(ns, (int, float)) else f"{'-':>10}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time zml.routing.route decisions.")
    parser.add_argument("--runs", type=int, default=3000, help="decisions timed at 100 nodes")
    parser.add_argument("--scan", action="store_true", help="time the scan (no routing index)")
    args = parser.parse_args(argv)
    summary: dict[str, float] = {}
    rows: list[tuple[int, CostPriority | None, float, str]] = []
    for n_nodes in (100, 10_000):
        for mode in ("cost", "latency", "balanced", None):
            rows.append((n_nodes, mode, 0.6, mode or "no policy"))
        rows.append((n_nodes, "latency", 0.95, "every family"))
    print(
        f"{'nodes':>6}  {'case':<13}{'walked':>7} {'min us':>10} {'median us':>10} "
        f"{'p99 us':>10} {'budget us':>10}  median"
    )
    for n_nodes, mode, busy, label in rows:
        runs = args.runs if n_nodes <= 100 else max(args.runs // 15, 50)
        r = measure(n_nodes, runs, mode, busy=busy, index=not args.scan)
        budget = r["budget_median_ns"]
        median = r["median_ns"]
        assert isinstance(median, (int, float)) and isinstance(budget, int)
        verdict = "within" if median <= budget else "OVER"
        print(
            f"{n_nodes:>6}  {label:<13}{r['families_walked']:>7} {_us(r['min_ns'])} "
            f"{_us(median)} {_us(r['p99_ns'])} {_us(budget)}  {verdict}"
        )
        if mode == "balanced" and busy == 0.6:
            summary[f"p50 {n_nodes} nodes"] = median / 1000
        if label == "every family" and n_nodes == 10_000:
            summary["worst 10000 nodes"] = median / 1000
    print()
    for key in ("p50 100 nodes", "p50 10000 nodes", "worst 10000 nodes"):
        print(f"routing {key}: {summary[key]:.0f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
