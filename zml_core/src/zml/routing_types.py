"""The vocabulary of routing: its constants, what it reads (views) and what it returns.

The rules that use them, and what every constant means, are in :mod:`zml.routing`; the
per-family reads are in :mod:`zml.routing_families`. Everything here is re-exported by
:mod:`zml.routing`, which is where users import it from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

__all__ = [
    "AFFINITY_LOAD_FACTOR",
    "BALANCED_SPAN",
    "CHARS_PER_TOKEN",
    "COST_LATENCY_MARGIN",
    "HIGH_WATER",
    "MAX_IDS_IN_RECOMMENDATION",
    "NEAR_BEST_MS",
    "NEAR_BEST_SHARE",
    "NO_VIABLE_NODE",
    "PRIOR_SERVICE_MS",
    "PRIOR_TTFT_MS",
    "REJECTION_REASONS",
    "SOFT_REASONS",
    "TIE_MS",
    "CostPriority",
    "Decision",
    "FamilyEvaluation",
    "FleetView",
    "NoRoute",
    "NodeView",
    "PolicyView",
    "RejectionReason",
]

PRIOR_TTFT_MS = 200.0
PRIOR_SERVICE_MS = 2000.0
COST_LATENCY_MARGIN = 1.25
HIGH_WATER = 0.8
BALANCED_SPAN = 0.2
TIE_MS = 1e-9
MAX_IDS_IN_RECOMMENDATION = 5
NEAR_BEST_SHARE = 0.25
NEAR_BEST_MS = 25.0
CHARS_PER_TOKEN = 4
AFFINITY_LOAD_FACTOR = 1.25

RejectionReason = Literal[
    "no_nodes_for_model",
    "health_score_below_threshold",
    "circuit_open",
    "all_nodes_over_capacity",
    "latency_target_exceeded",
    "excluded_after_failure",
]
REJECTION_REASONS: tuple[str, ...] = (
    "no_nodes_for_model",
    "health_score_below_threshold",
    "circuit_open",
    "all_nodes_over_capacity",
    "latency_target_exceeded",
    "excluded_after_failure",
)
SOFT_REASONS: tuple[str, ...] = ("above_high_water", "not_selected")

CostPriority = Literal["cost", "latency", "balanced"]

NO_VIABLE_NODE = "no_viable_node"

_INF = math.inf
_UTIL_ROUNDING = 1e-12  # 0.8 + 0.2 * 0.5 is 0.9000000000000001 in binary; U = 0.9 reaches it
_NO_NODES = "no_nodes_for_model"
_HEALTH = "health_score_below_threshold"
_CIRCUIT = "circuit_open"
_OVER = "all_nodes_over_capacity"
_LATENCY = "latency_target_exceeded"
_EXCLUDED = "excluded_after_failure"
_ABOVE_HIGH_WATER = "above_high_water"
_NOT_SELECTED = "not_selected"


class NodeView(Protocol):
    """What routing reads of one node (read-only)."""

    @property
    def id(self) -> str: ...
    @property
    def family(self) -> str: ...
    @property
    def max_concurrency(self) -> int:
        """Slots: requests the node runs at once (at least 1)."""

    @property
    def max_queue(self) -> int:
        """Requests zml may place in the node's own queue beyond its slots (at least 0)."""

    @property
    def load(self) -> int:
        """Requests on the node now, running and waiting (at least 0)."""

    @property
    def health(self) -> float:
        """Health score, 0..1."""

    @property
    def ttft_ms(self) -> float | None:
        """EWMA of observed time to first token; None until one is observed."""

    @property
    def service_ms(self) -> float | None:
        """EWMA of observed whole-request service time; None until one is observed."""

    def circuit_allows(self, now: float) -> bool:
        """False while the node's circuit breaker is open."""


class FleetView(Protocol):
    """What routing reads of the fleet registry."""

    def families(self) -> Sequence[str]:
        """Every family, in registry order."""

    def family_cost(self, family: str) -> float | None:
        """The family's cost_per_hour, None if not configured."""

    def nodes_for(self, model: str, family: str) -> Sequence[NodeView]:
        """The nodes of the family serving the model (pre-indexed, O(1)); empty if none."""


class PolicyView(Protocol):
    """What routing reads of a policy."""

    @property
    def name(self) -> str: ...
    @property
    def accelerator_chain(self) -> Sequence[str]: ...
    @property
    def latency_target_ms(self) -> float | None: ...
    @property
    def cost_priority(self) -> CostPriority: ...
    @property
    def health_threshold(self) -> float: ...


class FamilyEvaluation(NamedTuple):
    """One family looked at: how many of its nodes serve the model and why it was not chosen.

    (``FamilyEvaluation`` and ``Decision`` are NamedTuples: immutable, and several times
    cheaper to build than frozen dataclasses; one decision builds one to four of them.)
    """

    family: str
    nodes_checked: int
    rejected_reason: str | None

    def as_dict(self) -> dict[str, object]:
        """The evaluation as a plain dict (``routing.evaluated`` entries, telemetry events)."""
        return {
            "family": self.family,
            "nodes_checked": self.nodes_checked,
            "rejected_reason": self.rejected_reason,
        }


class Decision(NamedTuple):
    """A routing decision: the node to send to, and the trace that led to it."""

    node: NodeView
    family: str
    predicted_ttft_ms: float
    evaluated: tuple[FamilyEvaluation, ...]
    base_ttft_ms: float | None = None
    """The node's base TTFT the prediction started from (its ``ttft_ms`` or the family prior);
    ``predicted_ttft_ms - base_ttft_ms`` is the part the model explains (prefill, requests
    ahead), which the fleet takes out of the observed TTFT it learns from (module docs)."""


@dataclass(frozen=True, slots=True)
class NoRoute:
    """No node can take the request; ``context()`` is the RoutingError's routing_context."""

    policy: str | None
    evaluated: tuple[FamilyEvaluation, ...]
    final_error: str
    recommendation: str

    def context(self) -> dict[str, object]:
        """The RoutingError's ``routing_context``: policy, families evaluated, final error."""
        return {
            "policy": self.policy,
            "evaluated": [e.as_dict() for e in self.evaluated],
            "final_error": self.final_error,
            "recommendation": self.recommendation,
        }
