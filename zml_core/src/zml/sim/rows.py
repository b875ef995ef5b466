"""The rows of a replay: which routings to compare, each run on a fresh fleet.

A *policy* row is routed by zml itself: the virtual-clock driver (:mod:`zml.sim.virtual`) runs
every arrival through the production dispatcher, fleet and attempt flow. A *strategy* row is a
baseline of :mod:`zml.strategies` (round_robin, random, least_busy, latency_based) on the
replay engine (:func:`zml.sim.replay.replay`), which is what those peers do: pick a node,
send, and on a 503 try another. A policy of the config whose ``strategy`` field names a
baseline (when the policy schema has that field) is a policy row: the production core then
applies the strategy, so the same comparison can be made through zml's own flow.

Used by ``zml sim replay`` and ``benchmarks/routing_quality.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from zml.config import Registry
from zml.policy import Policy
from zml.sim.replay import ReplayFleet, ReplayRun, StrategyRouter, replay
from zml.sim.traces import Arrival
from zml.sim.virtual import replay_policy

__all__ = ["RowSpec", "default_slo_ms", "plan_rows", "run_row"]


@dataclass(frozen=True)
class RowSpec:
    """One row to replay: a policy (``policy`` set) or a baseline strategy (``strategy``)."""

    name: str
    kind: str
    """``"policy"`` or ``"strategy"``."""
    slo_ms: float | None
    policy: Policy | None = None
    strategy: str | None = None


def default_slo_ms(policies: Mapping[str, Policy], first: Sequence[str] = ()) -> float | None:
    """The first ``latency_target_ms`` among ``first`` then every policy (None: no target)."""
    for name in [*first, *policies]:
        target = policies[name].latency_target_ms
        if target is not None:
            return float(target)
    return None


def plan_rows(policies: Mapping[str, Policy], policy_names: Sequence[str],
              strategy_names: Sequence[str], slo_ms: float | None = None) -> list[RowSpec]:
    """The rows for these names (policies first), each with its TTFT target: the policy's
    ``latency_target_ms``, else ``slo_ms``, else :func:`default_slo_ms`."""
    fallback = slo_ms if slo_ms is not None else default_slo_ms(policies, policy_names)
    rows: list[RowSpec] = []
    for name in policy_names:
        target = policies[name].latency_target_ms
        rows.append(RowSpec(name, "policy", float(target) if target is not None else fallback,
                            policy=policies[name]))
    rows.extend(RowSpec(name, "strategy", fallback, strategy=name) for name in strategy_names)
    return rows


def run_row(spec: RowSpec, arrivals: Sequence[Arrival], registry: Registry,
            policies: Mapping[str, Policy], *, default_model: str, rate_scale: float = 1.0,
            seed: int = 0, progress: Callable[[int], None] | None = None) -> ReplayRun:
    """Replay ``arrivals`` for one row on a fresh fleet."""
    if spec.policy is not None:
        return replay_policy(arrivals, registry, policies, spec.policy, name=spec.name,
                             default_model=default_model, rate_scale=rate_scale,
                             slo_ms=spec.slo_ms, seed=seed, progress=progress)
    assert spec.strategy is not None
    return replay(arrivals, ReplayFleet(registry), StrategyRouter(spec.strategy, seed=seed),
                  name=spec.name, kind="strategy", default_model=default_model,
                  rate_scale=rate_scale, slo_ms=spec.slo_ms, progress=progress)
