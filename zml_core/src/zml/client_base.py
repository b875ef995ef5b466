"""What both clients share: configuration, policies, argument checks, the answered call's end.

:class:`BaseClient` finds the configuration, loads the plugins, builds the dispatcher and
checks every argument, once for :class:`zml.Client` and :class:`zml.AsyncClient` alike; the
functions below end a call the same way for both. What differs between sync and async
(sending, waiting, sleeping) is in :mod:`zml.client`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx2
from pydantic import ValidationError

from . import routing
from .config import EMPTY_REGISTRY, Registry, discover_path, load_registry
from .dispatch import Call, Dispatcher, ResponseSummary, Step, Timeouts
from .errors import (
    InvalidRequestError,
    NodeError,
    NodeProtocolError,
    PolicyConfigError,
    closed_client,
)
from .fleet import Fleet
from .policy import Policy, PolicyRef, resolve_policy
from .transport import PostRequests, map_transport_error, still_sending
from .types import ChatCompletion, RoutingInfo
from .validation import check_timeout
from .watchdog import Watch

if TYPE_CHECKING:
    from .plugins.manager import PluginManager

__all__ = [
    "DEFAULT_TIMEOUT",
    "ENV_API_KEY",
    "NOT_GIVEN",
    "BaseClient",
    "NotGiven",
    "answer_deadline",
    "check_probe_interval",
    "finish",
    "read_failure",
    "validated_completion",
]

ENV_API_KEY = "ZML_API_KEY"
DEFAULT_TIMEOUT = 600.0


class NotGiven:
    """The type of :data:`NOT_GIVEN`: "use the client's default", so that None can mean None."""

    _instance: NotGiven | None = None

    def __new__(cls) -> NotGiven:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOT_GIVEN"

    def __bool__(self) -> bool:
        return False


NOT_GIVEN = NotGiven()

class BaseClient:
    """Configuration, policies and argument handling shared by both clients."""

    def __init__(
        self,
        api_key: str | None,
        config: str | os.PathLike[str] | Registry | None,
        timeout: float | Timeouts | None,
        max_attempts: int,
        fleet: Fleet | None,
    ) -> None:
        key_param = "api_key"
        if api_key is None:
            api_key = os.environ.get(ENV_API_KEY)
            key_param = ENV_API_KEY
        if api_key is not None and not isinstance(api_key, str):
            raise InvalidRequestError(
                f"api_key must be a string, got {type(api_key).__name__}", param="api_key"
            )
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise InvalidRequestError(
                f"max_attempts must be a positive integer, got {max_attempts!r}",
                param="max_attempts",
            )
        if fleet is not None and not isinstance(fleet, Fleet):
            raise InvalidRequestError(
                f"fleet must be a zml.fleet.Fleet (another client's .fleet), got "
                f"{type(fleet).__name__}",
                param="fleet",
            )
        timeouts = Timeouts.of(timeout)
        # Plugins load here, on first client use, never at ``import zml``.
        from .plugins.fleet_sources import build_registry, slot_ledger
        from .plugins.manager import client_manager
        from .plugins.policy_sources import SourcePolicies

        self._plugins = client_manager()
        if fleet is not None:
            if config is not None:
                raise InvalidRequestError(
                    "pass either config= or fleet=, not both: a shared fleet brings its registry",
                    param="fleet",
                )
            registry = fleet.registry
        else:
            if isinstance(config, Registry):
                file_config = config
            else:
                path = discover_path(config)
                file_config = load_registry(path) if path is not None else EMPTY_REGISTRY
            registry = build_registry(self._plugins, file_config)
        policies = SourcePolicies(self._plugins, registry)
        self._closed = False
        """Set by close()/aclose(): a new call is refused with a ClientConfigError."""
        self._dispatcher = Dispatcher(
            registry,
            policies,
            api_key=api_key,
            api_key_param=key_param,
            timeouts=timeouts,
            max_attempts=max_attempts,
            fleet=fleet,
            plugins=self._plugins,
        )
        if fleet is None:
            self.fleet.ledger = slot_ledger(self._plugins, self.fleet, registry)
        self._urls: dict[str, httpx2.URL] = {}
        self._posts: PostRequests
        """Set by the subclass, with its HTTP client."""

    def _request(self, call: Call, step: Step) -> httpx2.Request:
        """``step``'s request: the call's body, to its node, with its headers.

        The node's URL is parsed once per client (one entry per node it sends to): httpx2
        parses a string URL on every request, about 10 µs. The headers are merged with the
        HTTP client's defaults once per header dict (:class:`zml.transport.PostRequests`).
        """
        url = self._urls.get(step.url)
        if url is None:
            url = self._urls[step.url] = httpx2.URL(step.url)
        headers, reuse = call.headers_for(step)
        return self._posts.build(url, call.body, headers, step.timeout, reuse=reuse)

    def __repr__(self) -> str:
        reg = self._dispatcher.registry
        return (
            f"{type(self).__name__}(config={reg.source!r}, families={list(reg.families)}, "
            f"nodes={len(reg.nodes)})"
        )

    @property
    def registry(self) -> Registry:
        """The fleet registry this client routes over (families, nodes, policy tables)."""
        return self._dispatcher.registry

    @property
    def plugins(self) -> PluginManager:
        """This client's plugin manager (pluggy): a copy of the process-wide plugins.

        ``client.plugins.register(obj)`` adds an in-code plugin to this client only (its
        telemetry, cost and policy-source hooks apply at once; fleet sources are read when a
        client is built, so register those with ``zml.plugins.register`` beforehand).
        ``client.plugins.unregister(name="zml.otel")`` removes one, here the built-in tracing.
        """
        return self._plugins

    @property
    def fleet(self) -> Fleet:
        """Live fleet state: per-node load, health, circuit, latency estimates.

        Hand it to another client (``zml.Client(fleet=client.fleet)``) to share capacity
        accounting on purpose; clients built separately never share it.
        """
        return self._dispatcher.fleet

    @property
    def policies(self) -> Mapping[str, Policy]:
        """The named policies this client knows (``[policies.NAME]`` and policy sources)."""
        return self._dispatcher.policies

    def policy(self, ref: PolicyRef) -> Policy:
        """Resolve a policy name, dict or Policy against this client's registry.

        ``client.policy({"name": "p", "accelerator_chain": ["H100"]})`` builds a Policy
        validated against this client's families (rather than the default registry that
        ``zml.Policy(...)`` uses).
        """
        policy = resolve_policy(ref, self.registry, self.policies)
        if policy is None:
            raise PolicyConfigError(
                "policy must be a zml.Policy, a policy name or a dict, got None",
                field="policy",
                value=None,
            )
        return policy

    def explain(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]] | None = None,
        policy: PolicyRef | None = None,
        accelerator: str | None = None,
    ) -> routing.Decision | routing.NoRoute:
        """The routing decision this client would make now, without sending or reserving.

        Args:
            model: the model name.
            messages: the chat (optional): when given, validated, and the decision is the one
                for this prompt (its prefill counts in ``predicted_ttft_ms``, its prefix under
                ``affinity = "prefix"``), as ``infer`` would route it.
            policy: a Policy, a configured policy's name, or a dict (None: the 0.2 behaviour).
            accelerator: pin one family instead of a policy.

        Returns:
            A :class:`zml.routing.Decision` (``.node``, ``.predicted_ttft_ms``, ``.evaluated``)
            or a :class:`zml.routing.NoRoute` (``.context()`` is what a RoutingError would
            carry).

        Raises:
            PolicyConfigError: the policy is invalid for this client's registry.
            InvalidRequestError: a bad argument.
        """
        if not isinstance(model, str) or not model.strip():
            raise InvalidRequestError(
                f"model must be a non-empty model name, got {model!r}", param="model"
            )
        if messages is not None:
            from .dispatch import validate_messages

            validate_messages(messages)
        resolved = resolve_policy(policy, self.registry, self.policies)
        _one_routing_mode(resolved, accelerator)
        return self._dispatcher.explain(resolved, model, accelerator, messages)

    def _call(
        self,
        model: str,
        messages: Sequence[Mapping[str, Any]],
        policy: PolicyRef | None,
        accelerator: str | None,
        params: dict[str, Any],
        stream: bool,
        metadata: Mapping[str, Any] | None,
        timeout: float | Timeouts | NotGiven | None,
    ) -> Call:
        if self._closed:
            raise closed_client(type(self).__name__)
        timeouts = (
            self._dispatcher.timeouts if isinstance(timeout, NotGiven) else Timeouts.of(timeout)
        )
        if "stream" in params:
            raise InvalidRequestError(
                "pass no 'stream' parameter: use infer() for one answer, infer_stream() to stream",
                param="stream",
            )
        resolved = resolve_policy(policy, self.registry, self.policies)
        _one_routing_mode(resolved, accelerator)
        return self._dispatcher.start(
            model=model,
            messages=messages,
            policy=resolved,
            accelerator=accelerator,
            params=params,
            stream=stream,
            metadata=metadata,
            timeouts=timeouts,
        )


def validated_completion(data: dict[str, Any], routing: RoutingInfo, node_id: str) -> ChatCompletion:
    data["routing"] = routing
    try:
        return ChatCompletion.model_validate(data)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"])
        where = where.lstrip(".") or "the answer"
        what = f"{where} is missing" if err["type"] == "missing" else \
            f"{where} ({type(err.get('input')).__name__}): {err['msg']}"  # (not its value)
        raise NodeProtocolError(
            f"node {node_id!r} returned a malformed chat completion: {what}",
            node_id=node_id,
            routing=routing,
        ) from None


def _one_routing_mode(policy: Policy | None, accelerator: str | None) -> None:
    if policy is not None and accelerator is not None:
        raise InvalidRequestError(
            "pass either policy= or accelerator=, not both: accelerator= pins one family "
            "(the 0.2 style), a policy gives a chain",
            param="accelerator",
        )


def check_http_client(value: object, expected: type, kind: str) -> None:
    """``http_client`` is None or an ``expected`` (``httpx2.Client`` for the sync client,
    ``httpx2.AsyncClient`` for the async one)."""
    if value is not None and not isinstance(value, expected):
        other = httpx2.AsyncClient if expected is httpx2.Client else httpx2.Client
        hint = f" (an httpx2.{other.__name__} belongs to the other kind of zml client)" \
            if isinstance(value, other) else ""
        raise InvalidRequestError(
            f"http_client must be an httpx2.{expected.__name__} for a zml.{kind}, got "
            f"{type(value).__name__}{hint}",
            param="http_client",
        )


def check_probe_interval(interval_s: object) -> None:
    """A probe interval follows the timeout rule (:func:`zml.validation.check_timeout`): a
    positive number of seconds, at most a year."""
    if interval_s is None:
        raise InvalidRequestError(
            "probe_interval_s must be a number of seconds here (pass probe_interval_s=None to "
            "the client instead, for no probing)", param="probe_interval_s")
    check_timeout(interval_s, "probe_interval_s")


def answer_deadline(call: Call, step: Step) -> float | None:
    """When a non-streamed attempt's whole answer must be in, on the dispatcher's clock: the
    request's deadline, or sooner the attempt's own limit from now (its read timeout:
    ``Timeouts.first_token``, else its share of the time left; see
    ``_attempt_timeout`` in :mod:`zml.dispatch.flow`). The watchdog and the body's reader hold it
    however the node paces its bytes: a read timeout alone restarts with every byte, so a node
    dripping its answer would keep the attempt until the request's deadline."""
    deadline = call.deadline
    bound = step.timeout.get("read")
    if bound is None:
        return deadline
    until = call.d.clock() + bound
    return until if deadline is None or until < deadline else deadline


def read_failure(exc: httpx2.HTTPError | NodeError, watch: Watch | None,
                  node_id: str) -> BaseException:
    """The error to raise for a failure while reading a whole answer: the deadline's, when the
    watchdog shut the response down; a zml error as it is; a transport error mapped."""
    if watch is not None and watch.fired:
        return still_sending(node_id)
    if isinstance(exc, NodeError):
        return exc
    return map_transport_error(exc, node_id)


def finish(call: Call, step: Step, data: dict[str, Any]) -> ChatCompletion:
    """The answered call's ChatCompletion; the call ends here, one way or the other."""
    try:
        completion = validated_completion(data, step.routing, step.node.id)
    except BaseException as exc:
        call.ended(exc)
        raise
    choices = completion.choices
    reason = choices[0].finish_reason if choices else None
    reasons = tuple(c.finish_reason for c in sorted(choices, key=lambda c: c.index)
                    if c.finish_reason)
    usage = completion.usage
    # hooks get the counts the caller sees (checked), not the node's own dict
    call.succeeded(step, None if usage is None else usage.model_dump(),
                   ResponseSummary(completion.id, completion.model, reason, reasons))
    return completion
