"""zml.Policy: validated at construction, resolvable from a name or a dict."""

from __future__ import annotations

from pathlib import Path

import pytest

import zml
from zml.policy import resolve_policy

CONFIG = """
[accelerators.H100]
[accelerators.MI300X]
[accelerators.H100_PCIe]

[policies.llama3-production]
accelerator_chain = ["H100", "MI300X", "H100_PCIe"]
latency_target_ms = 500

[policies.batch]
accelerator_chain = ["H100_PCIe"]
cost_priority = "cost"
"""


@pytest.fixture
def client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> zml.Client:
    """A client on the test's zml.toml, which is also the discovered one (ZML_CONFIG)."""
    path = tmp_path / "zml.toml"
    path.write_text(CONFIG)
    monkeypatch.setenv("ZML_CONFIG", str(path))
    return zml.Client(config=path)


def test_defaults_and_frozen(client: zml.Client) -> None:
    p = zml.Policy(name="p", accelerator_chain=["H100", "MI300X"])
    assert p.accelerator_chain == ("H100", "MI300X")
    assert (p.cost_priority, p.queue_on_saturation, p.health_threshold) == ("balanced", False, 0.5)
    assert p.latency_target_ms is None and p.max_queue_ms is None
    with pytest.raises(Exception, match="frozen"):
        p.name = "q"  # type: ignore[misc]
    assert hash(p) == hash(zml.Policy(name="p", accelerator_chain=["H100", "MI300X"]))


@pytest.mark.parametrize(
    ("kwargs", "field", "fragments"),
    [
        ({"accelerator_chain": ["H100", "MI300x"]}, "accelerator_chain",
         ["'MI300x'", "did you mean 'MI300X'"]),
        ({"accelerator_chain": []}, "accelerator_chain", ["at least 1"]),
        ({"accelerator_chain": ["H100", "H100"]}, "accelerator_chain", ["appears twice"]),
        ({"accelerator_chain": ["H100"], "latency_target_ms": 0}, "latency_target_ms", ["0"]),
        ({"accelerator_chain": ["H100"], "cost_priority": "balance"}, "cost_priority",
         ["'balance'", "did you mean 'balanced'"]),
        ({"accelerator_chain": ["H100"], "health_threshold": 1.5}, "health_threshold", ["1.5"]),
        ({"accelerator_chain": ["H100"], "latency_target": 500}, "latency_target",
         ["unknown field", "did you mean 'latency_target_ms'"]),
        ({"accelerator_chain": "H100"}, "accelerator_chain", ["a list of families", "got str"]),
        # a set has no order: the chain would depend on the process's hash seed
        ({"accelerator_chain": {"H100", "MI300X"}}, "accelerator_chain",
         ["in order of preference", "got set"]),
        # a year at most, as every other wait (a longer one overflows a thread wait)
        ({"accelerator_chain": ["H100"], "max_queue_ms": 1e300}, "max_queue_ms",
         ["less than or equal to 31536000000"]),
        ({"accelerator_chain": ["H100"], "affinity": "prefx"}, "affinity",
         ["'prefx'", "did you mean 'prefix'"]),
    ],
)
def test_bad_fields_raise_policy_config_error_at_construction(
    client: zml.Client, kwargs: dict[str, object], field: str, fragments: list[str]
) -> None:
    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Policy(name="p", **kwargs)
    assert info.value.field == field
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_a_policy_dict_without_its_name_says_how_to_name_it(client: zml.Client) -> None:
    with pytest.raises(zml.PolicyConfigError) as info:
        client.policy({"accelerator_chain": ["H100"]})
    assert str(info.value).startswith("a policy: field 'name' is required")  # not "policy None"
    assert "{'name': 'my-policy', ...}" in str(info.value) and info.value.field == "name"


def test_without_any_registry_the_error_says_how_to_fix_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(zml.PolicyConfigError, match=r"no accelerator families.*zml\.toml"):
        zml.Policy(name="p", accelerator_chain=["H100"])


def test_resolve_by_name_dict_and_policy(client: zml.Client) -> None:
    named = client.policies
    assert set(named) == {"llama3-production", "batch"}
    by_name = resolve_policy("batch", client.registry, named)
    assert by_name is not None and by_name.cost_priority == "cost" and by_name.name == "batch"
    by_dict = resolve_policy({"name": "d", "accelerator_chain": ["MI300X"]}, client.registry,
                             named)
    assert by_dict == zml.Policy(name="d", accelerator_chain=["MI300X"])
    assert resolve_policy(None, client.registry, named) is None


def test_unknown_name_lists_known_policies(client: zml.Client) -> None:
    with pytest.raises(zml.PolicyConfigError) as info:
        client.infer(model="m", messages=[{"role": "user", "content": "x"}],
                     policy="llama3-prod")
    message = str(info.value)
    assert "unknown policy 'llama3-prod'" in message
    assert "batch, llama3-production" in message
    assert "did you mean 'llama3-production'" in message


def test_bad_dict_policy_is_rejected_before_sending(client: zml.Client) -> None:
    with pytest.raises(zml.PolicyConfigError, match="TPU_v9"):
        client.infer(model="m", messages=[{"role": "user", "content": "x"}],
                     policy={"name": "x", "accelerator_chain": ["TPU_v9"]})
    with pytest.raises(zml.PolicyConfigError, match=r"must be a zml\.Policy"):
        client.infer(model="m", messages=[{"role": "user", "content": "x"}],
                     policy=42)  # type: ignore[arg-type]


def test_policy_built_for_another_registry_is_checked_against_the_clients(
    client: zml.Client, tmp_path: Path
) -> None:
    policy = zml.Policy(name="p", accelerator_chain=["MI300X"])
    other = tmp_path / "other.toml"
    other.write_text("[accelerators.H100]\n")
    narrow = zml.Client(config=other)
    with pytest.raises(zml.PolicyConfigError, match="'MI300X'"):
        narrow.infer(model="m", messages=[{"role": "user", "content": "x"}], policy=policy)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("latency_target_ms", True, "Input should be a valid number"),
        ("latency_target_ms", "500", "Input should be a valid number"),
        ("max_queue_ms", False, "Input should be a valid number"),
        ("health_threshold", "0.5", "Input should be a valid number"),
        ("queue_on_saturation", "no", "Input should be a valid boolean"),
        ("queue_on_saturation", 0.0, "Input should be a valid boolean"),
        ("queue_on_saturation", 1, "Input should be a valid boolean"),
        ("latency_target_ms", float("inf"), "Input should be a finite number"),
        ("max_queue_ms", float("inf"), "Input should be a finite number"),
    ],
)
def test_values_of_the_wrong_type_are_refused_not_coerced(
    client: zml.Client, field: str, value: object, expected: str
) -> None:
    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Policy(name="p", accelerator_chain=["H100"], **{field: value})  # type: ignore[arg-type]
    assert str(info.value) == f"policy 'p': {field} = {value!r}: {expected}"
    assert info.value.field == field and info.value.value == value


def test_an_int_is_still_a_number(client: zml.Client) -> None:
    p = zml.Policy(name="p", accelerator_chain=["H100"], latency_target_ms=500, max_queue_ms=50,
                   health_threshold=1, queue_on_saturation=True)
    assert (p.latency_target_ms, p.max_queue_ms, p.health_threshold) == (500.0, 50.0, 1.0)
    assert isinstance(p.latency_target_ms, float) and p.queue_on_saturation is True
