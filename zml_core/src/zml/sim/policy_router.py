"""An interim replay router for ``--policy`` rows: ``zml.routing.route`` against the node models.

It calls the production routing function (pure, clock-free) on the replay fleet, with the
policy from the config, so a policy row shows zml's routing decisions. It does not run the
rest of the production attempt flow (client-side queueing with ``queue_on_saturation``,
reservations, probes): that arrives with the virtual-clock driver, which replaces this module.
A ``NoRoute`` becomes the request's ``final_error`` (``no_viable_node``). A trace row naming
a ``policy`` is routed under that policy of the config (``policy_not_found`` if none).
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from zml.policy import Policy
from zml.routing import NoRoute, route
from zml.sim.replay import Reject, ReplayFleet
from zml.sim.traces import Arrival

__all__ = ["PolicyRouter"]


class PolicyRouter:
    """Route each arrival under ``policy`` with ``zml.routing.route`` (see the module docs)."""

    def __init__(self, policy: Policy, policies: Mapping[str, Policy] | None = None,
                 seed: int = 0) -> None:
        self.policy = policy
        self.name: str = policy.name
        self._policies = dict(policies or {})
        self._rng = random.Random(seed)

    def __call__(self, arrival: Arrival, model: str, now: float, fleet: ReplayFleet,
                 exclude: frozenset[str]) -> str | Reject:
        policy = self.policy
        if arrival.policy is not None and arrival.policy != policy.name:
            named = self._policies.get(arrival.policy)
            if named is None:
                return Reject("policy_not_found")
            policy = named
        decision = route(policy, model, fleet, now=now, rng=self._rng, exclude=exclude)
        if isinstance(decision, NoRoute):
            return Reject(decision.final_error)
        return decision.node.id
