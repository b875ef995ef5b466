"""Plain spec objects for simulated nodes, and the latency profile of each accelerator family.

A simulated node is described by data only (`SimNodeSpec`, `FaultSpec`), so a fleet can be
declared in a test, in `zml.toml` or on the command line and rebuilt identically.

When a spec leaves `ttft_ms` / `tokens_per_s` unset, the node takes its family's profile
(`zml.sim.profiles`: derived from public datasheet figures for a Llama-3.1-8B-class model; see
docs/concepts/sim-model.md). `performance` is the spec's whole profile: `profile_overrides`
(e.g. a family's `[accelerators.NAME.sim]` table) over the built-in profile of the family, then
the spec's own `ttft_ms` / `tokens_per_s`.

Family names match exactly first, then case-insensitively.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from zml.sim.profiles import DEFAULT_PROFILE as _DEFAULT, PROFILES, FamilyProfile, profile_for

__all__ = ["DEFAULT_PROFILE", "FAMILY_PROFILES", "NODE_KINDS", "FaultSpec", "SimNodeSpec", "family_profile"]

FAMILY_PROFILES: Mapping[str, tuple[float, float]] = MappingProxyType(
    {name: (p.ttft_ms, p.tokens_per_s) for name, p in PROFILES.items()}
)
"""(ttft_ms, tokens_per_s) per accelerator family: the fixed TTFT and one-sequence decode
speed of its `zml.sim.profiles` profile."""

DEFAULT_PROFILE: tuple[float, float] = (_DEFAULT.ttft_ms, _DEFAULT.tokens_per_s)
"""Profile of a family that is not in `FAMILY_PROFILES`."""

NODE_KINDS: frozenset[str] = frozenset({"vllm", "sglang", "tgi", "llamacpp", "openai"})
"""Backend kinds a simulated node can imitate on `/metrics`."""

def family_profile(family: str) -> tuple[float, float]:
    """Return the default `(ttft_ms, tokens_per_s)` of an accelerator family.

    Unknown families get `DEFAULT_PROFILE`, a middling node.
    """
    p = profile_for(family)
    return (p.ttft_ms, p.tokens_per_s)


def _check_rate(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be within [0, 1], got {value!r}")


@dataclass(frozen=True)
class FaultSpec:
    """Faults a simulated node injects; every rate is a fraction of requests in [0, 1].

    Which requests are hit is decided by a random generator seeded with `seed`, so a given
    sequence of arrivals meets the same faults on every run.
    """

    error_rate: float = 0.0
    """Fraction of chat requests answered at once with `error_status` and an OpenAI error body."""
    error_status: int = 503
    """HTTP status of injected errors (4xx or 5xx)."""
    retry_after_s: float | None = None
    """When set, injected 429/503 errors carry `Retry-After` (whole seconds, rounded up) and
    `retry-after-ms`. Not scaled by the node's time_scale: it is advice to the client."""
    drop_rate: float = 0.0
    """Fraction of requests whose connection is dropped: streams after a few chunks (no
    `[DONE]`), non-streamed requests after the status line and before the body."""
    stall_s: float = 0.0
    """Extra delay before the first byte (a slow time to first token), holding the slot."""
    malformed_rate: float = 0.0
    """Fraction of streams that carry one SSE event whose `data:` is not valid JSON."""
    seed: int = 0
    """Seed of the generator that picks which requests meet a fault."""

    def __post_init__(self) -> None:
        _check_rate("error_rate", self.error_rate)
        _check_rate("drop_rate", self.drop_rate)
        _check_rate("malformed_rate", self.malformed_rate)
        if not 400 <= self.error_status <= 599:
            raise ValueError(f"error_status must be a 4xx or 5xx status, got {self.error_status!r}")
        if self.stall_s < 0:
            raise ValueError(f"stall_s must be >= 0, got {self.stall_s!r}")
        if self.retry_after_s is not None and self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s!r}")


@dataclass(frozen=True)
class SimNodeSpec:
    """One simulated inference node: identity, models, capacity, speed, faults and backend kind."""

    id: str
    """Node id, unique within a fleet."""
    family: str
    """Accelerator family name, e.g. "H100"; picks the default latency profile."""
    models: tuple[str, ...]
    """Model names the node serves (a list is accepted and stored as a tuple)."""
    max_concurrency: int
    """Requests generating at once (slots)."""
    queue_size: int = 64
    """Requests that may wait for a slot; past that the node answers 503 at once."""
    ttft_ms: float | None = None
    """Time to first token in ms; None takes the family profile."""
    tokens_per_s: float | None = None
    """Decode speed; None takes the family profile."""
    faults: FaultSpec = field(default_factory=FaultSpec)
    """Faults injected from the start (they can be replaced at runtime)."""
    kind: str = "vllm"
    """Backend imitated on `/metrics`: vllm | sglang | tgi | llamacpp | openai (no /metrics)."""
    api_key: str | None = None
    """When set, chat requests need `Authorization: Bearer <api_key>` (else 401)."""
    profile_overrides: FamilyProfile | Mapping[str, object] | None = None
    """A whole profile, or some of its fields, replacing the family's built-in profile
    (`ttft_ms` / `tokens_per_s` above still win)."""

    def __post_init__(self) -> None:
        if not isinstance(self.models, tuple):
            object.__setattr__(self, "models", tuple(self.models))
        if not self.id:
            raise ValueError("id must be a non-empty string")
        if not self.models:
            raise ValueError(f"node {self.id!r}: models must not be empty")
        if self.max_concurrency < 1:
            raise ValueError(f"node {self.id!r}: max_concurrency must be >= 1")
        if self.queue_size < 0:
            raise ValueError(f"node {self.id!r}: queue_size must be >= 0")
        if self.ttft_ms is not None and self.ttft_ms < 0:
            raise ValueError(f"node {self.id!r}: ttft_ms must be >= 0")
        if self.tokens_per_s is not None and self.tokens_per_s <= 0:
            raise ValueError(f"node {self.id!r}: tokens_per_s must be > 0")
        if self.kind not in NODE_KINDS:
            raise ValueError(
                f"node {self.id!r}: kind must be one of {sorted(NODE_KINDS)}, got {self.kind!r}"
            )

    @property
    def performance(self) -> FamilyProfile:
        """The node's whole performance profile (see the module docstring)."""
        base = profile_for(self.family)
        extra = self.profile_overrides
        if isinstance(extra, FamilyProfile):
            base = extra
        elif extra is not None:
            base = base.with_overrides(extra)
        return base.with_overrides({"ttft_ms": self.ttft_ms, "tokens_per_s": self.tokens_per_s})

    @property
    def profile(self) -> tuple[float, float]:
        """The effective `(ttft_ms, tokens_per_s)`: explicit values, else the family's."""
        p = self.performance
        return (p.ttft_ms, p.tokens_per_s)
