"""The hook specifications of zml: everything a plugin can implement, in one module.

A plugin is any object (usually a module) with functions named like the hooks below and
decorated with :data:`zml.hookimpl`. An implementation may accept any subset of a hook's
parameters, by name. Four families of hooks:

* **fleet sources** (:func:`zml_register_fleet_sources`): families and nodes from somewhere
  other than ``zml.toml``; read once, when a client is built.
* **policy sources** (:func:`zml_register_policy_sources`): named policies, looked up live by
  ``infer(policy="name")``.
* **telemetry** (``zml_request_*``, :func:`zml_attempt_failed`): notifications, for every
  request of both clients, sync and async; :func:`zml_request_headers` adds headers to the
  request sent to a node (trace context).
* **cost attribution** (:func:`zml_attribute_cost`): the first non-None cost wins.
* **shared fleet state** (:func:`zml_slot_ledger`): a cross-process slot ledger for a client's
  fleet; the first non-None ledger wins.
* **command line** (:func:`zml_register_commands`): subcommands of the ``zml`` command.

Notification hooks (telemetry and cost, marked with :func:`notification` below) are called
through pluggy like every hook; each of their implementations is isolated when it is
registered, so that an exception in one plugin never fails the request nor hides the event from
the others: it is logged once per plugin and hook (logger ``zml.plugins``), and a raising
``firstresult`` implementation counts as None. For the same reason these hooks do not accept
``wrapper=True``/``hookwrapper=True`` implementations; a plugin that declares one is refused at
registration. ``tryfirst=True`` and ``trylast=True`` order implementations as usual.

Adding a notification hook takes one function here, decorated ``@notification`` (and
``@hookspec``), plus its entry in ``docs/plugins.md``; dispatch calls it by name with
``Notify("zml_...", {...})``.

Order: pluggy calls implementations last-registered-first. zml registers its built-in plugins
first, then installed (entry point) plugins in reverse order of their entry point names, then
plugins registered in code; so code plugins are called before installed plugins, installed
plugins in alphabetical order of entry point name, and built-in plugins last.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from pluggy import HookimplMarker, HookspecMarker

if TYPE_CHECKING:
    import argparse

    from ..config import AcceleratorConfig, NodeConfig, Registry
    from ..dispatch import CallView as Call
    from ..errors import NodeError, ZMLError
    from ..fleet import Fleet
    from ..ledger import SlotLedger
    from ..policy import Policy
    from ..types import Attempt, Cost, RoutingInfo

__all__ = [
    "FleetSource",
    "PolicySource",
    "VersionedPolicySource",
    "hookimpl",
    "hookspec",
    "notification",
]

hookspec: HookspecMarker = HookspecMarker("zml")
hookimpl: HookimplMarker = HookimplMarker("zml")
"""Marks a plugin's hook implementation: ``@zml.hookimpl`` (options: tryfirst, trylast...)."""

_F = TypeVar("_F", bound=Callable[..., Any])


def notification(spec: _F) -> _F:
    """Mark a hookspec as a per-request notification: its implementations are isolated
    (an exception is logged, never raised) and may not be wrappers."""
    spec.zml_notification = True  # type: ignore[attr-defined]
    return spec


# --- what the register callbacks accept ----------------------------------------------------


@runtime_checkable
class PolicySource(Protocol):
    """A store of named policies, registered through :func:`zml_register_policy_sources`.

    ``get`` returns the policy's fields (a mapping of :class:`zml.Policy` fields; ``name`` may
    be left out) or a :class:`zml.Policy`, or None when the source does not know the name.
    ``list`` returns the names the source knows. Both may be called from any thread.

    Two optional methods tell a client when to read again (without them the source is read
    once per name and cached for the client's life):

    * ``version() -> Hashable``: a cheap token that changes when the store changes (SQLite's
      ``PRAGMA data_version``, a file's mtime); polled on every named-policy lookup.
    * ``subscribe(callback)``: the source calls ``callback()`` (from any thread) after a change.

    An optional ``name`` attribute names the source in error messages.

    ``version``, ``get`` and ``list`` run on the caller's thread, before the request's deadline
    applies (and on the event loop, for an ``AsyncClient``): they must not block. A store that
    can be slow or locked should answer from a copy it refreshes, as zml-policy-sqlite does.
    """

    def get(self, name: str) -> Mapping[str, Any] | Policy | None:
        """The policy called ``name``, or None."""
        ...

    def list(self) -> Iterable[str]:
        """The names of the policies this source knows."""
        ...


