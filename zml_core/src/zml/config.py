"""Finding and reading ``zml.toml``: the fleet registry that policies are validated against.

Routing policy lives in configuration, so a mistake in it must surface when the file is read,
naming the file, the key and the bad value, rather than as a routing failure in production.

Discovery order: an explicit path (``Client(config=...)``) > the ``ZML_CONFIG`` environment
variable > ``./zml.toml``. The file has three kinds of table::

    [accelerators.H100]          # registers a family
    cost_per_hour = 4.0          # optional, USD per node-hour

    [[nodes]]
    id = "h100-a"
    family = "H100"
    url = "http://10.0.0.5:8000"
    models = ["meta-llama/llama-3-8b-instruct"]
    max_concurrency = 8          # slots
    max_queue = 0                # optional: requests zml may queue on the node beyond its slots
    kind = "vllm"                # optional: vllm | sglang | tgi | llamacpp | openai

    [policies.llama3-production] # the fields of zml.Policy
    accelerator_chain = ["H100", "MI300X"]

    [gateway]                    # optional: settings of `zml serve` (validated by zml.gateway)
    default_policy = "llama3-production"

The *active registry* is the one a :class:`zml.Policy` built without an explicit registry is
validated against: the registry of the most recently constructed client, or else the
discovered file. Fleet-source plugins add nodes and families to it.
"""

from __future__ import annotations

import difflib
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import PolicyConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

__all__ = [
    "AcceleratorConfig",
    "ConfigFile",
    "FaultConfig",
    "NodeConfig",
    "Registry",
    "SimConfig",
    "activate",
    "active_registry",
    "discover_path",
    "load_registry",
    "suggest",
]

NodeKind = Literal["vllm", "sglang", "tgi", "llamacpp", "openai"]
ENV_CONFIG = "ZML_CONFIG"
TABLES = ("accelerators", "nodes", "policies", "gateway")
"""The top-level tables of ``zml.toml``."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, defer_build=True)


class AcceleratorConfig(_Strict):
    """``[accelerators.NAME]``: one accelerator family."""

    cost_per_hour: float | None = Field(default=None, ge=0)
    """USD per node-hour; used by the default cost model and by ``cost_priority="balanced"``."""
    cost_per_1k_tokens: float | None = Field(default=None, ge=0)
    """USD per 1,000 tokens (prompt + completion); when set, the cost model uses it instead."""


class FaultConfig(_Strict):
    """``[nodes.sim.faults]``: faults the simulated node injects (ignored for real nodes)."""

    error_rate: float = Field(default=0.0, ge=0, le=1)
    error_status: int = Field(default=503, ge=400, le=599)
    retry_after_s: float | None = Field(default=None, ge=0)
    drop_rate: float = Field(default=0.0, ge=0, le=1)
    stall_s: float = Field(default=0.0, ge=0)
    malformed_rate: float = Field(default=0.0, ge=0, le=1)
    seed: int = 0


class SimConfig(_Strict):
    """``[nodes.sim]``: the latency profile of a simulated node (defaults per family)."""

    ttft_ms: float | None = Field(default=None, gt=0)
    tokens_per_s: float | None = Field(default=None, gt=0)
    queue_size: int = Field(default=64, ge=0)
    faults: FaultConfig = FaultConfig()


class NodeConfig(_Strict):
    """``[[nodes]]``: one serving node."""

    id: str = Field(min_length=1)
    family: str = Field(min_length=1)
    url: str
    models: tuple[str, ...] = Field(min_length=1)
    max_concurrency: int = Field(ge=1)
    max_queue: int = Field(default=0, ge=0)
    kind: NodeKind = "vllm"
    sim: SimConfig = SimConfig()

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"{value!r} is not an http(s) URL with a host; write e.g. 'http://127.0.0.1:8000'"
            )
        try:
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError:
            raise ValueError(f"{value!r} has an invalid port") from None
        return value.rstrip("/")

    @field_validator("models")
    @classmethod
    def _check_models(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not m for m in value):
            raise ValueError("model names must be non-empty strings")
        return value


class ConfigFile(_Strict):
    """The whole ``zml.toml``, as parsed (policies are validated separately, see policy.py)."""

    accelerators: dict[str, AcceleratorConfig] = {}
    nodes: tuple[NodeConfig, ...] = ()
    policies: dict[str, dict[str, Any]] = {}
    gateway: dict[str, Any] = {}


@dataclass(frozen=True)
class Registry:
    """The fleet registry: accelerator families, nodes and named policies (raw tables).

    Built from a ``zml.toml`` and from fleet-source plugins. ``source`` is the file it came from.
    ``gateway`` is the raw ``[gateway]`` table (validated by :mod:`zml.gateway` when served).
    """

    families: Mapping[str, AcceleratorConfig] = field(default_factory=dict)
    nodes: tuple[NodeConfig, ...] = ()
    policies: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    source: str | None = None
    gateway: Mapping[str, Any] = field(default_factory=dict)

    def node(self, node_id: str) -> NodeConfig:
        """The node with this id (KeyError when there is none)."""
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def with_additions(
        self,
        families: Mapping[str, AcceleratorConfig] | None = None,
        nodes: Iterable[NodeConfig] = (),
        *,
        origin: str = "a fleet source",
    ) -> Registry:
        """A registry with more families and nodes, validated like the file's own."""
        merged = dict(self.families)
        for name, acc in (families or {}).items():
            merged.setdefault(name, acc)
        all_nodes = (*self.nodes, *nodes)
        _check_nodes(all_nodes, merged, origin)
        return Registry(merged, all_nodes, self.policies, self.source, self.gateway)


