"""Loading plugins: the process-wide set, and the per-client plugin manager built from it.

Installed plugins are setuptools entry points of group ``zml``. They are discovered once per
process, lazily, when the first client is built (or ``zml.plugins.register`` is first called):
never as a side effect of ``import zml``, and never per request. Two environment variables,
read at that moment, control it:

* ``ZML_DISABLE_PLUGIN_AUTOLOAD=1``: load no installed plugin (only those named below).
* ``ZML_PLUGINS=a,b``: load only these, by entry point name or distribution name (even with
  autoload disabled). Set but empty: load none.

A plugin that fails to import, or that implements a hook that does not exist (a misspelling,
caught by ``check_pending``), is skipped with one warning naming it.

The built-in behaviour is made of plugins too (``zml.plugins.default``), registered first, the
same way. Each client gets its own :class:`PluginManager`, a copy of the process-wide one:
``client.plugins.register(obj)`` affects that client only, ``zml.plugins.register(obj)`` every
client built afterwards.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import threading
import types
import warnings
from collections.abc import Mapping
from importlib import metadata
from typing import Any

import pluggy

from . import hookspecs

__all__ = [
    "ENV_DISABLE_AUTOLOAD",
    "ENV_PLUGINS",
    "IDLE_METHOD",
    "NOTIFICATION_HOOKS",
    "PluginManager",
    "client_manager",
    "discover",
    "process_manager",
]

ENV_DISABLE_AUTOLOAD = "ZML_DISABLE_PLUGIN_AUTOLOAD"
ENV_PLUGINS = "ZML_PLUGINS"
GROUP = "zml"

NOTIFICATION_HOOKS = frozenset(
    name
    for name, spec in vars(hookspecs).items()
    if name.startswith("zml_") and getattr(spec, "zml_notification", False)
)
"""Hooks whose implementations are isolated (an exception is logged, never raised) and may not
be wrappers: those marked ``@notification`` in :mod:`.hookspecs`."""

FLEET_HOOK = "zml_register_fleet_sources"
COST_HOOK = "zml_attribute_cost"

IDLE_METHOD = "zml_idle"
"""A plugin object may define ``zml_idle()`` (a plain method, not a hook): while it returns
True, the plugin has nothing to do, and a notification hook whose every implementation belongs
to an idle plugin is not called at all (pluggy's call costs a few microseconds per hook and
request). An idle plugin may still receive notifications another plugin wants, and a request
that started while the plugin was idle may reach it later in its life (after ``zml_idle()``
turned False), so its hooks must tolerate a request they did not see start. The built-in
OpenTelemetry plugin is idle while no OpenTelemetry provider is configured."""

logger: logging.Logger = logging.getLogger("zml.plugins")

_HOOKABLE = (types.FunctionType, types.MethodType, staticmethod, classmethod)
"""What pluggy can take as a hook implementation (it skips everything else)."""


class PluginManager(pluggy.PluginManager):
    """zml's pluggy plugin manager (project name ``"zml"``, the hooks of :mod:`.hookspecs`).

    ``register`` validates each plugin as it arrives: an unknown hook (a misspelled name) or a
    wrapper on a notification hook raises :class:`pluggy.PluginValidationError`, and the plugin
    is not registered. ``generation`` counts registrations, so the named-policy mapping of a
    client knows when to ask the policy sources again.
    """

    def __init__(self) -> None:
        super().__init__(GROUP)
        self.add_hookspecs(hookspecs)
        self.generation: int = 0
        self.fleet_read = False
        """Set once a client has read the fleet sources (later fleet plugins are not used)."""
        self._impls: dict[str, tuple[pluggy.HookImpl, ...]] = {}
        self._idle_checks: dict[str, tuple[tuple[str, Any], ...] | None] = {}
        self._direct: dict[str, tuple[Any, tuple[str, ...], bool] | None] = {}
        self._monitored = False
        self._reported: set[tuple[str, str]] = set()
        self._reported_lock = threading.Lock()

    def register(self, plugin: Any, name: str | None = None) -> str | None:
        """Register ``plugin`` (a module, class instance...) under ``name``; return its name.

        Raises:
            pluggy.PluginValidationError: a hook implementation does not match a hook of
                :mod:`zml.plugins.hookspecs`, or is a wrapper on a notification hook.
            ValueError: the name or the object is already registered.
        """
        registered = super().register(plugin, name)
        if registered is None:
            return None
        try:
            self._validate(plugin)
        except Exception:
            super().unregister(plugin)
            raise
        self._isolate(plugin)
        self._changed()
        if self.fleet_read and self._implements(plugin, FLEET_HOOK):
            warnings.warn(
                f"plugin {registered!r} implements {FLEET_HOOK}, but this client has already "
                "built its fleet; register it with zml.plugins.register() before building the "
                "client, or install it as an entry point",
                stacklevel=2,
            )
        return registered

    def parse_hookimpl_opts(self, plugin: Any, name: str) -> pluggy.HookimplOpts | None:
        """pluggy's, with the names that cannot hold a hook implementation skipped at once.

        pluggy looks every name of ``dir(plugin)`` up with ``inspect.getattr_static`` (tens of
        microseconds for an instance), for every plugin of every client's manager. Skipped
        here: Python's own names (``__init__``...), and a module's names whose value is not a
        function, method, staticmethod or classmethod (pluggy would skip those too).
        """
        if name.startswith("__") and name.endswith("__"):
            return None
        if isinstance(plugin, types.ModuleType) and not isinstance(
            plugin.__dict__.get(name), _HOOKABLE
        ):
            return None
        return super().parse_hookimpl_opts(plugin, name)

    def unregister(self, plugin: Any | None = None, name: str | None = None) -> Any | None:
        """Unregister a plugin (by object or name); return it."""
        removed = super().unregister(plugin, name)
        self._changed()
        return removed

    def set_blocked(self, name: str) -> None:
        """Unregister the plugin called ``name`` (if any) and refuse it from now on."""
        super().set_blocked(name)
        self._changed()

    def impls(self, hook_name: str) -> tuple[pluggy.HookImpl, ...]:
        """The implementations of a hook in call order (first called first); cached."""
        found = self._impls.get(hook_name)
        if found is None:
            generation = self.generation
            caller: pluggy.HookCaller | None = getattr(self.hook, hook_name, None)
            found = tuple(reversed(caller.get_hookimpls())) if caller is not None else ()
            if generation == self.generation:  # not if a registration raced this read
                self._impls[hook_name] = found
        return found

    def wanted(self, hook_name: str) -> bool:
        """Whether notifying ``hook_name`` now would reach a plugin that wants it: some
        implementation's plugin is not idle (see :data:`IDLE_METHOD`). False when no plugin
        implements the hook; then zml does not call it at all."""
        try:
            checks = self._idle_checks[hook_name]
        except KeyError:
            generation = self.generation
            impls = self.impls(hook_name)
            found: tuple[tuple[str, Any], ...] | None = None  # None: some plugin never idles
            pairs = [(impl.plugin_name, getattr(impl.plugin, IDLE_METHOD, None))
                     for impl in impls]
            if all(callable(check) for _, check in pairs):
                found = tuple(pairs)
            if generation == self.generation:
                self._idle_checks[hook_name] = found
            checks = found
        if checks is None:
            return True
        for name, idle in checks:
            try:
                if not idle():
                    return True
            except Exception as exc:  # a failing check counts as "not idle"
                self.report(name, IDLE_METHOD, exc)
                return True
        return False

    def call(self, hook_name: str, kwargs: Mapping[str, Any]) -> Any:
        """``self.hook.<hook_name>(**kwargs)``, with a hook only one plugin implements called
        directly.

        pluggy runs its multicall loop (about ten function calls) even for a hook with one
        implementation, which is the common case of ``zml_attribute_cost`` (the built-in cost
        model answers it) on every request. Such an implementation, when it is not a wrapper
        and no hook-call monitoring is installed (``add_hookcall_monitoring``,
        ``enable_tracing``), is called here with the arguments it names, and its result comes
        back as from pluggy: as it is for a ``firstresult`` hook, else in a list (empty for
        None). ``kwargs`` must hold every argument of the hook.
        """
        try:
            direct = self._direct[hook_name]
        except KeyError:
            direct = self._direct_call(hook_name)
        if direct is None:
            return getattr(self.hook, hook_name)(**kwargs)
        function, argnames, firstresult = direct
        result = function(*[kwargs[name] for name in argnames])
        if firstresult:
            return result
        return [] if result is None else [result]

    def _direct_call(self, hook_name: str) -> tuple[Any, tuple[str, ...], bool] | None:
        generation = self.generation
        impls = self.impls(hook_name)
        caller: pluggy.HookCaller | None = getattr(self.hook, hook_name, None)
        found = None
        if len(impls) == 1 and not (impls[0].wrapper or impls[0].hookwrapper) \
                and not self._monitored and caller is not None and caller.spec is not None:
            impl = impls[0]
            found = (impl.function, tuple(impl.argnames),
                     bool(caller.spec.opts.get("firstresult", False)))
        if generation == self.generation:
            self._direct[hook_name] = found
        return found

    def add_hookcall_monitoring(self, before: Any, after: Any) -> Any:
        """pluggy's; from then on every hook is called through pluggy (see :meth:`call`)."""
        self._monitored = True
        self._direct.clear()
        return super().add_hookcall_monitoring(before, after)

    def copy(self) -> PluginManager:
        """A new manager with the same plugins (and blocked names), in the same order."""
        pm = PluginManager()
        for name, plugin in self.list_name_plugin():
            if plugin is None:
                pm.set_blocked(name)
            else:
                pm.register(plugin, name)
        return pm

    def _changed(self) -> None:
        self._impls.clear()
        self._idle_checks.clear()
        self._direct.clear()
        self.generation += 1

    def _validate(self, plugin: Any) -> None:
        self.check_pending()
        for caller in self.get_hookcallers(plugin) or ():
            if caller.name not in NOTIFICATION_HOOKS:
                continue
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin and (impl.wrapper or impl.hookwrapper):
                    raise pluggy.PluginValidationError(
                        plugin,
                        f"{caller.name} of plugin {self.get_name(plugin)!r} is a wrapper; "
                        "notification hooks are called one implementation at a time and "
                        "take plain implementations (tryfirst/trylast for order)",
                    )

    def _isolate(self, plugin: Any) -> None:
        """Wrap ``plugin``'s notification implementations so that an exception is reported
        and the call goes on to the next implementation (a firstresult one counts as None)."""
        for caller in self.get_hookcallers(plugin) or ():
            if caller.name not in NOTIFICATION_HOOKS:
                continue
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin:
                    # HookImpl.function is public (typed Final): replacing it with an isolating
                    # wrapper keeps argnames and order, so pluggy calls it as before.
                    impl.function = self._isolated(  # type: ignore[misc]
                        impl.function, impl.plugin_name, caller.name
                    )

    def _isolated(self, function: Any, plugin_name: str, hook: str) -> Any:
        if hook == COST_HOOK:
            return self._isolated_cost(function, plugin_name)

        def isolated(*args: Any) -> Any:
            try:
                return function(*args)
            except Exception as exc:
                self.report(plugin_name, hook, exc)
                return None

        return isolated

    def _isolated_cost(self, function: Any, plugin_name: str) -> Any:
        """As :meth:`_isolated`, and a result that is not a cost (a ``Cost``, or a mapping of
        its fields that validates) is reported and counts as None, so the next cost model
        (the built-in one last) decides: an invalid cost is never dropped in silence."""
        from ..types import Cost

        def isolated(*args: Any) -> Any:
            try:
                found = function(*args)
                if found is None or isinstance(found, Cost):
                    return found
                if not isinstance(found, Mapping):
                    raise TypeError(f"returned a {type(found).__name__}, not a zml.Cost or "
                                    "a mapping of its fields (or None)")
                return Cost.model_validate(found)
            except Exception as exc:
                self.report(plugin_name, COST_HOOK, exc)
                return None

        return isolated

    def report(self, plugin_name: str, hook: str, exc: BaseException) -> None:
        """Log a plugin's exception: at WARNING (with its traceback) the first time for this
        plugin and hook, at DEBUG afterwards (logger ``zml.plugins``)."""
        key = (plugin_name, hook)
        with self._reported_lock:
            first = key not in self._reported
            self._reported.add(key)
        if first:
            logger.warning(
                "zml plugin %r raised in %s (the request goes on; further errors of this "
                "plugin in this hook are logged at DEBUG)",
                plugin_name,
                hook,
                exc_info=exc,
            )
        else:
            logger.debug("zml plugin %r raised in %s", plugin_name, hook, exc_info=exc)

    def _implements(self, plugin: Any, hook_name: str) -> bool:
        return any(c.name == hook_name for c in self.get_hookcallers(plugin) or ())


