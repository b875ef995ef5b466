"""Finding and reading ``zml.toml``: the fleet registry that policies are validated against.

Routing policy lives in configuration, so a mistake in it must surface when the file is read,
naming the file, the key and the bad value, rather than as a routing failure in production.

Discovery order: an explicit path (``Client(config=...)``) > the ``ZML_CONFIG`` environment
variable > ``./zml.toml``; an explicit path or ``ZML_CONFIG`` must name a regular file. The
file is UTF-8 TOML, every number in it finite. It has these tables::

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

The *default registry* is the one ``zml.Policy(...)`` is validated against: the discovered
file (``$ZML_CONFIG``, else ``./zml.toml``) plus the fleet-source plugins, re-read when the
file changes (:func:`zml.plugins.fleet_sources.default_registry`). Each client validates the
policies it is given against its own registry as well; no client changes what another sees.
"""

from __future__ import annotations

import os
import re
import stat
import sys
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import PolicyConfigError
from .node_urls import display_url, url_problem
from .validation import name_problem

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
    "SimProfileConfig",
    "discover_path",
    "discovered_registry",
    "load_registry",
    "node_api_key",
    "read_config_file",
    "suggest",
]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_NAME_KEYS = frozenset({"api_key_env", "api_keys_env"})
"""Keys that name an environment variable holding a key: a value that is no variable's name
may be the key itself, pasted in, and is never shown."""
NOT_SHOWN = "<not shown>"
"""What :func:`without_secrets` puts in place of a value that may be a key."""
NodeKind = Literal["vllm", "sglang", "tgi", "llamacpp", "openai"]
ENV_CONFIG = "ZML_CONFIG"
TABLES = ("accelerators", "nodes", "policies", "gateway")
"""The top-level tables of ``zml.toml``."""


class _Strict(BaseModel):
    """Base of the configuration tables: unknown keys are refused, values frozen, and every
    number finite (``inf`` is refused like ``nan``)."""

    model_config: ClassVar[ConfigDict] = ConfigDict(
        extra="forbid", frozen=True, defer_build=True, allow_inf_nan=False
    )


class SimProfileConfig(_Strict):
    """``[accelerators.NAME.sim]``: the family's simulated performance (zml.sim.profiles).

    Every field left unset keeps the built-in profile of the family; ``[nodes.sim]`` takes the
    same fields for one node and wins over the family's.
    """

    ttft_ms: float | None = Field(default=None, strict=True, gt=0)
    tokens_per_s: float | None = Field(default=None, strict=True, gt=0)
    prefill_tokens_per_s: float | None = Field(default=None, strict=True, gt=0)
    batch_slowdown: float | None = Field(default=None, strict=True, ge=0)
    context_ms_per_1k_tokens: float | None = Field(default=None, strict=True, ge=0)
    kv_cache_tokens: int | None = Field(default=None, strict=True, ge=1)


class AcceleratorConfig(_Strict):
    """``[accelerators.NAME]``: one accelerator family."""

    cost_per_hour: float | None = Field(default=None, strict=True, ge=0)
    """USD per node-hour; used by the default cost model and by ``cost_priority="balanced"``."""
    cost_per_1k_tokens: float | None = Field(default=None, strict=True, ge=0)
    """USD per 1,000 tokens (prompt + completion); when set, the cost model uses it instead."""
    sim: SimProfileConfig = Field(default_factory=SimProfileConfig.model_construct)
    """The family's simulated performance (used by simulated nodes and replay only)."""


class FaultConfig(_Strict):
    """``[nodes.sim.faults]``: faults the simulated node injects (ignored for real nodes)."""

    error_rate: float = Field(default=0.0, strict=True, ge=0, le=1)
    error_status: int = Field(default=503, strict=True, ge=400, le=599)
    retry_after_s: float | None = Field(default=None, strict=True, ge=0)
    drop_rate: float = Field(default=0.0, strict=True, ge=0, le=1)
    stall_s: float = Field(default=0.0, strict=True, ge=0)
    malformed_rate: float = Field(default=0.0, strict=True, ge=0, le=1)
    seed: int = Field(default=0, strict=True)


