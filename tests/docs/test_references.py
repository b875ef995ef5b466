"""The reference pages stay true to the code: every key, reason, error, constant and default.

Each test reads the names and values from the code itself, so that a key, a reason or a
constant added (or changed) in the code fails here until the docs say so.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import zml
from zml import dispatch, fleet, probe, routing
from zml.config import AcceleratorConfig, FaultConfig, NodeConfig, SimConfig, load_registry

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def code_spans(text: str) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", text))


# --- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "model"),
    [
        ("accelerators", AcceleratorConfig),
        ("nodes", NodeConfig),
        ("nodes-sim", SimConfig),
        ("nodes-sim-faults", FaultConfig),
        ("policies", zml.Policy),
    ],
)
def test_every_config_key_is_on_the_configuration_page(table: str, model: Any) -> None:
    text = page("configuration.md")
    section = re.search(rf"\{{#{table}\}}\n(.*?)(?=\n## |\Z)", text, re.S)
    assert section, f"configuration.md has no section {{#{table}}}"
    documented = {m for m in re.findall(r"^\| `([a-z_0-9]+)` \|", section.group(1), re.M)}
    missing = set(model.model_fields) - documented
    assert not missing, f"keys of {model.__name__} missing from the {table} table: {missing}"
    extra = documented - set(model.model_fields)
    assert not extra, f"the {table} table documents keys zml does not accept: {extra}"


# (what the page says was written, the zml.toml text) -> the page must show the real message.
_NODE = """
[[nodes]]
id = "h100-a"
family = "H100"
url = "http://10.0.0.5:8000"
models = ["m"]
max_concurrency = 8
"""
_ACC = "[accelerators.H100]\n"


def _node(**changes: str | None) -> str:
    text = _NODE
    for key, value in changes.items():
        text = re.sub(rf"^{key} = .*\n", "" if value is None else f"{key} = {value}\n", text,
                      flags=re.M)
        if value is not None and f"\n{key} = " not in text:
            text += f"{key} = {value}\n"
    return _ACC + text


BAD_FILES = [
    "[accelerator.H100]\n",
    "[accelerators.H100]\ncost_per_hour = -1\n",
    "[accelerators.H100]\ncost_per_1k_tokens = -0.1\n",
    "[accelerators.H100]\ncost_per_hr = 4.0\n",
    _node(family='"H10"'),
    _node(id='""'),
    _node(id=None),
    _ACC + _NODE + _NODE,
    _node(url='"10.0.0.5:8000"'),
    _node(url='"http://10.0.0.5:99999"'),
    _node(models="[]"),
    _node(models='[""]'),
    _node(max_concurrency="0"),
    _node(max_concurrency=None),
    _node(max_queue="-1"),
    _node(kind='"vllm2"'),
    _node(max_concurrency=None, max_concurency="8"),
    _node() + "[nodes.sim]\nttft_ms = 0\n",
    _node() + "[nodes.sim]\ntokens_per_s = -1\n",
    _node() + "[nodes.sim]\nqueue_size = -1\n",
    _node() + "[nodes.sim]\nttft = 50\n",
    _node() + "[nodes.sim.faults]\nerror_rate = 1.5\n",
    _node() + "[nodes.sim.faults]\nerror_status = 200\n",
    _node() + "[nodes.sim.faults]\nretry_after_s = -1\n",
    _node() + "[nodes.sim.faults]\ndrop_rate = 2\n",
    _node() + "[nodes.sim.faults]\nstall_s = -1\n",
    _node() + "[nodes.sim.faults]\nmalformed_rate = -0.1\n",
    _node() + '[nodes.sim.faults]\nseed = "x"\n',
    _node() + "[nodes.sim.faults]\nerror_rat = 0.1\n",
    _ACC + '[policies.prod]\naccelerator_chain = ["H10"]\n',
    "[accelerators.H100\n",
]


@pytest.mark.parametrize("text", BAD_FILES, ids=range(len(BAD_FILES)))
def test_configuration_page_shows_the_real_message(
    text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    name = "bad.toml" if text.startswith("[accelerators.H100\n") else "zml.toml"
    Path(name).write_text(text)
    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Client(config=name)
    assert str(info.value) in page("configuration.md")


BAD_POLICIES = [
    {"accelerator_chain": ["H100", "MI300"]},
    {"accelerator_chain": ["H100", "TPUv5"]},
    {"accelerator_chain": []},
    {"accelerator_chain": ["H100", "H100"]},
    {"accelerator_chain": "H100"},
    {"accelerator_chain": None},
    {"name": ""},
    {"latency_target_ms": 0},
    {"latency_target_ms": "fast"},
    {"cost_priority": "balance"},
    {"cost_priority": "cheap"},
    {"queue_on_saturation": "maybe"},
    {"max_queue_ms": 0},
    {"health_threshold": 2},
    {"latency_target": 500},
    {"fallback": True},
]


@pytest.mark.parametrize("change", BAD_POLICIES, ids=lambda c: "-".join(map(str, c.items())))
def test_configuration_page_shows_the_real_policy_message(
    change: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "zml.toml"
    config.write_text("[accelerators.H100]\n[accelerators.MI300X]\n[accelerators.H100_PCIe]\n")
    monkeypatch.setenv("ZML_CONFIG", str(config))  # the default registry policies check against
    fields: dict[str, Any] = {"name": "p", "accelerator_chain": ["H100"], **change}
    fields = {k: v for k, v in fields.items() if v is not None}
    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Policy(**fields)
    assert str(info.value) in page("configuration.md")


def test_configuration_page_shows_discovery_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    text = page("configuration.md")
    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Client(config="nope.toml")
    assert str(info.value) in text
    monkeypatch.setenv("ZML_CONFIG", "missing.toml")
    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Client()
    assert str(info.value) in text
    monkeypatch.delenv("ZML_CONFIG")
    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Policy(name="p", accelerator_chain=["H100"])
    assert str(info.value) in text


def test_example_config_loads() -> None:
    load_registry(ROOT / "examples" / "zml.toml")


# --- errors -----------------------------------------------------------------------------------


def test_every_rejection_reason_is_on_the_errors_page() -> None:
    spans = code_spans(page("errors.md"))
    reasons = set(routing.REJECTION_REASONS) | set(routing.SOFT_REASONS)
    assert set(routing.RejectionReason.__args__) == set(routing.REJECTION_REASONS)
    assert not reasons - spans, reasons - spans
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", page("errors.md"), re.M))
    assert documented >= reasons


def test_every_final_error_is_on_the_errors_page() -> None:
    final = set(dispatch.FINAL_ERRORS) | {routing.NO_VIABLE_NODE}
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", page("errors.md"), re.M))
    assert not final - documented, final - documented


def test_every_error_class_is_on_the_errors_page() -> None:
    from zml import errors

    text = page("errors.md")
    for name in errors.__all__:
        assert name in text, f"errors.md does not mention {name}"


def test_errors_page_states_the_limits_in_force() -> None:
    text = page("errors.md")
    assert f"{dispatch.QUEUE_LIMIT:,} requests" in text
    assert "`zml.dispatch.QUEUE_LIMIT`" in text
    assert f"(default {dispatch.MAX_ATTEMPTS})" in text
    assert f"{fleet.CIRCUIT_FAILURES} times in a row" in text
    assert f"open for {fleet.CIRCUIT_COOLDOWN_S:g} s" in text
    assert f"within {fleet.HEALTH_RECOVERY_S:g} s" in text
    assert f"up to {routing.MAX_IDS_IN_RECOMMENDATION} nodes" in text


def test_error_kinds_of_attempts_are_on_the_streaming_page() -> None:
    from zml.errors import _KINDS

    spans = code_spans(page("streaming.md"))
    assert not set(_KINDS.values()) - spans - {"incomplete_stream"}


# --- constants and defaults -------------------------------------------------------------------


def documented_value(text: str, name: str) -> Any:
    """The value a page's table gives a constant: the row ``| `NAME` | `VALUE` | ...``."""
    row = re.search(rf"^\| `{name}` \| `([^`]+)` \|", text, re.M)
    assert row, f"no table row for {name}"
    return ast.literal_eval(row.group(1))