@runtime_checkable
class VersionedPolicySource(PolicySource, Protocol):
    """A :class:`PolicySource` with change detection by polling."""

    def version(self) -> Hashable:
        """A token that changes whenever the source's policies change (must be cheap)."""
        ...


@runtime_checkable
class FleetSource(Protocol):
    """Families and nodes from outside ``zml.toml``: see :func:`zml_register_fleet_sources`.

    ``families`` maps family names to :class:`zml.config.AcceleratorConfig` (or mappings of
    its fields: ``cost_per_hour``, ``cost_per_1k_tokens``); ``nodes`` yields
    :class:`zml.config.NodeConfig` (or mappings of its fields, as in a ``[[nodes]]`` table).
    An optional ``name`` attribute names the source in error messages.
    """

    def families(self) -> Mapping[str, AcceleratorConfig | Mapping[str, Any]]:
        """Accelerator families by name."""
        ...

    def nodes(self) -> Iterable[NodeConfig | Mapping[str, Any]]:
        """Serving nodes."""
        ...


# --- fleet and policy sources ----------------------------------------------------------------


@hookspec
def zml_register_fleet_sources(
    register: Callable[[FleetSource], None], config: Registry
) -> None:
    """Register sources of accelerator families and nodes.

    Called once per client, when it is built, before any policy is validated: the client's
    registry is ``zml.toml``'s plus every family and node registered here, and a
    :class:`zml.Policy` may name a family that only a fleet source declares. The registry is
    then made the active one (``zml.Policy(...)`` validates against it).

    Precedence: sources are merged in the order they are registered. The built-in static
    fleet (``zml.toml``'s ``[accelerators.*]`` and ``[[nodes]]``) is registered first
    (``tryfirst``). When two sources declare a family, the first declaration is kept; a node
    id declared twice is a :class:`zml.PolicyConfigError` naming the source.

    Fleet sources are not read again: a plugin registered with ``client.plugins.register``
    after the client was built does not change its fleet (register it process-wide with
    ``zml.plugins.register`` before building the client, or install it).

    Args:
        register: call ``register(source)`` with each :class:`FleetSource`.
        config: the registry read from ``zml.toml`` (or passed as ``Client(config=...)``).

    Returns:
        Nothing; called for every plugin (not ``firstresult``).
    """


@hookspec
def zml_register_policy_sources(
    register: Callable[[PolicySource], None], registry: Registry
) -> None:
    """Register sources of named policies, for ``infer(policy="name")``.

    Called once per client and plugin: when the client is built (after its fleet registry is
    complete), or when the plugin is registered on the client's plugin manager later. The
    sources a plugin registered stay the client's while the plugin is registered (an
    environment variable read here keeps the value it had); they go when it is unregistered.
    An implementation that raises is called again at the next named lookup.

    A lookup asks the sources in the order they were registered and the first one whose
    ``get(name)`` is not None wins. With pluggy's order (see the module docstring) that is:
    plugins registered in code first, then installed plugins, then the built-in ``zml.toml``
    source (``[policies.NAME]`` tables; ``trylast``). Within one plugin, the order of its
    ``register`` calls.

    What a source returns is validated against the client's registry (an unknown family, a
    bad field) and raises :class:`zml.PolicyConfigError` naming the source. Results are cached
    per name; a source with ``version()`` or ``subscribe()`` is read again after it changes,
    so an edit in a policy store reaches running clients without a restart.

    Args:
        register: call ``register(source)`` with each :class:`PolicySource`.
        registry: the client's complete fleet registry (families, nodes, ``zml.toml`` tables).

    Returns:
        Nothing; called for every plugin (not ``firstresult``).
    """


# --- telemetry -------------------------------------------------------------------------------


@notification
@hookspec
def zml_request_started(call: Call, metadata: Mapping[str, Any]) -> None:
    """A request was validated and is about to be routed.

    Called once per request, as its first hook, by both clients, for ``infer`` and
    ``infer_stream``, before any routing decision.
    ``call.state`` is a per-request scratch dict for plugins (keep a span or a timer there,
    under a key your plugin owns). Exactly one of :func:`zml_request_completed`,
    :func:`zml_request_failed` or :func:`zml_request_cancelled` follows.

    Args:
        call: a read-only view of the request (:class:`zml.dispatch.CallView`):
            ``call.model``, ``call.policy_name``, ``call.stream``, ``call.metadata``,
            ``call.started_at`` (monotonic seconds), ``call.elapsed_s``, ``call.state``.
            ``call.body`` is the encoded request (prompt included): do not record it unless
            the user opted in.
        metadata: the per-call ``metadata={...}`` (team, service...); the same as
            ``call.metadata``.

    Returns:
        Nothing (notification; exceptions are logged, never raised).
    """