class SimConfig(SimProfileConfig):
    """``[nodes.sim]``: the performance profile of a simulated node (defaults per family), the
    fields of ``[accelerators.NAME.sim]`` plus the node's queue and faults."""

    queue_size: int = Field(default=64, strict=True, ge=0)
    faults: FaultConfig = Field(default_factory=FaultConfig.model_construct)


class NodeConfig(_Strict):
    """``[[nodes]]``: one serving node.

    A node's ``url`` may not carry credentials (``http://user:pass@host``): zml sends a key
    only as a Bearer token, from ``api_key_env`` (this node's own) or the client's ``api_key``.
    Nor may it hold an ``@`` anywhere else (write ``%40`` in a path), so that a password whose
    ``#``, ``?`` or ``/`` ends the URL's authority early can never pass as a path, nor be shown.
    """

    id: str = Field(min_length=1)
    family: str = Field(min_length=1)
    url: str
    models: tuple[str, ...] = Field(min_length=1)
    max_concurrency: int = Field(ge=1, strict=True)
    max_queue: int = Field(default=0, ge=0, strict=True)
    kind: NodeKind = "vllm"
    api_key_env: str | None = None
    """The environment variable holding this node's API key (read when a client is built)."""
    sim: SimConfig = Field(default_factory=SimConfig.model_construct)

    @model_validator(mode="before")
    @classmethod
    def _no_secrets_in_url(cls, data: Any) -> Any:
        # Raised as PolicyConfigError, not ValueError, so that pydantic does not copy the URL
        # (and its password) into the error as the bad "input".
        if isinstance(data, Mapping):
            url = data.get("url")
            if isinstance(url, bytes | bytearray | memoryview):
                # (pydantic would take bytes as a str, credentials and all; not shown)
                who = f"node {data.get('id')!r}" if data.get("id") is not None else "a node"
                raise PolicyConfigError(
                    f"{who}: url must be a string (\"http://host:port\"), got "
                    f"{type(url).__name__} (not shown)", field="url")
            if isinstance(url, str):
                url_problem(url, data.get("id"))
        return data

    @field_validator("url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        shown = display_url(value)
        try:
            parts = urlsplit(value)
        except ValueError:
            raise ValueError(f"{shown!r} is not a valid URL") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"{shown!r} is not an http(s) URL with a host; write e.g. 'http://127.0.0.1:8000'"
            )
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"{shown!r} has an invalid port") from None
        if port == 0:  # a listener's "any free port", not a port anything can be reached on
            raise ValueError(f"{shown!r} has port 0, which no node listens on; write the "
                             "node's port (1-65535)")
        return value.rstrip("/")

    @field_validator("api_key_env")
    @classmethod
    def _check_api_key_env(cls, value: str | None) -> str | None:
        problem = None if value is None else env_name_problem(value)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("models")
    @classmethod
    def _check_models(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not m for m in value):
            raise ValueError("model names must be non-empty strings")
        for model in value:
            _check_name(model)
        return value

    @field_validator("id", "family")
    @classmethod
    def _check_names(cls, value: str) -> str:
        return _check_name(value)


def _check_name(value: str) -> str:
    """``value``, if it can be a name (see :func:`zml.validation.name_problem`)."""
    problem = name_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def node_api_key(
    node: NodeConfig, environ: Mapping[str, str] | None = None
) -> str | None:
    """The API key of ``node`` from its ``api_key_env`` variable (None when it has none).

    Called when a client is built. The key is checked like ``api_key``: visible ASCII only.

    Raises:
        PolicyConfigError: ``api_key_env`` names a variable that is unset or empty.
        InvalidRequestError: the key cannot be sent in a header (the message names the
            variable, never the key).
    """
    from .validation import check_api_key

    if node.api_key_env is None:
        return None
    env = os.environ if environ is None else environ
    value = env.get(node.api_key_env)
    if not value:
        raise PolicyConfigError(
            f"node {node.id!r} has api_key_env = {node.api_key_env!r}, but the environment "
            f"variable {node.api_key_env} is {'empty' if value == '' else 'not set'}; set it to "
            "the node's API key, or remove api_key_env to use the client's api_key",
            field="api_key_env",
            value=node.api_key_env,
        )
    return check_api_key(value, param=f"${node.api_key_env} (api_key_env of node {node.id!r})")


