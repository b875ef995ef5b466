"""Command-line flags for the fields of a ``zml.Policy``, for commands that store policies.

Policy stores (``zml-policy-sqlite``, ``zml-redis``'s ``zml policies push``) take a policy as
flags; declaring and reading those flags here keeps every store's command line the same and
follows ``zml.Policy`` when a field is added.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from zml.errors import PolicyConfigError

__all__ = ["add_policy_arguments", "policy_fields"]

_VALUE_FLAGS: tuple[tuple[str, str, Any], ...] = (
    ("--latency-target-ms", "latency_target_ms", float),
    ("--cost-priority", "cost_priority", str),
    ("--max-queue-ms", "max_queue_ms", float),
    ("--health-threshold", "health_threshold", float),
)


def add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--chain``, one flag per Policy field, and ``--json`` (fields as a JSON object)."""
    parser.add_argument(
        "--chain", help="accelerator_chain: families in order, comma-separated (H100,MI300X)"
    )
    for flag, field, kind in _VALUE_FLAGS:
        parser.add_argument(flag, dest=field, type=kind, help=field)
    parser.add_argument(
        "--queue-on-saturation", dest="queue_on_saturation",
        action=argparse.BooleanOptionalAction, default=None, help="queue_on_saturation",
    )
    parser.add_argument(
        "--json", dest="json_fields", help="Policy fields as a JSON object (the flags override it)"
    )


def policy_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The Policy fields given on the command line (``name`` excluded), not yet validated.

    Raises:
        PolicyConfigError: ``--json`` is not a JSON object.
    """
    fields: dict[str, Any] = {}
    if args.json_fields:
        try:
            loaded = json.loads(args.json_fields)
        except json.JSONDecodeError as exc:
            raise PolicyConfigError(f"--json is not valid JSON: {exc}", field="--json",
                                    value=args.json_fields) from None
        if not isinstance(loaded, dict):
            raise PolicyConfigError("--json must be a JSON object of Policy fields",
                                    field="--json", value=loaded)
        fields.update(loaded)
    if args.chain is not None:
        fields["accelerator_chain"] = [f.strip() for f in args.chain.split(",") if f.strip()]
    for _, field, _ in _VALUE_FLAGS:
        value = getattr(args, field)
        if value is not None:
            fields[field] = value
    if args.queue_on_saturation is not None:
        fields["queue_on_saturation"] = args.queue_on_saturation
    fields.pop("name", None)
    return fields
