"""A simulated inference fleet that speaks the node protocol of vLLM and its peers.

`SimNode` is one node as an ASGI app: OpenAI chat completions (plain and SSE-streamed, with
tool calls, parallel ones included, and structured output), `/health`, `/v1/models`,
Prometheus `/metrics` under the metric names of the imitated backend, a real bounded queue in
front of real slots, latency and throughput from the accelerator family's profile, fault
injection, and abort on disconnect.
Use it in-process through `httpx2.ASGITransport` for fast tests, or serve several on loopback
sockets with `SimFleet` for end-to-end tests, `zml sim serve` and `zml demo`.

Every node's timing comes from `NodeModel` (`zml.sim.model`: prefill of the uncached prompt,
continuous batching, a KV-cache budget and a prefix cache), with the accelerator family's
`FamilyProfile` (`zml.sim.profiles`). The same model, in virtual time, drives trace replay
(`zml.sim.replay`, `zml sim replay`).

Admin endpoints of every node: `POST /_sim/faults` (a FaultSpec as JSON), `GET /_sim/stats`,
`POST /_sim/reset_peak`.
"""

from zml.sim.fleet import SimFleet
from zml.sim.model import ModelRequest, NodeEvent, NodeModel
from zml.sim.node import SimNode, SimStats, SimulatedDrop
from zml.sim.profiles import FamilyProfile, profile_for
from zml.sim.spec import FaultSpec, SimNodeSpec, family_profile

__all__ = [
    "FamilyProfile",
    "FaultSpec",
    "ModelRequest",
    "NodeEvent",
    "NodeModel",
    "SimFleet",
    "SimNode",
    "SimNodeSpec",
    "SimStats",
    "SimulatedDrop",
    "family_profile",
    "profile_for",
]
