"""Routing quality: zml's policy against the four baseline strategies on two real traces.

    uv run --locked python benchmarks/routing_quality.py [--limit N] [--loads 0.5,0.8,1.0]

Both traces of ``benchmarks/traces/`` (Azure LLM inference 2023, conversation sample; Mooncake
conversation trace; see that folder's README for licenses and attribution) are replayed in
virtual time (``zml.sim.virtual``: the production dispatcher, fleet and attempt flow against
the node models) on the fleet of ``benchmarks/quality-fleet.toml`` (its comment lists the
families, costs, speeds and the profiles' sources), at three load levels, with these rows:

* ``zml``: the fleet's policy (chain L4 -> A100 -> MI300X -> H100, cheapest first, TTFT target
  500 ms, ``cost_priority = "balanced"``), routed by zml;
* ``round_robin``, ``random``, ``least_busy``, ``latency_based``: ``zml.strategies``;
* on Mooncake, ``zml+prefix``: the same policy with ``affinity = "prefix"`` — when the policy
  schema has that field; otherwise a note says it was skipped.

**Load levels.** Utilisation is offered load / modelled capacity. A node's capacity, in
requests per second for the trace's mean request (mean prompt ``P``, mean output ``O``), is the
lower of its prefill lane, ``prefill_tokens_per_s / P``, and its decode batch,
``n / (P / prefill_tokens_per_s + O x step(n))``, where ``n`` is the sequences it can run at once
(``max_concurrency``, or fewer when ``kv_cache_tokens / (P + O)`` is smaller) and ``step(n)``
is the model's decode step with ``n`` sequences, ``(1 + batch_slowdown x (n - 1)) /
tokens_per_s + context_ms_per_1k_tokens x n x (P + O / 2) / 1e6``. The fleet's capacity is the
sum over nodes; the trace's own rate is its requests over its duration; the rate scale for a
utilisation ``u`` is ``u x capacity / trace rate``. It is an estimate from means (bursts and
the size tail make the real saturation point lower), so "100%" is a heavy load, not an exact
knee.

The script prints the table per trace and load, then a summary block with lines such as::

    quality azure 80% slo zml=0.970 best_baseline=0.950 (least_busy) cost zml=12.30 rr=13.10 ...
    prefix mooncake 80% hit zml+prefix=0.41 lb=0.12 p99 zml+prefix=900 lb=1500 rr=2100

and, per line, whether the issue's bar is met (``ok`` / ``MISS``: SLO attainment at least every
baseline's and cost no higher than round_robin's and least_busy's; for prefix affinity, a hit
rate at least 2x least_busy's and a lower p99 TTFT than least_busy and round_robin). A row's
cost counts only completed requests, so a row that rejects requests looks cheap: read the cost
with ``completed``. Figures are not tuned: the fleet and traces are used as they are.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from zml.config import load_registry
from zml.errors import PolicyConfigError
from zml.policy import Policy, policy_from_mapping, validate_policy_tables
from zml.sim.from_config import node_profile
from zml.sim.report import rich_table, summarize
from zml.sim.rows import RowSpec, run_row
from zml.sim.traces import Arrival, read_trace
from zml.strategies import STRATEGIES

HERE = Path(__file__).parent
FLEET = HERE / "quality-fleet.toml"
TRACES = {"azure": HERE / "traces" / "azure-llm-2023-conv.csv",
          "mooncake": HERE / "traces" / "mooncake-conversation.jsonl"}
MODEL = "meta-llama/llama-3-8b-instruct"
POLICY = "zml"
SHORT = {"round_robin": "rr", "random": "random", "least_busy": "lb", "latency_based": "lat"}


def capacity_rps(registry: Any, arrivals: list[Arrival]) -> float:
    """The fleet's modelled capacity in requests/s for the trace's mean request (docs)."""
    p = sum(a.prompt_tokens for a in arrivals) / len(arrivals)
    o = sum(a.output_tokens for a in arrivals) / len(arrivals)
    total = 0.0
    for node in registry.nodes:
        prof = node_profile(node, registry.families.get(node.family))
        n = max(1, min(node.max_concurrency, int(prof.kv_cache_tokens // (p + o))))
        step = ((1 + prof.batch_slowdown * (n - 1)) / prof.tokens_per_s
                + prof.context_ms_per_1k_tokens * n * (p + o / 2) / 1e6)
        prefill_s = p / prof.prefill_tokens_per_s
        total += min(1.0 / prefill_s, n / (prefill_s + o * step))
    return total


def trace_rps(arrivals: list[Arrival]) -> float:
    span = arrivals[-1].arrival_s - arrivals[0].arrival_s
    return len(arrivals) / span if span > 0 else float(len(arrivals))


def prefix_policy(base: Policy, registry: Any) -> Policy | None:
    """``base`` with ``affinity = "prefix"``, or None when the policy schema has no such field."""
    data = base.model_dump(exclude_none=True, exclude_defaults=True)
    data.update(name=f"{base.name}+prefix", affinity="prefix")
    try:
        return policy_from_mapping(data, registry)
    except PolicyConfigError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, help="replay only the first N requests of each trace")
    ap.add_argument("--loads", default="0.5,0.8,1.0", help="utilisation levels (default "
                    "0.5,0.8,1.0)")
    ap.add_argument("--traces", default="azure,mooncake")
    args = ap.parse_args(argv)
    loads = [float(x) for x in args.loads.split(",")]
    console = Console(width=220)
    registry = load_registry(FLEET)
    policies = validate_policy_tables(registry)
    base = policies[POLICY]
    affinity = prefix_policy(base, registry)
    summary: list[str] = []
    started = time.perf_counter()
    for trace in args.traces.split(","):
        arrivals = list(read_trace(TRACES[trace], limit=args.limit))
        cap, rate = capacity_rps(registry, arrivals), trace_rps(arrivals)
        console.print(f"[bold]{trace}[/]: {len(arrivals):,} requests, {rate:.2f} req/s; "
                      f"modelled fleet capacity {cap:.2f} req/s for the mean request")
        specs = [RowSpec(POLICY, "policy", float(base.latency_target_ms or 500), policy=base)]
        if trace == "mooncake":
            if affinity is not None:
                specs.append(RowSpec(affinity.name, "policy", specs[0].slo_ms, policy=affinity))
            else:
                console.print("note: the policy schema has no `affinity` field yet; the "
                              "zml+prefix row is skipped")
        specs += [RowSpec(s, "strategy", specs[0].slo_ms, strategy=s) for s in STRATEGIES]
        for load in loads:
            scale = load * cap / rate
            t0 = time.perf_counter()
            rows = {}
            for spec in specs:
                pols = dict(policies)
                if spec.policy is not None:
                    pols[spec.policy.name] = spec.policy
                rows[spec.name] = summarize(run_row(spec, arrivals, registry, pols,
                                                    default_model=MODEL, rate_scale=scale))
            console.print(rich_table(list(rows.values()), title=(
                f"{trace} at {load:.0%} utilisation (rate x{scale:.2f}), "
                f"{time.perf_counter() - t0:.1f} s wall")))
            summary += summarize_load(trace, load, rows, affinity.name if affinity else None)
    console.print("\n[bold]summary[/] (slo = share of all requests with TTFT <= 500 ms; cost $)")
    for line in summary:
        print(line)
    print(f"total wall {time.perf_counter() - started:.1f} s")
    return 0


def summarize_load(trace: str, load: float, rows: dict[str, dict[str, Any]],
                   affinity: str | None) -> list[str]:
    z = rows[POLICY]
    baselines = {n: rows[n] for n in STRATEGIES}
    best = max(baselines, key=lambda n: baselines[n]["slo_attainment"] or 0.0)
    zslo, bslo = z["slo_attainment"] or 0.0, baselines[best]["slo_attainment"] or 0.0
    costs = " ".join(f"{SHORT[n]}={baselines[n]['cost_usd']:.2f}" for n in STRATEGIES)
    ok = zslo >= bslo and z["cost_usd"] <= rows["round_robin"]["cost_usd"] \
        and z["cost_usd"] <= rows["least_busy"]["cost_usd"]
    lines = [f"quality {trace} {load:.0%} slo zml={zslo:.3f} best_baseline={bslo:.3f} ({best}) "
             f"cost zml={z['cost_usd']:.2f} {costs} completed zml={z['completed']}/{z['requests']} "
             f"errors zml={sum(z['errors'].values())} -> {'ok' if ok else 'MISS'}"]
    if affinity is not None and affinity in rows:
        a, lb, rr = rows[affinity], rows["least_busy"], rows["round_robin"]

        def p99(r: dict[str, Any]) -> float:
            v = r["ttft_ms"]["p99"]
            return float("inf") if v is None else float(v)

        good = (a["prefix_cache_hit_rate"] >= 2 * lb["prefix_cache_hit_rate"]
                and p99(a) < p99(lb) and p99(a) < p99(rr))
        lines.append(
            f"prefix {trace} {load:.0%} hit {affinity}={a['prefix_cache_hit_rate']:.3f} "
            f"lb={lb['prefix_cache_hit_rate']:.3f} p99 {affinity}={p99(a):.0f} "
            f"lb={p99(lb):.0f} rr={p99(rr):.0f} slo {affinity}={a['slo_attainment']:.3f} "
            f"cost {affinity}={a['cost_usd']:.2f} -> {'ok' if good else 'MISS'}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