def suggest(value: str, choices: Iterable[str]) -> str | None:
    """The closest of ``choices`` to ``value``, if one is close enough to be a likely typo."""
    matches = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    if not matches:
        lowered = {c.lower(): c for c in choices}
        return lowered.get(value.lower())
    return matches[0]


def discover_path(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The config file to use: explicit > ``$ZML_CONFIG`` > ``./zml.toml`` (None if none)."""
    if explicit is not None:
        path = Path(explicit)
        if not path.is_file():
            raise PolicyConfigError(
                f"config file {str(path)!r} does not exist; pass the path of a zml.toml",
                field="config",
                value=str(path),
            )
        return path
    env = os.environ.get(ENV_CONFIG)
    if env:
        path = Path(env)
        if not path.is_file():
            raise PolicyConfigError(
                f"{ENV_CONFIG}={env!r} does not name an existing file; fix or unset it",
                field=ENV_CONFIG,
                value=env,
            )
        return path
    local = Path("zml.toml")
    return local if local.is_file() else None


def load_registry(path: str | os.PathLike[str]) -> Registry:
    """Read and validate one ``zml.toml`` (policies are validated by :mod:`zml.policy`)."""
    source = str(path)
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise PolicyConfigError(f"cannot read {source}: {exc}", source=source) from None
    except tomllib.TOMLDecodeError as exc:
        raise PolicyConfigError(f"{source} is not valid TOML: {exc}", source=source) from None
    return registry_from_mapping(data, source=source)


def registry_from_mapping(data: Mapping[str, Any], *, source: str | None = None) -> Registry:
    """Validate an already-parsed configuration mapping into a :class:`Registry`."""
    where = source or "configuration"
    unknown = set(data) - set(TABLES)
    if unknown:
        key = sorted(unknown)[0]
        hint = suggest(key, TABLES)
        raise PolicyConfigError(
            f"{where}: unknown table [{key}]"
            + (f"; did you mean [{hint}]?" if hint else f"; expected {', '.join(TABLES)}"),
            field=key,
            value=key,
            suggestion=hint,
            source=source,
        )
    try:
        parsed = ConfigFile.model_validate(data)
    except ValidationError as exc:
        raise config_error_from_validation(exc, data, where, source) from None
    _check_nodes(parsed.nodes, parsed.accelerators, where)
    return Registry(dict(parsed.accelerators), parsed.nodes, dict(parsed.policies), source,
                    dict(parsed.gateway))


def _check_nodes(
    nodes: Iterable[NodeConfig], families: Mapping[str, AcceleratorConfig], where: str
) -> None:
    seen: set[str] = set()
    for i, node in enumerate(nodes):
        if node.id in seen:
            raise PolicyConfigError(
                f"{where}: nodes[{i}].id {node.id!r} is a duplicate; node ids must be unique",
                field=f"nodes[{i}].id",
                value=node.id,
            )
        seen.add(node.id)
        if node.family not in families:
            hint = suggest(node.family, families)
            known = ", ".join(sorted(families)) or "none"
            raise PolicyConfigError(
                f"{where}: nodes[{i}].family {node.family!r} is not a registered accelerator "
                f"family (registered: {known})"
                + (f"; did you mean {hint!r}?" if hint else f"; add [accelerators.{node.family}]"),
                field=f"nodes[{i}].family",
                value=node.family,
                suggestion=hint,
            )


def config_error_from_validation(
    exc: ValidationError, data: Any, where: str, source: str | None
) -> PolicyConfigError:
    """Turn pydantic's first error into a message naming the table/key and the bad value."""
    err = first_error(exc)
    loc = _format_loc(err["loc"], data)
    value = err.get("input")
    hint: str | None = None
    if err["type"] == "extra_forbidden" and err["loc"]:
        key = str(err["loc"][-1])
        model_fields = _fields_at(err["loc"][:-1])
        hint = suggest(key, model_fields) if model_fields else None
        msg = f"{where}: unknown key {loc}" + (f"; did you mean {hint!r}?" if hint else "")
    elif err["type"] == "missing":
        msg = f"{where}: {loc} is required"
        value = None
    else:
        msg = f"{where}: {loc} = {value!r}: {err['msg']}"
    return PolicyConfigError(msg, field=loc, value=value, suggestion=hint, source=source)


def first_error(exc: ValidationError) -> Any:
    """The error to report: an unknown key first (a typo also makes its real key "missing")."""
    errors = exc.errors(include_url=False)
    return next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])