# --- discovery -------------------------------------------------------------------------------

DEFAULT_PLUGINS: tuple[tuple[str, str], ...] = (
    ("zml.static_fleet", "zml.plugins.default.static_fleet"),
    ("zml.toml_policies", "zml.plugins.default.toml_policies"),
    ("zml.cost", "zml.plugins.default.cost"),
    ("zml.otel", "zml.plugins.default.otel"),
)
"""The built-in plugins: (name, module). A module's ``plugin`` attribute, if it has one, is
registered instead of the module (the OpenTelemetry plugin is an instance)."""


def _wanted(environ: Mapping[str, str]) -> tuple[bool, frozenset[str] | None]:
    """(autoload, only): whether to load every installed plugin, and which names to load."""
    autoload = environ.get(ENV_DISABLE_AUTOLOAD, "").strip().lower() in ("", "0", "false", "no")
    listed = environ.get(ENV_PLUGINS)
    if listed is None:
        return autoload, None
    return autoload, frozenset(n.strip() for n in listed.split(",") if n.strip())


def _group_entry_points() -> list[tuple[metadata.EntryPoint, str]]:
    """The installed entry points of group ``zml``, first distribution on the path first, each
    with the name of its distribution ("" when its METADATA cannot be read).

    Each distribution's ``entry_points.txt`` is read, and only a file with a ``[zml]`` section
    is parsed into entry points: ``entry_points(group=...)`` parses every file (every console
    script of every package), 4-6 ms with 150 packages against about 2.5, on the first client
    of a process. METADATA is read only for the distributions that declare zml plugins
    (reading every installed package's costs about 0.1 s with 150 packages).
    """
    header = f"[{GROUP}]"
    found: list[tuple[metadata.EntryPoint, str]] = []
    seen: set[str] = set()
    for dist in metadata.distributions():
        text = dist.read_text("entry_points.txt")
        if not text or header not in text:
            continue
        # A distribution installed twice on the path counts once, first copy first (as in
        # entry_points()); its name is read only here, for the few that declare zml plugins.
        dist_name = _metadata_name(dist)
        name = re.sub(r"[-_.]+", "-", dist_name).lower()
        if name in seen:
            continue
        if name:
            seen.add(name)
        found.extend((ep, dist_name) for ep in dist.entry_points if ep.group == GROUP)
    return found


