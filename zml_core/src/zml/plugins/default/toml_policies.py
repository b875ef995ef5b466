"""The built-in policy source: the ``[policies.NAME]`` tables of ``zml.toml``.

The tables are validated when the client is built (a bad table fails ``Client(...)`` with the
file and the table in the message, as it always has), so lookups return ready Policy objects.
Registered ``trylast``: a policy-source plugin that defines the same name takes precedence.
"""

from __future__ import annotations

from collections.abc import Callable

from ...config import Registry
from ...policy import Policy, validate_policy_tables
from ..hookspecs import PolicySource, hookimpl

__all__ = ["TomlPolicies", "zml_register_policy_sources"]


class TomlPolicies:
    """A static policy source over a registry's validated policy tables."""

    def __init__(self, registry: Registry) -> None:
        self.name: str = registry.source or "zml.toml"
        self._policies = validate_policy_tables(registry)

    def get(self, name: str) -> Policy | None:
        """The policy of table ``[policies.NAME]``, or None."""
        return self._policies.get(name)

    def list(self) -> list[str]:
        """The table names, in file order."""
        return list(self._policies)


@hookimpl(trylast=True)
def zml_register_policy_sources(
    register: Callable[[PolicySource], None], registry: Registry
) -> None:
    """Register the configuration file's policy tables."""
    if registry.policies:
        register(TomlPolicies(registry))