class ConfigFile(_Strict):
    """The whole ``zml.toml``, as parsed (policies are validated separately, see policy.py)."""

    accelerators: dict[str, AcceleratorConfig] = {}
    nodes: tuple[NodeConfig, ...] = ()
    policies: dict[str, dict[str, Any]] = {}
    gateway: dict[str, Any] = {}

    @field_validator("accelerators", "policies")
    @classmethod
    def _check_names(cls, value: dict[str, Any]) -> dict[str, Any]:
        for name in value:
            _check_name(name)
        return value


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
    import difflib  # only a mistake needs it

    options = list(choices)
    matches = difflib.get_close_matches(value, options, n=1, cutoff=0.6)
    if not matches:
        lowered = {c.lower(): c for c in options}
        return lowered.get(value.lower())
    return matches[0]


def discover_path(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The config file to use: explicit > ``$ZML_CONFIG`` > ``./zml.toml`` (None if none).

    Raises:
        PolicyConfigError: ``explicit`` is not a path (a str or os.PathLike), or it or
            ``$ZML_CONFIG`` does not name a regular file (missing, a directory, a name the OS
            refuses...).
    """
    if explicit is not None:
        try:
            text: object = os.fspath(explicit)
        except TypeError:
            text = None
        if not isinstance(text, str):
            raise PolicyConfigError(
                "config must be the path of a zml.toml (a str or os.PathLike) or a zml.Registry, "
                f"got {type(explicit).__name__}",
                field="config",
                value=type(explicit).__name__,
            )
        return _config_file(text, f"config file {_short(text)!r}", "does not exist",
                            "pass the path of a zml.toml", field="config")
    env = os.environ.get(ENV_CONFIG)
    if env:
        return _config_file(env, f"{ENV_CONFIG}={_short(env)!r}", "does not name an existing file",
                            "fix or unset it", field=ENV_CONFIG)
    local = Path("zml.toml")
    return local if local.is_file() else None


def _config_file(text: str, what: str, missing: str, fix: str, *, field: str) -> Path:
    """``Path(text)`` if it names a regular file, else a PolicyConfigError saying what it is."""
    path = Path(text)
    problem: str | None = None
    try:
        mode = path.stat().st_mode
    except (FileNotFoundError, NotADirectoryError):
        problem = missing
    except OSError as exc:  # e.g. a name longer than the OS allows
        problem = f"cannot be used: {exc.strerror or exc}"
    except ValueError:  # a NUL character
        problem = "is not a valid path (it contains a NUL character)"
    else:
        if not text:  # Path("") is the working directory
            problem = "is an empty path"
        elif stat.S_ISDIR(mode):
            problem = "is a directory, not a file"
            fix = f"pass the zml.toml file itself (e.g. {_short(str(path / 'zml.toml'))!r})"
        elif not stat.S_ISREG(mode):
            problem = "is not a regular file"
    if problem is None:
        return path
    raise PolicyConfigError(f"{what} {problem}; {fix}", field=field, value=text)


def _short(text: str) -> str:
    return text if len(text) <= 200 else f"{text[:120]}…{text[-60:]}"


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed TOML of the file at ``path``.

    Raises:
        PolicyConfigError: the file cannot be read, is not UTF-8 (naming the byte offset) or is
            not valid TOML.
    """
    source = str(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise PolicyConfigError(f"cannot read {source}: {exc.strerror or exc}",
                                source=source) from None
    except UnicodeDecodeError as exc:
        byte = exc.object[exc.start]
        raise PolicyConfigError(
            f"{source} is not UTF-8 text: byte 0x{byte:02x} at offset {exc.start} cannot be "
            "decoded; a zml.toml must be UTF-8: re-save it as UTF-8",
            source=source,
        ) from None
    except tomllib.TOMLDecodeError as exc:
        hint = "; the file starts with a UTF-8 byte-order mark (BOM): re-save it without one" \
            if _starts_with_bom(path) else ""
        raise PolicyConfigError(f"{source} is not valid TOML: {exc}{hint}",
                                source=source) from None
    except RecursionError:
        raise PolicyConfigError(
            f"{source} is nested too deeply to read (arrays or inline tables within each other "
            "thousands of levels deep); a zml.toml needs a few levels at most",
            source=source,
        ) from None


def _starts_with_bom(path: str | os.PathLike[str]) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(3) == b"\xef\xbb\xbf"
    except OSError:
        return False


def load_registry(path: str | os.PathLike[str]) -> Registry:
    """Read and validate one ``zml.toml`` (policies are validated by :mod:`zml.policy`)."""
    return registry_from_mapping(read_config_file(path), source=str(path))


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
    except PolicyConfigError as exc:  # NodeConfig's URL rules, which must not echo the URL
        raise PolicyConfigError(f"{where}: {exc}", field=exc.field, value=exc.value,
                                source=source) from None
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
    """Turn pydantic's first error into a message naming the table/key and the bad value
    (URLs in it shown through :func:`display_url`)."""
    err = first_error(exc)
    loc = _format_loc(err["loc"], data)
    value = without_secrets(err.get("input"), err["loc"][-1] if err["loc"] else None)
    hint: str | None = None
    if err["type"] == "extra_forbidden" and err["loc"]:
        key = str(err["loc"][-1])
        model_fields = _fields_at(err["loc"][:-1])
        hint = suggest(key, model_fields) if model_fields else None
        msg = f"{where}: unknown key {loc}" + (f"; did you mean {hint!r}?" if hint else "")
        value = None  # not kept: a key pasted under a wrong name (api_key = "sk-...") is one
    elif err["type"] == "missing":
        msg = f"{where}: {loc} is required"
        value = None
    else:
        msg = f"{where}: {loc} = {shown_value(value)}: {err['msg']}"
    if value is NOT_SHOWN:
        value = None
    return PolicyConfigError(msg, field=loc, value=value, suggestion=hint, source=source)


def env_name_problem(value: str) -> str | None:
    """What is wrong with ``value`` as the name of the environment variable holding a key
    (None: nothing). The message never quotes it: it may be the key itself."""
    if _ENV_NAME.fullmatch(value):
        return None
    return ("must be the name of an environment variable (letters, digits and _, not starting "
            "with a digit), e.g. \"H100_API_KEY\", not the key itself (which stays out of the "
            "file; the value is not shown)")


def shown_value(value: Any) -> str:
    """How a bad value (already through :func:`without_secrets`) appears in a message."""
    return NOT_SHOWN if value is NOT_SHOWN else repr(value)


def without_secrets(value: Any, key: object = None) -> Any:
    """``value`` (a bad input, to be shown) with every URL in it through :func:`display_url`:
    the strings under a ``url`` key, and any string that looks like a URL with an ``@``; and
    :data:`NOT_SHOWN` for an ``api_key_env``/``api_keys_env`` that names no variable (it may
    be the key itself)."""
    if isinstance(value, str):
        if key in _ENV_NAME_KEYS and env_name_problem(value) is not None:
            return NOT_SHOWN
        return display_url(value) if key == "url" or ("@" in value and ":" in value) else value
    if isinstance(value, Mapping):
        return {k: without_secrets(v, k) for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [without_secrets(v, key) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return value


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


# --- the default registry ------------------------------------------------------------------

EMPTY_REGISTRY = Registry()

_file_cache: dict[tuple[str, int, int], Registry] = {}
_file_cache_lock = threading.Lock()


def discovered_registry() -> Registry:
    """The registry of the discovered config file (``$ZML_CONFIG``, else ``./zml.toml``), or
    the empty registry when there is none.

    A pure cache keyed by the file's path, size and modification time: the file is read once
    and again only after it changes.
    """
    path = discover_path()
    if path is None:
        return EMPTY_REGISTRY
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    with _file_cache_lock:
        cached = _file_cache.get(key)
    if cached is not None:
        return cached
    registry = load_registry(path)
    with _file_cache_lock:
        _file_cache.clear()  # only the newest version of a file is worth keeping
        _file_cache[key] = registry
    return registry
