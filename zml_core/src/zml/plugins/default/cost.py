"""The built-in cost model: what a request cost, from the family's configured prices.

* ``cost_per_1k_tokens`` set and the node reported token usage: that price × total tokens /
  1000 (basis ``"tokens"``).
* else ``cost_per_hour`` set: the node-seconds the request held one slot, as a share of the
  node: ``cost_per_hour / 3600 × held_s / max_concurrency`` (basis ``"node_seconds"``). A node
  serving ``max_concurrency`` requests at once splits its hourly price between them.
* else no cost (None).

Registered ``trylast``: any cost plugin that returns a cost replaces this model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...config import AcceleratorConfig, NodeConfig
from ...types import Cost
from ..hookspecs import hookimpl

__all__ = ["default_cost", "zml_attribute_cost"]


def total_tokens(usage: Mapping[str, Any] | None) -> int:
    """``total_tokens`` of a usage mapping (or prompt + completion), 0 when unknown."""
    if not usage:
        return 0
    total = usage.get("total_tokens")
    if isinstance(total, int) and total > 0:
        return total
    prompt = usage.get("prompt_tokens") or 0
    completion = usage.get("completion_tokens") or 0
    return int(prompt) + int(completion)


def default_cost(
    accelerator: AcceleratorConfig | None,
    node: NodeConfig | None,
    usage: Mapping[str, Any] | None,
    held_s: float,
) -> Cost | None:
    """The default model's cost for one request (see the module docstring)."""
    if accelerator is None:
        return None
    if accelerator.cost_per_1k_tokens is not None:
        tokens = total_tokens(usage)
        if tokens > 0:
            return Cost(amount=accelerator.cost_per_1k_tokens * tokens / 1000, basis="tokens")
    if accelerator.cost_per_hour is not None:
        slots = node.max_concurrency if node is not None else 1
        amount = accelerator.cost_per_hour / 3600 * max(0.0, held_s) / slots
        return Cost(amount=amount, basis="node_seconds")
    return None


@hookimpl(trylast=True)
def zml_attribute_cost(
    usage: Mapping[str, Any] | None,
    held_s: float,
    accelerator: AcceleratorConfig | None,
    node: NodeConfig | None,
) -> Cost | None:
    """Attribute the request's cost with :func:`default_cost`."""
    return default_cost(accelerator, node, usage, held_s)