@pytest.mark.parametrize(
    "name",
    ["PRIOR_TTFT_MS", "PRIOR_SERVICE_MS", "COST_LATENCY_MARGIN", "HIGH_WATER", "BALANCED_SPAN",
     "TIE_MS", "MAX_IDS_IN_RECOMMENDATION"],
)
def test_routing_constants_on_the_routing_page(name: str) -> None:
    assert documented_value(page("concepts/routing.md"), name) == getattr(routing, name)


@pytest.mark.parametrize(
    "name", ["HEALTH_ALPHA", "HEALTH_RECOVERY_S", "CIRCUIT_FAILURES", "CIRCUIT_COOLDOWN_S",
             "EWMA_ALPHA"],
)
def test_fleet_constants_on_the_health_page(name: str) -> None:
    assert documented_value(page("concepts/health.md"), name) == getattr(fleet, name)


def test_timeouts_defaults_on_the_streaming_page() -> None:
    text = page("streaming.md")
    for field in ("total", "connect", "first_token", "idle"):
        default = getattr(zml.Timeouts(), field)
        assert f"| `{field}` | `{default!r}` |" in text, field


def test_policy_defaults_on_the_policies_pages() -> None:
    for name, info in zml.Policy.model_fields.items():
        if info.is_required():
            continue
        default = info.default
        shown = "none" if default is None else (
            f"`{str(default).lower()}`" if isinstance(default, bool) else
            f'`"{default}"`' if isinstance(default, str) else f"`{default!r}`")
        for doc in ("configuration.md", "concepts/policies.md"):
            row = re.search(rf"^\| `{name}` \|[^\n]*", page(doc), re.M)
            assert row and shown in row.group(0), (doc, name, shown)


