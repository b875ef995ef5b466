"""One node's static description and live state (``NodeState``), and the mark a load probe
takes of it (``LoadMark``).

The state is changed only by the :class:`zml.fleet.Fleet` it belongs to, under that fleet's
lock; see :mod:`zml.fleet` for the rules it follows.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

from .config import NodeConfig
from .node_urls import redact_url
from .transport import completion_url

if TYPE_CHECKING:
    from .fleet import Fleet

__all__ = ["LoadMark", "NodeState"]


class NodeState:
    """One node's static description and live state (satisfies ``routing.NodeView``)."""

    __slots__ = (
        "__weakref__",
        "address",
        "completion_url",
        "config",
        "consecutive_failures",
        "family",
        "fleet",
        "health",
        "health_at",
        "id",
        "in_flight",
        "kind",
        "load",
        "max_concurrency",
        "max_queue",
        "models",
        "observed_ttft_ms",
        "open_until",
        "prefill_tokens",
        "released",
        "reported_at",
        "reported_load",
        "service_ms",
        "tokens_in_flight",
        "trial_in_flight",
        "ttft_ms",
        "url",
    )

    tokens_in_flight: int
    """Prompt tokens of this client's requests in flight on the node (set by the Fleet)."""
    prefill_tokens: int
    """Prompt tokens of this client's requests on the node that have no first token yet: the
    prefill ahead of a new request (set by the Fleet; see :meth:`Fleet.first_token`)."""

    def __init__(self, config: NodeConfig, fleet: Fleet) -> None:
        self.config: NodeConfig = config
        self.fleet: Fleet = fleet
        """The fleet this node's state belongs to (its lock guards every field below)."""
        self.id: str = config.id
        self.family: str = config.family
        self.url: str = config.url
        self.address: str = _address(redact_url(config.url))
        """host:port[/path] of the node, as shown in routing metadata and telemetry (the port
        is the scheme's, 80 or 443, when the URL names none)."""
        self.completion_url: str = completion_url(config.url)
        self.models: frozenset[str] = frozenset(config.models)
        self.kind = config.kind
        self.max_concurrency: int = config.max_concurrency
        self.max_queue: int = config.max_queue
        self.in_flight: int = 0
        self.released: int = 0
        """How many of this client's requests on the node have ended (only grows; a probe
        reads it to tell which of the requests its report counted are gone since)."""
        self.reported_load: int | None = None
        self.reported_at: float = 0.0
        self.load: int = 0
        self.health: float = 1.0
        self.health_at: float = 0.0
        self.ttft_ms: float | None = None
        """Base TTFT routing predicts from: EWMA of observed TTFT less its explained part
        (streamed calls only: a whole answer shows no first token)."""
        self.observed_ttft_ms: float | None = None
        """EWMA of the observed TTFT, as streamed calls saw it."""
        self.service_ms: float | None = None
        self.consecutive_failures: int = 0
        self.open_until: float | None = None
        self.trial_in_flight: bool = False

    def __repr__(self) -> str:
        return (
            f"NodeState(id={self.id!r}, family={self.family!r}, load={self.load}/"
            f"{self.max_concurrency}, health={self.health:.2f})"
        )

    def circuit_allows(self, now: float) -> bool:
        """False while the circuit is open, and while a half-open trial is under way."""
        if self.open_until is None:
            return True
        return now >= self.open_until and not self.trial_in_flight

    @property
    def latency_ms(self) -> float | None:
        """The observed TTFT (``observed_ttft_ms``: an EWMA, weight ``EWMA_ALPHA``, of
        streamed calls) as ``zml.strategies.Candidate`` reads it."""
        return self.observed_ttft_ms

    @property
    def circuit_state(self) -> str:
        """``closed``, ``open`` or ``half_open`` as last updated: ``open`` until a trial is
        reserved, even after the cooldown (:meth:`circuit_at` reads the clock)."""
        if self.open_until is None:
            return "closed"
        return "half_open" if self.trial_in_flight else "open"

    def circuit_at(self, now: float) -> str:
        """The circuit at ``now``: ``closed``; ``open`` during the cooldown; ``half_open``
        once it is over (it admits one trial) or while the trial is under way."""
        until = self.open_until
        if until is None:
            return "closed"
        return "half_open" if self.trial_in_flight or now >= until else "open"

    def _update_load(self) -> None:
        reported = self.reported_load
        self.load = self.in_flight if reported is None else max(self.in_flight, reported)


class LoadMark(NamedTuple):
    """How many of this client's requests on a node had ended when a probe asked the node for
    its load (:meth:`zml.fleet.Fleet.load_mark`), so that the report can be taken less those
    that end before it arrives (see :meth:`zml.fleet.Fleet.record_probe`)."""

    released: int
    """``NodeState.released`` then."""


_DEFAULT_PORTS = MappingProxyType({"http": 80, "https": 443})


def _address(url: str) -> str:
    """``url`` without its scheme, with the port made explicit: ``https://n1.example/v1`` is
    ``n1.example:443/v1`` (telemetry's ``server.port`` is read from it)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    host, colon, port = netloc.rpartition(":")
    has_port = bool(colon) and port.isdigit() and host.startswith("[") == host.endswith("]")
    default = _DEFAULT_PORTS.get(scheme.lower())
    if has_port or default is None or not netloc:
        return rest
    return f"{netloc}:{default}{slash}{path}"
