"""A simulated inference fleet that speaks the node protocol of vLLM and its peers.

`SimNode` is one node as an ASGI app: OpenAI chat completions (plain and SSE-streamed, with
tool calls, parallel ones included, and structured output), `/health`, `/v1/models`,
Prometheus `/metrics` under the metric names of the imitated backend, a real bounded queue in
front of real slots, latency and throughput from the accelerator family's profile, fault
injection, and abort on disconnect.
Use it in-process through `httpx2.ASGITransport` for fast tests, or serve several on loopback
sockets with `SimFleet` for end-to-end tests, `zml sim serve` and `zml demo`.

Admin endpoints of every node: `POST /_sim/faults` (a FaultSpec as JSON), `GET /_sim/stats`,
`POST /_sim/reset_peak`.
"""

from zml.sim.fleet import SimFleet
from zml.sim.node import SimNode, SimStats, SimulatedDrop
from zml.sim.spec import FaultSpec, SimNodeSpec, family_profile

__all__ = [
    "FaultSpec",
    "SimFleet",
    "SimNode",
    "SimNodeSpec",
    "SimStats",
    "SimulatedDrop",
    "family_profile",
]
