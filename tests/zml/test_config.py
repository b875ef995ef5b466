"""zml.toml discovery and validation: every mistake names the file, the key and the value."""

from __future__ import annotations

from pathlib import Path

import pytest

import zml
from zml.config import discover_path, load_registry, suggest
from zml.plugins.fleet_sources import default_registry

GOOD = """
[accelerators.H100]
cost_per_hour = 4.0
[accelerators.MI300X]

[[nodes]]
id = "a"
family = "H100"
url = "http://127.0.0.1:9001"
models = ["m"]
max_concurrency = 2

[policies.p]
accelerator_chain = ["H100", "MI300X"]
"""


def write(tmp_path: Path, text: str, name: str = "zml.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_loads_families_nodes_and_policies(tmp_path: Path) -> None:
    reg = load_registry(write(tmp_path, GOOD))
    assert list(reg.families) == ["H100", "MI300X"]
    assert reg.families["H100"].cost_per_hour == 4.0
    node = reg.node("a")
    assert (node.max_queue, node.kind, node.models) == (0, "vllm", ("m",))
    assert reg.policies["p"]["accelerator_chain"] == ["H100", "MI300X"]


def test_discovery_order_explicit_then_env_then_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cwd = write(tmp_path, GOOD)
    env = write(tmp_path, GOOD, "env.toml")
    explicit = write(tmp_path, GOOD, "explicit.toml")
    monkeypatch.chdir(tmp_path)
    assert discover_path() == Path("zml.toml")
    monkeypatch.setenv("ZML_CONFIG", str(env))
    assert discover_path() == env
    assert discover_path(explicit) == explicit
    assert cwd.exists()


def test_missing_explicit_or_env_file_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(zml.PolicyConfigError, match="does not exist"):
        zml.Client(config=tmp_path / "nope.toml")
    monkeypatch.setenv("ZML_CONFIG", str(tmp_path / "gone.toml"))
    with pytest.raises(zml.PolicyConfigError, match="ZML_CONFIG"):
        zml.Client()


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (('family = "H100"', 'family = "H10"'),
         ["zml.toml", "nodes[0].family", "'H10'", "did you mean 'H100'"]),
        (('url = "http://127.0.0.1:9001"', 'url = "ftp://x"'), ["nodes[0].url", "'ftp://x'"]),
        (('url = "http://127.0.0.1:9001"', 'url = "http://x:99999"'), ["nodes[0].url", "port"]),
        (("max_concurrency = 2", 'max_concurrency = "lots"'),
         ["nodes[0].max_concurrency", "'lots'"]),
        (("max_concurrency = 2", "max_concurency = 2"),
         ["unknown key nodes[0].max_concurency", "did you mean 'max_concurrency'"]),
        (("max_concurrency = 2", "max_concurrency = 0"), ["nodes[0].max_concurrency", "0"]),
        (('models = ["m"]', "models = []"), ["nodes[0].models"]),
        (("cost_per_hour = 4.0", "cost_per_hour = -1"), ["accelerators.H100.cost_per_hour"]),
        (('accelerator_chain = ["H100", "MI300X"]', 'accelerator_chain = ["H100", "TPU_v9"]'),
         ["[policies.p]", "'TPU_v9'", "accelerator_chain"]),
        (('accelerator_chain = ["H100", "MI300X"]',
          'accelerator_chain = ["H100"]\ncost_priority = "cheap"'),
         ["[policies.p]", "cost_priority", "'cheap'"]),
        (("[accelerators.MI300X]", "[acelerators.MI300X]"),
         ["unknown table [acelerators]", "did you mean [accelerators]"]),
        (("max_concurrency = 2", "max_concurrency = 2\n[[nodes]]\nid = \"a\"\nfamily = \"H100\"\n"
          "url = \"http://127.0.0.1:1\"\nmodels = [\"m\"]\nmax_concurrency = 1"),
         ["nodes[1].id", "'a'", "duplicate"]),
        (("[policies.p]", "[policies.p"), ["not valid TOML"]),
    ],
)
def test_bad_config_names_file_key_and_value(
    tmp_path: Path, edit: tuple[str, str], expected: list[str]
) -> None:
    old, new = edit
    assert old in GOOD
    path = write(tmp_path, GOOD.replace(old, new, 1))
    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Client(config=path)
    message = str(info.value)
    for part in expected:
        assert part in message, (part, message)
    assert str(path) in message or "zml.toml" in message


def test_default_registry_is_the_discovered_file_and_no_client_changes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_registry().families == {}
    write(tmp_path, GOOD)
    assert list(default_registry().families) == ["H100", "MI300X"]
    other = write(tmp_path, GOOD.replace("MI300X", "A100"), "other.toml")
    zml.Client(config=other)
    assert list(default_registry().families) == ["H100", "MI300X"]
    # an edit of the discovered file is picked up
    write(tmp_path, GOOD.replace("MI300X", "L4"))
    assert list(default_registry().families) == ["H100", "L4"]


def test_suggest_finds_a_typo_or_a_case_mismatch_in_any_iterable() -> None:
    assert suggest("H10", ["H100", "MI300X"]) == "H100"
    # "mi300x" is too far from "MI300X" for difflib; the case-insensitive match finds it, also
    # when the choices come from an iterator (read once)
    assert suggest("mi300x", iter(["H100", "MI300X"])) == "MI300X"
    assert suggest("A10G", iter(["H100", "MI300X"])) is None