def _metadata_name(dist: metadata.Distribution) -> str:
    """``dist``'s name ("" when its METADATA cannot be read)."""
    try:
        return str(dist.metadata["Name"] or "")
    except Exception:  # a broken METADATA file must not stop the other plugins
        return ""


def discover(
    pm: PluginManager, environ: Mapping[str, str] | None = None
) -> list[tuple[str, str]]:
    """Load the installed plugins that ``environ`` allows into ``pm``.

    Entry points are registered in reverse order of name, so that they are *called* in
    alphabetical order. A plugin that fails to load or to validate is skipped with a warning.
    Returns (entry point name, distribution name) for each plugin registered.
    """
    env = os.environ if environ is None else environ
    autoload, only = _wanted(env)
    if not autoload and not only:
        return []
    # A distribution is named as any package tool names it: "zml-policy-sqlite",
    # "zml_policy_sqlite" and "ZML.Policy.SQLite" are one name (PEP 503).
    only_dists = None if only is None else {_canonical(n) for n in only}
    found: dict[str, tuple[metadata.EntryPoint, str]] = {}
    for ep, dist_name in _group_entry_points():
        if ep.name in found:
            continue
        if only is not None and only_dists is not None and ep.name not in only \
                and _canonical(dist_name) not in only_dists:
            continue
        found[ep.name] = (ep, dist_name)
    loaded: list[tuple[str, str]] = []
    for name in sorted(found, reverse=True):
        ep, dist_name = found[name]
        if pm.has_plugin(name) or pm.is_blocked(name):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:
            warnings.warn(
                f"zml plugin {name!r} (from {dist_name or 'an unknown distribution'}, "
                f"{ep.value}) failed to import and is not loaded: {type(exc).__name__}: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        try:
            pm.register(plugin, name=name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            warnings.warn(
                f"zml plugin {name!r} (from {dist_name or 'an unknown distribution'}) is not "
                f"loaded: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        loaded.append((name, dist_name))
    if only:
        dists = {_canonical(d) for _, d in found.values()}
        missing = sorted(n for n in only if n not in found and _canonical(n) not in dists)
        if missing:
            warnings.warn(
                f"{ENV_PLUGINS} names plugin(s) that are not installed: {', '.join(missing)}",
                RuntimeWarning,
                stacklevel=2,
            )
    return loaded


def _canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them: lower case, runs of ``-_.`` as ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def register_defaults(pm: PluginManager) -> None:
    """Register the built-in plugins of :data:`DEFAULT_PLUGINS` into ``pm``."""
    for name, module_name in DEFAULT_PLUGINS:
        module = importlib.import_module(module_name)
        pm.register(getattr(module, "plugin", module), name=name)


_lock = threading.Lock()
_process: PluginManager | None = None


def process_manager() -> PluginManager:
    """The process-wide manager: built-in plugins, then installed ones (loaded on first use)."""
    global _process
    with _lock:
        if _process is None:
            pm = PluginManager()
            register_defaults(pm)
            discover(pm)
            _process = pm
        return _process


def client_manager() -> PluginManager:
    """A new manager for one client: a copy of the process-wide one."""
    pm = process_manager()
    with _lock:
        return pm.copy()