@notification
@hookspec
def zml_request_routed(call: Call, routing: RoutingInfo, metadata: Mapping[str, Any]) -> None:
    """A routing decision was made and a slot reserved on a node.

    Called once per attempt, before the request is sent: again for each failover attempt,
    with that attempt's decision. Not called when routing finds no node (then
    :func:`zml_request_failed` gets a RoutingError whose context lists the families).

    Args:
        call: the request (see :func:`zml_request_started`).
        routing: the decision: ``node_id``, ``accelerator``, ``policy``, ``queue_depth``,
            ``node_load``, ``predicted_ttft_ms``, ``evaluated`` (one entry per family looked
            at), ``attempts`` (failed so far), ``server_address``.
        metadata: the per-call ``metadata={...}``.

    Returns:
        Nothing (notification; exceptions are logged, never raised).
    """


@notification
@hookspec
def zml_request_headers(
    call: Call, routing: RoutingInfo, headers: dict[str, str], metadata: Mapping[str, Any]
) -> None:
    """Add HTTP headers to the request about to be sent to ``routing.node_id``.

    Called once per attempt, just before it is sent (after :func:`zml_request_routed`), and
    only when some plugin implements it. ``headers`` starts empty for each attempt: put the
    headers to add in it (the built-in OpenTelemetry plugin puts the W3C ``traceparent``
    there, through ``opentelemetry.propagate``). Headers zml sets itself (authorization, the
    node's own key) are kept: an added header of the same name is ignored.

    Args:
        call: the request (see :func:`zml_request_started`).
        routing: the decision for this attempt (its node, family, ``server_address``).
        headers: a fresh dict for this attempt; add ``name: value`` strings to it. A name
            must be an HTTP token and a value printable ASCII (no line breaks): any other
            header is not sent, and is logged once like a plugin's exception.
        metadata: the per-call ``metadata={...}``.

    Returns:
        Nothing (notification; exceptions are logged, never raised).
    """


@notification
@hookspec
def zml_attempt_failed(
    call: Call, attempt: Attempt, error: NodeError, metadata: Mapping[str, Any]
) -> None:
    """An attempt failed before the first token reached the caller.

    Called once per failed attempt, after the node was marked. Another attempt may follow
    (:func:`zml_request_routed` again) or the request may fail.

    Args:
        call: the request.
        attempt: ``node_id``, ``accelerator``, ``error`` (a short kind such as
            ``unavailable``), ``status_code``, ``message``; also in ``routing.attempts``.
        error: the node error (``error.retryable``, ``error.routing``).
        metadata: the per-call ``metadata={...}``.

    Returns:
        Nothing (notification; exceptions are logged, never raised).
    """


@notification
@hookspec
def zml_request_completed(
    call: Call,
    routing: RoutingInfo,
    usage: Mapping[str, Any] | None,
    held_s: float,
    cost: Cost | None,
    metadata: Mapping[str, Any],
) -> None:
    """A request succeeded: the whole answer arrived.

    Called once, as the request's last hook, after :func:`zml_attribute_cost` (with its
    result): for ``infer`` before it returns, for a stream after its last chunk.

    Args:
        call: the request.
        routing: where it went (``response.routing``); ``routing.cost`` is set just after.
        usage: the node's token counts (``prompt_tokens``, ``completion_tokens``,
            ``total_tokens``), or None when the node sent none.
        held_s: seconds the request held its slot on the node.
        cost: the attributed cost, or None.
        metadata: the per-call ``metadata={...}``.

    Returns:
        Nothing (notification; exceptions are logged, never raised).
    """


@notification
@hookspec
def zml_request_failed(call: Call, error: ZMLError, metadata: Mapping[str, Any]) -> None:
    """A request ended with a zml error: RoutingError, a NodeError, ZMLTimeoutError...

    Called once, as the request's last hook, just before the error reaches the caller (for a
    stream: when iterating it raises).

    Args:
        call: the request (``call.attempts``: the failed attempts).
        error: the error raised to the caller; a :class:`zml.RoutingError` carries
            ``routing_context`` (``evaluated``, ``final_error``...).
        metadata: the per-call ``metadata={...}``.

    Returns:
        Nothing (notification; exceptions are logged, never raised).
    """


