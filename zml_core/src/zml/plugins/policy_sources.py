"""A client's named policies: a live, cached view over the registered policy sources.

``infer(policy="name")`` looks the name up here on every request, so the lookup must be cheap,
and an edit in a policy store must reach a running client without a restart. Both hold by
caching each name's validated :class:`~zml.policy.Policy` and dropping the cache when something
changed: a source's ``version()`` token (polled per lookup: for SQLite one
``PRAGMA data_version``), a source's ``subscribe`` callback, or a plugin registered on or
unregistered from the client's manager (then the sources are collected again).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ..config import Registry
from ..errors import PolicyConfigError, safe_detail
from ..policy import Policy, check_families, policy_from_mapping

if TYPE_CHECKING:
    from .hookspecs import PolicySource
    from .manager import PluginManager

__all__ = ["SourceFailure", "SourcePolicies", "collect_policy_sources", "plugin_failure",
           "source_name"]

logger: logging.Logger = logging.getLogger("zml.plugins")

_MISSING = object()
_CACHE_LIMIT = 4096


def source_name(source: object) -> str:
    """How a source is named in messages: its ``name`` attribute, else its type's name."""
    name = getattr(source, "name", None)
    return name if isinstance(name, str) and name else type(source).__name__


class SourceFailure(PolicyConfigError):
    """A policy source (or the plugin registering it) that failed, as opposed to a policy that
    is invalid: when the client is built, it does not fail the build (a request that names no
    policy still routes), and every named lookup raises it until the source answers."""


def plugin_failure(what: str, exc: Exception, field: str,
                   kind: type[PolicyConfigError] = PolicyConfigError) -> PolicyConfigError:
    """The PolicyConfigError (or ``kind``) for a plugin that raised while doing ``what`` (its
    message is passed through :func:`~zml.errors.safe_detail`: it may quote a store's URL)."""
    return kind(
        f"{what} failed: {type(exc).__name__}: {safe_detail(str(exc), 300)}; fix the plugin "
        "(or its store), or unregister it",
        field=field,
    )


_Known = dict[int, tuple[Any, list["PolicySource"]]]
"""id(hook implementation) -> (the implementation, the sources it registered)."""


def collect_policy_sources(
    pm: PluginManager, registry: Registry, known: _Known | None = None
) -> tuple[list[PolicySource], _Known]:
    """Call each ``zml_register_policy_sources`` implementation; return the sources, in
    precedence order, and what each implementation registered.

    An implementation in ``known`` (what an earlier call returned) is not called again: its
    sources are reused. So a plugin registers its sources once per client, when the client is
    built or when the plugin joins it, and an environment variable it reads then keeps the
    value it had (registering an unrelated plugin later does not move the client's store).

    Raises:
        PolicyConfigError: a plugin registered something that is not a source, or raised.
    """
    known = {} if known is None else known
    found: _Known = {}
    sources: list[PolicySource] = []
    for impl in pm.impls("zml_register_policy_sources"):
        if impl.wrapper or impl.hookwrapper:
            continue  # (one implementation at a time: there is no inner call to wrap)
        entry = known.get(id(impl))
        if entry is None or entry[0] is not impl:
            entry = (impl, _call_registration(impl, registry))
        found[id(impl)] = entry
        sources.extend(s for s in entry[1] if not any(s is t for t in sources))
    return sources, found


def _call_registration(impl: Any, registry: Registry) -> list[PolicySource]:
    """One plugin's ``zml_register_policy_sources``: the sources it registers."""
    sources: list[PolicySource] = []

    def register(source: PolicySource) -> None:
        if not callable(getattr(source, "get", None)) or not callable(
            getattr(source, "list", None)
        ):
            raise SourceFailure(
                f"a policy source needs get(name) and list() methods, got "
                f"{type(source).__name__}: fix the plugin that registers it",
                field="policy",
                source=source_name(source),
            )
        if not any(s is source for s in sources):
            sources.append(source)

    arguments = {"register": register, "registry": registry}
    try:
        impl.function(*[arguments[name] for name in impl.argnames])
    except PolicyConfigError:
        raise
    except Exception as exc:  # without its sources, a name could resolve to another policy
        raise plugin_failure(f"plugin {impl.plugin_name!r}'s zml_register_policy_sources",
                             exc, "policy", SourceFailure) from exc
    return sources


def _source_failed(source: object, what: str, exc: Exception, value: object = None,
                  kind: type[PolicyConfigError] = PolicyConfigError) -> PolicyConfigError:
    """The error for a source whose method raised while doing ``what`` (its message passed
    through :func:`~zml.errors.safe_detail`: it may quote the store's URL)."""
    # A source's own PolicyConfigError already says what is wrong and how to fix it: kept
    # whole (cut at 300 characters, its fix was lost), without its type's name.
    detail = safe_detail(str(exc), 1000) if isinstance(exc, PolicyConfigError) \
        else f"{type(exc).__name__}: {safe_detail(str(exc), 300)}"
    return kind(
        f"policy source {source_name(source)!r} {what}: {detail}",
        field="policy",
        value=value,
        source=source_name(source),
    )


