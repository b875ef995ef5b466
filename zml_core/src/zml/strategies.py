"""Baseline routing strategies, as zml's peers describe them, to compare zml's routing against.

Each strategy picks one node among the candidates (every node serving the model, in registry
order) and, like the peers, ignores ``accelerator_chain`` order, latency targets and cost:

``round_robin``
    A Kubernetes Service in front of the pods (kube-proxy in IPVS mode, its default ``rr``
    scheduler): each request goes to the next candidate in turn.
``random``
    LiteLLM's ``simple-shuffle`` with no weights configured: a uniformly random candidate.
``least_busy``
    LiteLLM's ``least-busy``: the candidate with the fewest requests in flight from this
    router (ties: a random one among them).
``latency_based``
    LiteLLM's ``latency-based-routing``: the candidate with the lowest average observed
    latency (time to first token, as LiteLLM uses for streams), ``Candidate.latency_ms``; a
    candidate with no observation yet counts as 0 (so it is tried first); ties go to a random
    one (LiteLLM's default ``lowest_latency_buffer`` of 0). Which average depends on who
    observes: the replay engine's nodes (``zml.sim.replay``) keep the mean of the last
    ``LATENCY_WINDOW`` (10) TTFTs, as LiteLLM does; a live client's fleet gives its moving
    average (``NodeState.observed_ttft_ms``: an EWMA, weight ``zml.fleet.EWMA_ALPHA`` = 0.2,
    of streamed calls' TTFTs).

A strategy is a pure function ``(candidates, state, rng) -> index``: it reads only what it is
given, keeps its memory in the caller-owned :class:`StrategyState` and draws randomness only
from ``rng``. ``STRATEGIES`` maps each name to its function. Capacity is not checked: a node
that is full answers 503 and the caller's retry logic decides what happens next.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence, Set as AbstractSet
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from .routing import Decision, FamilyEvaluation, NoRoute

__all__ = [
    "LATENCY_WINDOW",
    "STRATEGIES",
    "Candidate",
    "Strategy",
    "StrategyState",
    "latency_based",
    "least_busy",
    "random_choice",
    "round_robin",
    "route_by_strategy",
]

LATENCY_WINDOW = 10
"""Observed latencies a node's average is taken over (LiteLLM's ``max_latency_list_size``)."""


class Candidate(Protocol):
    """What a strategy reads of one node."""

    @property
    def id(self) -> str: ...
    @property
    def in_flight(self) -> int:
        """Requests this router has sent to the node that have not ended."""

    @property
    def latency_ms(self) -> float | None:
        """The node's average observed TTFT (the replay's mean of the last
        ``LATENCY_WINDOW``, a live fleet's EWMA: see ``latency_based``); None if none."""


@dataclass
class StrategyState:
    """A strategy's memory between requests, owned by the caller (one per router)."""

    cursor: int = 0
    """round_robin: how many requests it has placed."""


Strategy = Callable[[Sequence[Candidate], StrategyState, random.Random], int]
"""``(candidates, state, rng) -> index of the chosen candidate`` (candidates non-empty)."""


def _check(candidates: Sequence[Candidate]) -> int:
    n = len(candidates)
    if n == 0:
        raise ValueError("a strategy needs at least one candidate")
    return n


def round_robin(candidates: Sequence[Candidate], state: StrategyState, rng: random.Random) -> int:
    """The next candidate in turn (a Kubernetes Service, IPVS ``rr``)."""
    n = _check(candidates)
    index = state.cursor % n
    state.cursor += 1
    return index


def random_choice(candidates: Sequence[Candidate], state: StrategyState, rng: random.Random) -> int:
    """A uniformly random candidate (LiteLLM ``simple-shuffle`` without weights)."""
    return rng.randrange(_check(candidates))


def _lowest(values: Sequence[float], rng: random.Random) -> int:
    best = min(values)
    ties = [i for i, v in enumerate(values) if v == best]
    return ties[0] if len(ties) == 1 else ties[rng.randrange(len(ties))]


def least_busy(candidates: Sequence[Candidate], state: StrategyState, rng: random.Random) -> int:
    """The candidate with the fewest requests in flight (LiteLLM ``least-busy``)."""
    _check(candidates)
    return _lowest([float(c.in_flight) for c in candidates], rng)


def latency_based(candidates: Sequence[Candidate], state: StrategyState, rng: random.Random) -> int:
    """The candidate with the lowest recent average latency, unobserved ones first (LiteLLM
    ``latency-based-routing``)."""
    _check(candidates)
    values = [0.0 if c.latency_ms is None else c.latency_ms for c in candidates]
    return _lowest(values, rng)


STRATEGIES: Mapping[str, Strategy] = MappingProxyType({
    "round_robin": round_robin,
    "random": random_choice,
    "least_busy": least_busy,
    "latency_based": latency_based,
})
"""Every baseline strategy by name."""


def route_by_strategy(
    name: str,
    model: str,
    fleet: Any,
    state: StrategyState,
    rng: random.Random,
    *,
    pinned_family: str | None = None,
    exclude: AbstractSet[str] = frozenset(),
) -> Decision | NoRoute:
    """A policy's ``strategy = NAME`` as a routing decision (used by ``Effects.reserve``).

    The candidates are every node of ``fleet`` serving ``model`` (``fleet.serving(model)``,
    registry order; only ``pinned_family``'s when one is given) except those in ``exclude``
    (already tried for this request); the strategy picks one of them. As with the peers, the
    chain order, latency targets, cost, health and capacity are not looked at (a full node
    answers 503 and the attempt flow retries elsewhere). The decision's trace has the chosen
    family only; ``predicted_ttft_ms`` is the node's observed TTFT (0 when unobserved). With no
    candidate the result is a ``NoRoute`` (``no_viable_node``) whose trace lists every family
    of the fleet with ``no_nodes_for_model`` or ``excluded_after_failure``.
    """
    choose = STRATEGIES[name]
    families: Sequence[str] = (
        (pinned_family,) if pinned_family is not None else fleet.families()
    )
    pool: Sequence[Any]
    if pinned_family is not None:
        pool = fleet.nodes_for(model, pinned_family)
    else:
        pool = fleet.serving(model)
    candidates = [n for n in pool if n.id not in exclude] if exclude else list(pool)
    if not candidates:
        evaluated = tuple(
            FamilyEvaluation(
                f,
                len(fleet.nodes_for(model, f)),
                "excluded_after_failure" if fleet.nodes_for(model, f) else "no_nodes_for_model",
            )
            for f in families
        )
        hint = (
            "every candidate node failed for this request; see the attempts"
            if pool
            else f"register nodes serving {model} in the fleet's families"
        )
        return NoRoute(name, evaluated, "no_viable_node", hint)
    node = candidates[choose(candidates, state, rng)]
    family = node.family
    latency = node.latency_ms
    predicted = latency if latency is not None else 0.0
    checked = len(fleet.nodes_for(model, family))
    return Decision(node, family, predicted, (FamilyEvaluation(family, checked, None),))
