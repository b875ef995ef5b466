"""Policy-field flags shared by the policy-store commands (zml-policy-sqlite, zml policies)."""

from __future__ import annotations

import argparse

import pytest

import zml
from zml.cli.policy_args import add_policy_arguments, policy_fields


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_policy_arguments(parser)
    return parser.parse_args(argv)


def test_flags_override_json_and_name_is_dropped() -> None:
    args = parse("--json", '{"name": "x", "cost_priority": "cost", "health_threshold": 0.2}',
                 "--chain", "H100, MI300X", "--cost-priority", "latency",
                 "--latency-target-ms", "300", "--no-queue-on-saturation")
    assert policy_fields(args) == {
        "accelerator_chain": ["H100", "MI300X"], "cost_priority": "latency",
        "health_threshold": 0.2, "latency_target_ms": 300.0, "queue_on_saturation": False,
    }
    assert policy_fields(parse()) == {}


@pytest.mark.parametrize(("text", "fragment"), [("{oops", "not valid JSON"),
                                                ("[1, 2]", "must be a JSON object")])
def test_bad_json_is_a_policy_config_error(text: str, fragment: str) -> None:
    with pytest.raises(zml.PolicyConfigError, match=fragment) as info:
        policy_fields(parse("--json", text))
    assert info.value.field == "--json"
