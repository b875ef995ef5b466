"""The simulated fleet a ``zml.toml`` describes: one SimNodeSpec per loopback ``[[nodes]]``.

``zml sim serve CONFIG``, ``zml demo`` and the end-to-end tests all start simulated nodes from
a configuration, so that the client and the fleet it talks to are described once.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from zml.config import AcceleratorConfig, NodeConfig, Registry
from zml.sim.profiles import FamilyProfile, profile_for
from zml.sim.spec import FaultSpec, SimNodeSpec

__all__ = ["LOOPBACK_HOSTS", "is_loopback", "node_profile", "spec_from_node", "specs_from_registry"]

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def is_loopback(url: str) -> bool:
    """Whether ``url`` points at this machine's loopback interface."""
    host = urlsplit(url).hostname or ""
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def node_profile(node: NodeConfig, family: AcceleratorConfig | None = None) -> FamilyProfile:
    """A configured node's performance profile: the family's built-in profile, then its
    ``[accelerators.NAME.sim]`` table, then the node's ``[nodes.sim]`` table."""
    profile = profile_for(node.family)
    if family is not None:
        profile = profile.with_overrides(family.sim)
    return profile.with_overrides(node.sim)


def spec_from_node(
    node: NodeConfig, api_key: str | None = None, family: AcceleratorConfig | None = None
) -> SimNodeSpec:
    """The simulated twin of one configured node (``[nodes.sim]`` over ``[accelerators.X.sim]``
    over the family's built-in profile)."""
    sim = node.sim
    f = sim.faults
    return SimNodeSpec(
        id=node.id,
        family=node.family,
        models=tuple(node.models),
        max_concurrency=node.max_concurrency,
        queue_size=sim.queue_size,
        profile_overrides=node_profile(node, family),
        faults=FaultSpec(
            error_rate=f.error_rate,
            error_status=f.error_status,
            retry_after_s=f.retry_after_s,
            drop_rate=f.drop_rate,
            stall_s=f.stall_s,
            malformed_rate=f.malformed_rate,
            seed=f.seed,
        ),
        kind=node.kind,
        api_key=api_key,
    )


def specs_from_registry(
    registry: Registry, api_key: str | None = None
) -> tuple[list[SimNodeSpec], dict[str, int]]:
    """Specs for every loopback node of ``registry``, and the port each must listen on."""
    specs: list[SimNodeSpec] = []
    ports: dict[str, int] = {}
    for node in registry.nodes:
        if not is_loopback(node.url):
            continue
        specs.append(spec_from_node(node, api_key, registry.families.get(node.family)))
        port = urlsplit(node.url).port
        if port is not None:
            ports[node.id] = port
    return specs, ports
