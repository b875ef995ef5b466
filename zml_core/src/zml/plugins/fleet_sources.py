"""A client's fleet registry: ``zml.toml``'s configuration merged with every fleet source.

The built-in static fleet (``zml.toml``'s families and nodes) is a fleet source like any
other, so the registry starts empty of families and nodes (it keeps the file's policy tables
and name) and each source adds to it through :meth:`zml.config.Registry.with_additions`, which
validates nodes as the file's own are (unique ids, registered families).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from pydantic import ValidationError

from ..config import (
    AcceleratorConfig,
    NodeConfig,
    Registry,
    config_error_from_validation,
    discovered_registry,
)
from ..errors import PolicyConfigError
from .policy_sources import plugin_failure, source_name

if TYPE_CHECKING:
    from ..fleet import Fleet
    from ..ledger import SlotLedger
    from .hookspecs import FleetSource
    from .manager import PluginManager

__all__ = ["build_registry", "collect_fleet_sources", "default_registry", "slot_ledger"]


def collect_fleet_sources(pm: PluginManager, config: Registry) -> list[FleetSource]:
    """Call ``zml_register_fleet_sources`` and return the sources, in registration order."""
    sources: list[FleetSource] = []

    def register(source: FleetSource) -> None:
        if not callable(getattr(source, "families", None)) or not callable(
            getattr(source, "nodes", None)
        ):
            raise PolicyConfigError(
                f"a fleet source needs families() and nodes() methods, got "
                f"{type(source).__name__}: fix the plugin that registers it",
                field="nodes",
                source=source_name(source),
            )
        if not any(s is source for s in sources):
            sources.append(source)

    arguments = {"register": register, "config": config}
    for impl in pm.impls("zml_register_fleet_sources"):  # in call order, as pluggy calls
        if impl.wrapper or impl.hookwrapper:
            continue  # (one implementation at a time: there is no inner call to wrap)
        try:
            impl.function(*[arguments[name] for name in impl.argnames])
        except PolicyConfigError:
            raise
        except Exception as exc:
            raise plugin_failure(f"plugin {impl.plugin_name!r}'s zml_register_fleet_sources",
                                 exc, "nodes") from exc
    return sources


def build_registry(pm: PluginManager, config: Registry) -> Registry:
    """The client's registry: ``config``'s policy tables, plus the fleet sources' families and
    nodes, merged in order (raises PolicyConfigError naming the source on a bad entry)."""
    registry = Registry({}, (), config.policies, config.source, config.gateway)
    for source in collect_fleet_sources(pm, config):
        where = f"fleet source {source_name(source)!r}"
        try:
            listed_families = dict(source.families())
            listed_nodes = list(source.nodes())
        except PolicyConfigError:
            raise
        except Exception as exc:  # an inventory that is down: the client cannot know its fleet
            raise plugin_failure(where, exc, "nodes") from exc
        families = {
            str(name): _accelerator(acc, f"{where}: accelerators.{name}")
            for name, acc in listed_families.items()
        }
        nodes = [_node(node, f"{where}: nodes[{i}]") for i, node in enumerate(listed_nodes)]
        registry = registry.with_additions(families, nodes, origin=where)
    pm.fleet_read = True
    return registry


_default_cache: list[tuple[Registry, int, Registry]] = []
"""At most one entry: (the file's registry, the plugin generation, the registry built from
them). The file's registry itself is held and compared by identity: a key of its ``id()``
could be matched by a later file version's registry made at the same address."""


def default_registry() -> Registry:
    """The registry ``zml.Policy(...)`` is validated against: the discovered config file
    (``$ZML_CONFIG``, else ``./zml.toml``) plus the process's fleet-source plugins.

    A pure cache keyed by the file's registry and the plugin set's generation: rebuilt when
    the file changes or a plugin is registered.
    """
    from .manager import process_manager

    file_registry = discovered_registry()
    pm = process_manager()
    generation = pm.generation
    for source, built_at, cached in tuple(_default_cache):
        if source is file_registry and built_at == generation:
            return cached
    registry = build_registry(pm.copy(), file_registry)
    _default_cache[:] = [(file_registry, generation, registry)]
    return registry


def _accelerator(value: AcceleratorConfig | Mapping[str, Any], where: str) -> AcceleratorConfig:
    if isinstance(value, AcceleratorConfig):
        return value
    try:
        return AcceleratorConfig.model_validate(value)
    except ValidationError as exc:
        raise config_error_from_validation(exc, value, where, None) from None


def _node(value: NodeConfig | Mapping[str, Any], where: str) -> NodeConfig:
    if isinstance(value, NodeConfig):
        return value
    if not isinstance(value, Mapping):
        raise PolicyConfigError(
            f"{where}: a node must be a NodeConfig or a mapping of its fields, got "
            f"{type(value).__name__}",
            field="nodes",
            value=value,
        )
    try:
        return NodeConfig.model_validate(value)
    except ValidationError as exc:
        raise config_error_from_validation(exc, value, where, None) from None


def slot_ledger(pm: PluginManager, fleet: Fleet, registry: Registry) -> SlotLedger | None:
    """Ask each ``zml_slot_ledger`` implementation, in call order, for a client's ledger: the
    first one that returns one wins. An implementation that raises is reported (naming its
    plugin) and skipped, so another plugin's ledger is still used; with none, the client keeps
    local state.

    Raises:
        PolicyConfigError: an implementation returned something that is not a ledger (naming
            its plugin).
    """
    arguments = {"fleet": fleet, "registry": registry}
    for impl in pm.impls("zml_slot_ledger"):
        if impl.wrapper or impl.hookwrapper:
            continue  # (one implementation at a time: there is no inner call to wrap)
        try:
            result = impl.function(*[arguments[name] for name in impl.argnames])
        except Exception as exc:
            pm.report(impl.plugin_name, "zml_slot_ledger (the client counts slots in this "
                      "process only, unless another plugin gives a ledger)", exc)
            continue
        if result is None:
            continue
        missing = [m for m in ("acquire", "aacquire", "release")
                   if not callable(getattr(result, m, None))]
        if missing:
            raise PolicyConfigError(
                f"plugin {impl.plugin_name!r} returned a {type(result).__name__} from "
                f"zml_slot_ledger, which is not a zml.ledger.SlotLedger (no "
                f"{', '.join(missing)} method): fix the plugin, or unregister it",
                field="zml_slot_ledger")
        return cast("SlotLedger", result)
    return None
