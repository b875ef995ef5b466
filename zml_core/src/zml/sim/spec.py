"""Plain spec objects for simulated nodes, and the latency profile of each accelerator family.

A simulated node is described by data only (`SimNodeSpec`, `FaultSpec`), so a fleet can be
declared in a test, in `zml.toml` or on the command line and rebuilt identically.

When a spec leaves `ttft_ms` / `tokens_per_s` unset, the node takes its family's profile.
The numbers are rough single-request figures for an 8B-class model at moderate load, chosen so
that the families order the way operators expect (faster and dearer first):

| family     | time to first token (ms) | decode tokens/s |
| ---------- | ------------------------ | --------------- |
| B200       | 40                       | 220             |
| H200       | 50                       | 180             |
| H100       | 60                       | 150             |
| MI300X     | 80                       | 120             |
| H100_PCIe  | 110                      | 90              |
| A100       | 120                      | 80              |
| L40S       | 160                      | 60              |
| A10G       | 220                      | 40              |
| L4         | 250                      | 35              |
| T4         | 400                      | 20              |
| (other)    | 150                      | 70              |

Family names match exactly first, then case-insensitively.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DEFAULT_PROFILE", "FAMILY_PROFILES", "NODE_KINDS", "FaultSpec", "SimNodeSpec", "family_profile"]

FAMILY_PROFILES: dict[str, tuple[float, float]] = {
    "B200": (40.0, 220.0),
    "H200": (50.0, 180.0),
    "H100": (60.0, 150.0),
    "MI300X": (80.0, 120.0),
    "H100_PCIe": (110.0, 90.0),
    "A100": (120.0, 80.0),
    "L40S": (160.0, 60.0),
    "A10G": (220.0, 40.0),
    "L4": (250.0, 35.0),
    "T4": (400.0, 20.0),
}
"""(ttft_ms, tokens_per_s) per accelerator family; see the module docstring."""

DEFAULT_PROFILE: tuple[float, float] = (150.0, 70.0)
"""Profile of a family that is not in `FAMILY_PROFILES`."""

NODE_KINDS: frozenset[str] = frozenset({"vllm", "sglang", "tgi", "llamacpp", "openai"})
"""Backend kinds a simulated node can imitate on `/metrics`."""

_LOWER_PROFILES = {name.lower(): profile for name, profile in FAMILY_PROFILES.items()}


def family_profile(family: str) -> tuple[float, float]:
    """Return the default `(ttft_ms, tokens_per_s)` of an accelerator family.

    Unknown families get `DEFAULT_PROFILE`, a middling node.
    """
    profile = FAMILY_PROFILES.get(family)
    if profile is None:
        profile = _LOWER_PROFILES.get(family.lower(), DEFAULT_PROFILE)
    return profile


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
    def profile(self) -> tuple[float, float]:
        """The effective `(ttft_ms, tokens_per_s)`: explicit values, else the family's."""
        ttft, tps = family_profile(self.family)
        return (
            ttft if self.ttft_ms is None else self.ttft_ms,
            tps if self.tokens_per_s is None else self.tokens_per_s,
        )