def _listed(source: PolicySource) -> list[str]:
    """``source.list()``, its failure a PolicyConfigError naming the source."""
    try:
        return list(source.list())
    except Exception as exc:
        raise _source_failed(source, "failed to list its policies", exc) from exc


def _version(source: PolicySource) -> Hashable:
    try:
        token: Hashable = source.version()  # type: ignore[attr-defined]
    except Exception as exc:
        raise _source_failed(source, "is unavailable", exc, kind=SourceFailure) from exc
    return token


class SourcePolicies(Mapping[str, Policy]):
    """``Mapping[str, Policy]`` over a client's policy sources (``Dispatcher.policies``).

    The first source (in precedence order) whose ``get(name)`` is not None defines ``name``.
    What it returns is validated against ``registry``; an invalid policy raises
    :class:`PolicyConfigError` naming the source (and is not cached, so a fix is seen at once).
    """

    def __init__(self, pm: PluginManager, registry: Registry) -> None:
        self._pm = pm
        self._registry = registry
        self._lock = threading.Lock()
        self._cache: dict[str, Policy | object] = {}
        self._names: tuple[str, ...] | None = None
        self._dirty = False
        self._epoch = 0
        self._generation = -1
        self._sources: list[PolicySource] = []
        self._versioned: list[tuple[PolicySource, list[Hashable]]] = []
        self._known: _Known = {}
        try:
            self._refresh_sources()
        except SourceFailure as exc:
            # Not the client's failure: a request that names no policy still routes. Every
            # named lookup asks the sources again (the generation is still unknown) and raises
            # until they answer.
            logger.warning("%s (until it is fixed, every request naming a policy fails)", exc)

    def _refresh_sources(self) -> None:
        generation = self._pm.generation
        sources, known = collect_policy_sources(self._pm, self._registry, self._known)
        versioned: list[tuple[PolicySource, list[Hashable]]] = []
        for source in sources:
            if callable(getattr(source, "version", None)):
                versioned.append((source, [_version(source)]))
            subscribe = getattr(source, "subscribe", None)
            if callable(subscribe) and not any(s is source for s in self._sources):
                subscribe(self._invalidate)
        with self._lock:
            self._known = known
            self._sources = sources
            self._versioned = versioned
            self._generation = generation
            self._epoch += 1
            self._cache.clear()
            self._names = None
            self._dirty = False

    def _invalidate(self) -> None:
        self._dirty = True

    def _check(self) -> None:
        """Drop the cache when a source changed (cheap: one version() per versioned source)."""
        if self._pm.generation != self._generation:
            self._refresh_sources()
            return
        changed = self._dirty
        for source, last in self._versioned:
            now = _version(source)
            if now != last[0]:
                last[0] = now
                changed = True
        if changed:
            with self._lock:
                self._dirty = False
                self._epoch += 1
                self._cache.clear()
                self._names = None

    # --- Mapping ---------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        """The policy called ``key`` (validated), or ``default`` when no source knows it."""
        self._check()
        found = self._cache.get(key, _MISSING)
        if found is _MISSING:
            epoch = self._epoch
            found = self._lookup(key)
            with self._lock:
                if epoch == self._epoch:  # else a change was noticed meanwhile: don't keep it
                    if len(self._cache) >= _CACHE_LIMIT:
                        self._cache.clear()
                    self._cache[key] = found
        return default if found is None else found

    def __getitem__(self, key: str) -> Policy:
        found = self.get(key)
        if found is None:
            raise KeyError(key)
        assert isinstance(found, Policy)
        return found

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def __iter__(self) -> Iterator[str]:
        self._check()
        names = self._names
        if names is None:
            seen: dict[str, None] = {}
            for source in self._sources:
                for name in _listed(source):
                    seen.setdefault(name, None)
            names = self._names = tuple(seen)
        return iter(names)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"SourcePolicies(sources={[source_name(s) for s in self._sources]})"

    @property
    def sources(self) -> tuple[PolicySource, ...]:
        """The policy sources, in precedence order."""
        self._check()
        return tuple(self._sources)

    # --- lookup ----------------------------------------------------------------------------

    def _lookup(self, name: str) -> Policy | None:
        for source in self._sources:
            try:
                data = source.get(name)
            except PolicyConfigError:
                raise
            except Exception as exc:
                raise _source_failed(source, f"failed to read policy {name!r}", exc,
                                    value=name) from exc
            if data is None:
                continue
            return self._validate(source, name, data)
        return None

    def _validate(self, source: object, name: str, data: object) -> Policy:
        where = source_name(source)
        try:
            if isinstance(data, Policy):
                check_families(data.name, data.accelerator_chain, self._registry)
                return data
            if not isinstance(data, Mapping):
                raise PolicyConfigError(
                    f"a policy must be a mapping of Policy fields or a zml.Policy, got "
                    f"{type(data).__name__}",
                    field="policy",
                    value=data,
                )
            body = dict(data)
            body.setdefault("name", name)
            return policy_from_mapping(body, self._registry)
        except PolicyConfigError as exc:
            raise PolicyConfigError(
                f"policy source {where!r}: {exc}",
                field=exc.field,
                value=exc.value,
                suggestion=exc.suggestion,
                source=where,
            ) from None
