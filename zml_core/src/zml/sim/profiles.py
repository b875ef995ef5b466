"""Performance profiles of accelerator families, for the node model of :mod:`zml.sim.model`.

A simulated node (live or in replay) behaves like one vLLM server running one
Llama-3.1-8B-class model in BF16 on one accelerator. Its behaviour comes from six figures, the
fields of :class:`FamilyProfile`. The built-in profiles are *derived* from public hardware
figures by the formulas below, so that every number can be traced to its source and changed
in ``zml.toml`` (``[accelerators.NAME.sim]`` for a family, ``[nodes.sim]`` for one node).

The model (Llama-3.1-8B, from its published ``config.json``): 8.03 B parameters, 16.06 GB of
BF16 weights, 32 layers, 8 key-value heads of dimension 128, so one token of KV cache takes
2 (K and V) x 32 x 8 x 128 x 2 bytes = 131,072 bytes.

Derivations, per family, from the memory bandwidth ``B``, the dense BF16 throughput ``F`` and
the memory ``M`` of the vendor's datasheet:

* ``tokens_per_s`` (decode, one sequence): decode is memory-bound, one step reads every weight
  once: ``B x DECODE_BANDWIDTH_EFFICIENCY / 16.06 GB``;
* ``prefill_tokens_per_s``: prefill is compute-bound, 2 FLOPs per parameter per token:
  ``F x PREFILL_MFU / (2 x 8.03e9)``;
* ``context_ms_per_1k_tokens``: each decode step also reads the KV cache of every running
  sequence: ``1000 x 131,072 B / (B x DECODE_BANDWIDTH_EFFICIENCY)``;
* ``kv_cache_tokens``: vLLM keeps ``gpu_memory_utilization`` (default 0.9) of the memory and
  gives what the weights leave to the KV cache: ``(0.9 x M - 16.06 GB) / 131,072 B``;
* ``batch_slowdown``: ``BATCH_SLOWDOWN`` for every family;
* ``ttft_ms``: ``OVERHEAD_MS`` (``CPU_OVERHEAD_MS`` on CPU).

The sources and the full table are in the documentation (docs/concepts/sim-model.md).
Family names match exactly first, then case-insensitively; an unknown family gets
``DEFAULT_PROFILE`` (the A100's).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any

__all__ = [
    "BATCH_SLOWDOWN",
    "DECODE_BANDWIDTH_EFFICIENCY",
    "DEFAULT_PROFILE",
    "HARDWARE",
    "KV_BYTES_PER_TOKEN",
    "MODEL_PARAMS",
    "MODEL_WEIGHT_BYTES",
    "OVERHEAD_MS",
    "PREFILL_MFU",
    "PROFILES",
    "FamilyProfile",
    "Hardware",
    "derive_profile",
    "profile_for",
]

MODEL_PARAMS = 8.03e9
"""Parameters of Llama-3.1-8B."""
MODEL_WEIGHT_BYTES = 16.06e9
"""Its BF16 weights in bytes."""
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
"""KV cache per token: K and V, 32 layers, 8 KV heads of 128, 2 bytes (131,072)."""
GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default share of accelerator memory it may use."""
DECODE_BANDWIDTH_EFFICIENCY = 0.77
"""Share of the memory bandwidth a single-sequence decode step achieves (measured on an A100
with vLLM: about 77% of the bandwidth ceiling)."""
PREFILL_MFU = 0.45
"""Share of the dense BF16 peak that prefill achieves (an assumption; see the docs)."""
BATCH_SLOWDOWN = 0.03
"""Decode step time added per extra running sequence, as a share of the one-sequence step
(from the same A100 sweep: 8 concurrent sequences gave 6.6x the throughput of one)."""
OVERHEAD_MS = 10.0
"""Fixed part of the time to first token: HTTP, tokenization, scheduling (an assumption)."""
CPU_OVERHEAD_MS = 20.0
"""The same on a CPU node (an assumption)."""
_CPU_BANDWIDTH_EFFICIENCY = 0.5
_CPU_MFU = 0.1
_GIB = 2**30


