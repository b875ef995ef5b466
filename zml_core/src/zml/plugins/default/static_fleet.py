"""The built-in fleet source: the families and nodes of ``zml.toml`` (or of ``Client(config=)``).

Registered ``tryfirst``, so the file's families come first in the registry's order and win
over a fleet plugin that declares the same family.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from ...config import AcceleratorConfig, NodeConfig, Registry
from ..hookspecs import FleetSource, hookimpl

__all__ = ["StaticFleet", "zml_register_fleet_sources"]


class StaticFleet:
    """A fleet source over a registry's own families and nodes."""

    def __init__(self, config: Registry) -> None:
        self.config = config
        self.name: str = config.source or "zml.toml"

    def families(self) -> Mapping[str, AcceleratorConfig]:
        """The ``[accelerators.NAME]`` tables."""
        return self.config.families

    def nodes(self) -> Iterable[NodeConfig]:
        """The ``[[nodes]]`` tables."""
        return self.config.nodes


@hookimpl(tryfirst=True)
def zml_register_fleet_sources(
    register: Callable[[FleetSource], None], config: Registry
) -> None:
    """Register the configuration file's fleet."""
    register(StaticFleet(config))
