"""The :class:`Dispatcher`: what both clients share — registry, fleet, policies, settings.

It validates a request into a frozen :class:`~.request.Request` and hands drivers a
:class:`~.drivers.Call`. It owns the :class:`~.effects.Effects` (clock, random source,
saturation queues, plugin hooks) and uses the fleet it is given; nothing here is shared with
another dispatcher unless it was handed the same fleet.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .. import routing
from ..config import Registry, node_api_key, suggest
from ..errors import InvalidRequestError, answer_scrubber
from ..fleet import Fleet
from ..policy import Policy
from ..prefix import blocks_of_body
from ..transport import auth_headers
from ..validation import check_accelerator
from .drivers import Call
from .effects import Effects
from .flow import MAX_ATTEMPTS, FlowSettings
from .request import Request, Timeouts, build_body, frozen_metadata

if TYPE_CHECKING:
    from ..plugins.manager import PluginManager

__all__ = ["Dispatcher"]


class Dispatcher:
    """Validates requests and runs their flows against one fleet."""

    def __init__(
        self,
        registry: Registry,
        policies: Mapping[str, Policy],
        *,
        api_key: str | None,
        api_key_param: str = "api_key",
        timeouts: Timeouts,
        max_attempts: int = MAX_ATTEMPTS,
        fleet: Fleet | None = None,
        plugins: PluginManager | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.policies = policies
        self.fleet: Fleet = fleet if fleet is not None else Fleet(registry)
        self.timeouts = timeouts
        self.max_attempts = max_attempts
        self.clock = clock
        self.effects: Effects = Effects(self.fleet, clock=clock, rng=rng, plugins=plugins)
        self.headers: dict[str, str] = auth_headers(api_key, param=api_key_param)
        self.node_headers: dict[str, dict[str, str]] = {}
        """Headers for nodes with their own key (``api_key_env``), by node id."""
        for node in registry.nodes:
            if node.api_key_env:
                key = node_api_key(node)
                self.node_headers[node.id] = auth_headers(key, param=f"${node.api_key_env}")
        self.fleet.add_capacity_listener(self.effects.queues.wake_heads)
        self._answer_scrubber: tuple[tuple[str, ...], Callable[[dict[str, Any]], None] | None] \
            = ((), None)
        """The last credentials an answer was scrubbed of, and their scrubber."""
        self.closed_by: str | None = None
        """Set by :meth:`close` to the closing client's kind ("Client", "AsyncClient"): calls
        still in flight then end with :func:`zml.errors.closed_client`."""

    def answer_scrubber(self, secrets: tuple[str, ...]
                        ) -> Callable[[dict[str, Any]], None] | None:
        """:func:`zml.errors.answer_scrubber` for ``secrets``, built once for the credentials
        a client sends on every request (kept for the last ones only)."""
        last = self._answer_scrubber
        if last[0] != secrets:
            last = self._answer_scrubber = (secrets, answer_scrubber(secrets))
        return last[1]

    @property
    def rng(self) -> random.Random:
        """The random source routing breaks ties with."""
        return self.effects.rng

    def settings(self) -> FlowSettings:
        """What a new flow needs to know of this dispatcher."""
        return FlowSettings(max_attempts=self.max_attempts,
                            leases=self.fleet.ledger is not None)

    def start(
        self,
        *,
        model: str,
        messages: object,
        policy: Policy | None,
        accelerator: str | None,
        params: Mapping[str, Any],
        stream: bool,
        metadata: Mapping[str, Any] | None,
        timeouts: Timeouts,
    ) -> Call:
        """Validate one request and return its :class:`Call` (nothing is sent yet)."""
        self.check_accelerator(accelerator)
        body, prompt_chars = build_body(model, messages, params, stream=stream)
        request = Request(
            model=model,
            policy=policy,
            accelerator=accelerator,
            body=body,
            stream=stream,
            metadata=frozen_metadata(metadata),
            timeouts=timeouts,
            started_at=self.clock(),
            prompt_chars=prompt_chars,
        )
        call = Call(self, request)
        call.notify_started()
        return call

    def check_accelerator(self, accelerator: object) -> None:
        """Raise InvalidRequestError unless ``accelerator`` is None or a registered family."""
        if check_accelerator(accelerator) is None:
            return
        families = self.registry.families
        if accelerator not in families:
            hint = suggest(str(accelerator), families)
            raise InvalidRequestError(
                f"accelerator={accelerator!r} is not a registered family (registered: "
                + (", ".join(families) or "none")
                + ")"
                + (f"; did you mean {hint!r}?" if hint else ""),
                param="accelerator",
            )

    def explain(
        self, policy: Policy | None, model: str, accelerator: str | None = None,
        messages: object = None,
    ) -> routing.Decision | routing.NoRoute:
        """The decision routing would make now, without reserving anything; with
        ``messages``, for that prompt (its prefill, and its prefix under ``affinity =
        "prefix"``), as ``infer`` would route it."""
        self.check_accelerator(accelerator)
        tokens = 0
        blocks: tuple[str, ...] = ()
        if messages is not None:
            body, chars = build_body(model, messages, {}, stream=False)
            tokens = routing.prompt_tokens_from_chars(chars)
            if policy is not None and policy.affinity == "prefix":
                blocks = blocks_of_body(body)
        fleet = self.fleet
        with fleet.lock:
            now = self.clock()
            fleet.refresh(now)
            return routing.route(
                policy, model, fleet, now=now, rng=self.rng, pinned_family=accelerator,
                health_threshold=policy.health_threshold if policy is not None else 0.5,
                prompt_tokens=tokens, prefix_blocks=blocks,
            )

    def close(self, kind: str = "client") -> None:
        """Stop listening to the fleet (a shared fleet outlives this dispatcher); calls in
        flight see :attr:`closed_by`, and those waiting in a saturation queue are woken to see
        it."""
        self.closed_by = kind
        self.fleet.remove_capacity_listener(self.effects.queues.wake_heads)
        self.effects.queues.wake_all()