def test_load_gauges_on_the_real_nodes_page() -> None:
    text = page("real-nodes.md")
    for kind, (running, waiting) in probe.LOAD_GAUGES.items():
        row = re.search(rf"^\|[^|\n]*\| `{kind}`[^|\n]*\|[^\n]*", text, re.M)
        assert row, kind
        for gauge in (*running, *waiting):
            assert f"`{gauge}`" in row.group(0), (kind, gauge)


def test_node_kinds_on_the_configuration_page() -> None:
    kinds = NodeConfig.model_fields["kind"].annotation.__args__  # type: ignore[union-attr]
    row = re.search(r"^\| `kind` \|[^\n]*", page("configuration.md"), re.M)
    assert row
    for kind in kinds:
        assert f'`"{kind}"`' in row.group(0)


# --- the public API ----------------------------------------------------------------------------


def _public() -> list[str]:
    return [name for name in zml.__all__ if name != "__version__"]


@pytest.mark.parametrize("name", _public())
def test_every_public_name_has_a_docstring(name: str) -> None:
    obj = getattr(zml, name)
    # A constant (NOT_GIVEN) or a marker instance (hookimpl) is documented by its class.
    documented = obj if inspect.isclass(obj) or inspect.isfunction(obj) else type(obj)
    doc = documented.__doc__
    assert doc and doc.strip(), f"zml.{name} has no docstring"


def test_every_public_name_is_in_the_api_reference() -> None:
    text = "\n".join(p.read_text() for p in (DOCS / "api").glob("*.md"))
    directives = set(re.findall(r"^::: zml\.(\w+)$", text, re.M))
    assert directives == set(_public()), set(_public()) ^ directives


# --- changelog and README ----------------------------------------------------------------------


def test_changelog_has_the_current_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert f"## [{zml.__version__}] - " in text
    assert re.search(r"^### (Added|Changed|Deprecated|Removed|Fixed|Security)$", text, re.M)
    assert '--8<-- "CHANGELOG.md"' in page("changelog.md")


def test_readme_links_the_docs_and_the_changelog() -> None:
    text = (ROOT / "README.md").read_text()
    assert "## Documentation" in text
    assert "(docs/" in text and "(CHANGELOG.md)" in text
    assert "mkdocs build --strict" in text