def _format_loc(loc: tuple[int | str, ...], data: Any) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _fields_at(loc: tuple[int | str, ...]) -> list[str]:
    named = [p for p in loc if isinstance(p, str)]
    model: type[BaseModel] = ConfigFile
    table: dict[str, type[BaseModel]] = {
        "accelerators": AcceleratorConfig, "nodes": NodeConfig, "sim": SimConfig,
        "faults": FaultConfig,
    }
    for name in named:
        nxt = table.get(name)
        if nxt is not None:
            model = nxt
    return list(model.model_fields)


# --- the active registry -------------------------------------------------------------------

_lock = threading.Lock()
_activated: Registry | None = None
_discovered: tuple[tuple[str, float], Registry] | None = None

EMPTY_REGISTRY = Registry()


def activate(registry: Registry) -> None:
    """Make ``registry`` the one that ``zml.Policy(...)`` validates against (clients call this)."""
    global _activated
    with _lock:
        _activated = registry


def active_registry() -> Registry:
    """The registry of the most recent client, else the discovered config file, else empty."""
    global _discovered
    with _lock:
        if _activated is not None:
            return _activated
    path = discover_path()
    if path is None:
        return EMPTY_REGISTRY
    key = (str(path.resolve()), path.stat().st_mtime)
    with _lock:
        if _discovered is not None and _discovered[0] == key:
            return _discovered[1]
    registry = load_registry(path)
    with _lock:
        _discovered = (key, registry)
    return registry


def reset_active_registry() -> None:
    """Forget the activated and discovered registries (for tests and long-lived tools)."""
    global _activated, _discovered
    with _lock:
        _activated = None
        _discovered = None