@notification
@hookspec
def zml_request_cancelled(call: Call, metadata: Mapping[str, Any]) -> None:
    """The caller went away: task cancelled, stream closed early, an error in its own code.

    Called once, as the request's last hook, when the request's slot is released without an
    answer or a zml error (``stream.close()``, leaving the loop early, task cancellation).

    Args:
        call: the request.
        metadata: the per-call ``metadata={...}``.

    Returns:
        Nothing (notification; exceptions are logged, never raised).
    """


@notification
@hookspec
def zml_request_queued(call: Call, policy: str, depth: int, metadata: Mapping[str, Any]) -> None:
    """A request joined its policy's saturation queue (``queue_on_saturation``).

    Called once per request that had to wait for capacity, when it joins the queue (not again
    if it goes back in line after a refused lease). It then either routes
    (:func:`zml_request_routed`, with ``routing.queued_ms``) or ends with a RoutingError
    ``queue_timeout`` or a ZMLTimeoutError.

    Args:
        call: the request.
        policy: the policy's name.
        depth: requests queued for that policy, this one included.
        metadata: the per-call ``metadata={...}``.

    Returns:
        Nothing (notification; exceptions are logged, never raised).
    """


# --- cost attribution --------------------------------------------------------------------------


@notification
@hookspec(firstresult=True)
def zml_attribute_cost(
    call: Call,
    routing: RoutingInfo,
    usage: Mapping[str, Any] | None,
    held_s: float,
    accelerator: AcceleratorConfig | None,
    node: NodeConfig | None,
    metadata: Mapping[str, Any],
) -> Cost | None:
    """The cost of a successful request; it becomes ``response.routing.cost``.

    Called once per successful request, before :func:`zml_request_completed`. **Stops at the
    first non-None result.** The built-in cost model is ``trylast``, so any plugin that returns
    a cost overrides it; return None to leave the request to the next implementation. An
    implementation that raises, or returns something that is not a cost (a mapping that does
    not validate as a :class:`zml.Cost`), is logged and skipped.

    The built-in model: with ``cost_per_1k_tokens`` on the family and token usage reported,
    ``cost_per_1k_tokens × total_tokens / 1000`` (basis ``"tokens"``); else with
    ``cost_per_hour``, the node-seconds the request held one of the node's slots:
    ``cost_per_hour / 3600 × held_s / max_concurrency`` (basis ``"node_seconds"``).

    Args:
        call: the request (``call.metadata`` for chargeback labels).
        routing: where it went: ``node_id``, ``accelerator``, ``policy``...
        usage: the node's token counts, or None.
        held_s: seconds the request held its slot on the node.
        accelerator: the family's ``[accelerators.NAME]`` configuration, if registered.
        node: the serving node's configuration (``max_concurrency``...), if known.
        metadata: the per-call ``metadata={...}`` (team, service...).

    Returns:
        A :class:`zml.Cost` (a mapping of its fields is accepted), or None.
    """


# --- shared fleet state ------------------------------------------------------------------------


@hookspec(firstresult=True)
def zml_slot_ledger(fleet: Fleet, registry: Registry) -> SlotLedger | None:
    """A cross-process slot ledger for a new client's fleet (see :mod:`zml.ledger`).

    Called once when a client is built, after its registry is complete.
    **Stops at the first non-None result.** Without a ledger (the default), capacity is
    accounted in this process only.
    The plugin may keep ``fleet`` to feed it shared state: ``fleet.record_failure(node, now)``
    and ``fleet.record_success(...)`` for shared health and circuit breakers, and
    ``fleet.record_probe(node, now, healthy=..., reported_load=...)`` for the load every
    process holds on a node. An implementation that raises is logged and skipped (the client
    then uses local state).

    Args:
        fleet: the client's :class:`zml.fleet.Fleet` (iterate it for its ``NodeState`` objects).
        registry: the client's fleet registry (families, nodes, policy tables, source file).

    Returns:
        A :class:`zml.ledger.SlotLedger`, or None to leave the fleet process-local.
    """


# --- command line ------------------------------------------------------------------------------


@hookspec
def zml_register_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add subcommands to the ``zml`` command (a notification hook: not ``firstresult``).

    Called once when ``zml`` builds its argument parser. Add a parser with
    ``subparsers.add_parser("name", help=...)`` and give it a handler with
    ``parser.set_defaults(handler=function)``: ``zml`` calls ``handler(args)`` and exits with
    its return value (an int). A :class:`zml.ZMLError` raised by the handler is printed as one
    line, like the built-in commands' errors. A plugin whose hook raises is skipped with a
    warning, and the built-in commands keep working.

    Args:
        subparsers: the ``argparse`` subparsers of the ``zml`` command.

    Returns:
        Nothing; implementations add parsers.
    """