@dataclass(frozen=True, slots=True)
class FamilyProfile:
    """The six figures that make a simulated node behave like one accelerator running the model.

    Every field can be set in ``zml.toml`` under ``[accelerators.NAME.sim]`` (the family) or
    ``[nodes.sim]`` (one node), which wins over the family.
    """

    ttft_ms: float
    """Fixed part of the time to first token (an idle node, a fully cached prompt), in ms."""
    tokens_per_s: float
    """Decode speed of one sequence running alone with a short context (tokens/s)."""
    prefill_tokens_per_s: float
    """Prompt tokens prefilled per second (uncached tokens only)."""
    batch_slowdown: float
    """Decode step time added per extra running sequence, as a share of the one-sequence step."""
    context_ms_per_1k_tokens: float
    """Decode step time added per 1,000 tokens of context held by the running sequences (ms)."""
    kv_cache_tokens: int
    """KV cache budget in tokens: running sequences reserve prompt + output, cached prefix blocks
    use what is left."""

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "batch_slowdown", "context_ms_per_1k_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("tokens_per_s", "prefill_tokens_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.kv_cache_tokens < 1:
            raise ValueError(f"kv_cache_tokens must be >= 1, got {self.kv_cache_tokens!r}")

    def with_overrides(self, overrides: Mapping[str, Any] | Any) -> FamilyProfile:
        """This profile with every non-None field of ``overrides`` (a mapping or an object
        with the same attribute names, e.g. a ``[nodes.sim]`` table) replacing its own."""
        changes: dict[str, Any] = {}
        for f in fields(self):
            value = (overrides.get(f.name) if isinstance(overrides, Mapping)
                     else getattr(overrides, f.name, None))
            if value is not None:
                changes[f.name] = value
        return replace(self, **changes) if changes else self


@dataclass(frozen=True, slots=True)
class Hardware:
    """Datasheet figures of one accelerator (see the docs for each source)."""

    bandwidth_gb_s: float
    """Memory bandwidth, GB/s."""
    bf16_tflops: float
    """Dense (not sparse) BF16 tensor throughput, TFLOPS."""
    memory_gib: float
    """Memory in GiB (for CPU: the KV cache space given to vLLM)."""
    cpu: bool = False


HARDWARE: Mapping[str, Hardware] = MappingProxyType({
    "H100": Hardware(3350.0, 989.0, 80.0),          # H100 SXM5
    "H100_PCIe": Hardware(2000.0, 756.0, 80.0),
    "MI300X": Hardware(5300.0, 1307.4, 192.0),
    "A100": Hardware(2039.0, 312.0, 80.0),           # A100 80GB SXM
    "L4": Hardware(300.0, 121.0, 24.0),
    "CPU": Hardware(307.2, 114.7, 40.0, cpu=True),   # one 4th-gen Xeon socket, 8x DDR5-4800
    "H200": Hardware(4800.0, 989.0, 141.0),
    "B200": Hardware(8000.0, 2250.0, 180.0),
    "L40S": Hardware(864.0, 362.0, 48.0),
})
"""Datasheet figures per family name."""


def derive_profile(hw: Hardware) -> FamilyProfile:
    """The profile of an accelerator from its datasheet figures (module docstring)."""
    efficiency = _CPU_BANDWIDTH_EFFICIENCY if hw.cpu else DECODE_BANDWIDTH_EFFICIENCY
    mfu = _CPU_MFU if hw.cpu else PREFILL_MFU
    bandwidth = hw.bandwidth_gb_s * 1e9 * efficiency
    if hw.cpu:
        kv_bytes = hw.memory_gib * _GIB
    else:
        kv_bytes = GPU_MEMORY_UTILIZATION * hw.memory_gib * _GIB - MODEL_WEIGHT_BYTES
    return FamilyProfile(
        ttft_ms=CPU_OVERHEAD_MS if hw.cpu else OVERHEAD_MS,
        tokens_per_s=round(bandwidth / MODEL_WEIGHT_BYTES, 1),
        prefill_tokens_per_s=round(hw.bf16_tflops * 1e12 * mfu / (2 * MODEL_PARAMS)),
        batch_slowdown=BATCH_SLOWDOWN,
        context_ms_per_1k_tokens=round(1000 * 1000 * KV_BYTES_PER_TOKEN / bandwidth, 4),
        kv_cache_tokens=max(1, int(kv_bytes // KV_BYTES_PER_TOKEN)),
    )


PROFILES: Mapping[str, FamilyProfile] = MappingProxyType(
    {name: derive_profile(hw) for name, hw in HARDWARE.items()}
)
"""The built-in profile of each known family."""

DEFAULT_PROFILE: FamilyProfile = PROFILES["A100"]
"""Profile of a family that is not in ``PROFILES``."""

_LOWER = MappingProxyType({name.lower(): p for name, p in PROFILES.items()})


def profile_for(family: str) -> FamilyProfile:
    """The built-in profile of a family (exact name, then case-insensitive, else the default)."""
    profile = PROFILES.get(family)
    if profile is None:
        profile = _LOWER.get(family.lower(), DEFAULT_PROFILE)
    return profile
