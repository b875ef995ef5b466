"""zml.toml discovery and validation: every mistake names the file, the key and the value."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

import zml
from zml.config import (
    AcceleratorConfig,
    FaultConfig,
    Registry,
    SimConfig,
    SimProfileConfig,
    discover_path,
    load_registry,
    suggest,
)
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


def test_default_registry_follows_every_version_of_the_file_with_fleet_sources(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With a fleet-source plugin, the default registry is a new object built from the file's.
    # Versions of the file read in between (by a client) must not leave it stale: the cache
    # was once keyed by the file registry's id(), which a later version's registry reused.
    import zml.plugins.fleet_sources as fleet_sources

    def with_plugin_nodes(pm: object, file_registry: Registry) -> Registry:
        return file_registry.with_additions({}, [], origin="a test fleet source")

    versions: list[Registry] = []
    monkeypatch.setattr(fleet_sources, "build_registry", with_plugin_nodes)
    monkeypatch.setattr(fleet_sources, "discovered_registry", lambda: versions[-1])
    for version in range(100):
        family = f"F{version}"
        # the file's newest version only is kept (as zml.config's file cache does)
        versions[:] = [Registry(families={family: AcceleratorConfig()})]
        if version % 2 == 0:  # odd versions are read by clients, never asked for here
            assert list(default_registry().families) == [family]


def test_suggest_finds_a_typo_or_a_case_mismatch_in_any_iterable() -> None:
    assert suggest("H10", ["H100", "MI300X"]) == "H100"
    # "mi300x" is too far from "MI300X" for difflib; the case-insensitive match finds it, also
    # when the choices come from an iterator (read once)
    assert suggest("mi300x", iter(["H100", "MI300X"])) == "MI300X"
    assert suggest("A10G", iter(["H100", "MI300X"])) is None


NOT_UTF8 = b"[accelerators.H100]\n# caf\xe9\n"


def test_a_file_that_is_not_utf8_names_the_file_and_the_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "zml.toml"
    path.write_bytes(NOT_UTF8)
    expected = (f"{path} is not UTF-8 text: byte 0xe9 at offset 25 cannot be decoded; a zml.toml "
                "must be UTF-8: re-save it as UTF-8")
    for build in (lambda: load_registry(path), lambda: zml.Client(config=path)):
        with pytest.raises(zml.PolicyConfigError) as info:
            build()
        assert str(info.value) == expected and info.value.source == str(path)
    monkeypatch.setenv("ZML_CONFIG", str(path))
    with pytest.raises(zml.PolicyConfigError, match="is not UTF-8 text"):
        zml.Policy(name="p", accelerator_chain=["H100"])


@pytest.mark.parametrize("config", [123, 1.5, True, b"zml.toml", ["zml.toml"], {"nodes": []}])
def test_config_must_be_a_path_or_a_registry(config: object) -> None:
    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Client(config=config)  # type: ignore[arg-type]
    assert str(info.value) == ("config must be the path of a zml.toml (a str or os.PathLike) or "
                               f"a zml.Registry, got {type(config).__name__}")
    assert info.value.field == "config"


def test_a_directory_is_not_a_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Client(config=tmp_path)
    assert str(info.value) == (f"config file {str(tmp_path)!r} is a directory, not a file; pass "
                               f"the zml.toml file itself (e.g. {str(tmp_path / 'zml.toml')!r})")
    monkeypatch.setenv("ZML_CONFIG", str(tmp_path))
    for build in (zml.Client, lambda: zml.Policy(name="p", accelerator_chain=["H100"])):
        with pytest.raises(zml.PolicyConfigError) as info:
            build()
        assert str(info.value).startswith(f"ZML_CONFIG={str(tmp_path)!r} is a directory, not a "
                                          "file")


@pytest.mark.parametrize("name", ["a" * 5000, "zml\0.toml", ""])
def test_a_path_the_os_refuses_is_a_clear_error(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Client(config=name)
    why = {"a": "cannot be used: File name too long", "z": "is not a valid path (it contains a "
           "NUL character)", "": "is an empty path"}[name[:1]]
    assert f"{why}; pass the path of a zml.toml" in str(info.value)
    assert len(str(info.value)) < 400  # a 5,000-character name is shortened in the message
    if name.isalpha():  # an empty ZML_CONFIG means "unset"; no variable can hold a NUL
        monkeypatch.setenv("ZML_CONFIG", name)
        with pytest.raises(zml.PolicyConfigError, match=f"ZML_CONFIG=.* {why}; fix or unset it"):
            zml.Client()


def _float_fields(model: type[BaseModel]) -> list[str]:
    return [name for name, f in model.model_fields.items() if "float" in str(f.annotation)]


INF_CASES = [
    *((f"[accelerators.H100]\n{k} = inf\n", f"accelerators.H100.{k}")
      for k in _float_fields(AcceleratorConfig)),
    *((f"[accelerators.H100.sim]\n{k} = inf\n", f"accelerators.H100.sim.{k}")
      for k in _float_fields(SimProfileConfig)),
    *((GOOD.replace("[policies.p]", f"[nodes.sim]\n{k} = inf\n[policies.p]"), f"nodes[0].sim.{k}")
      for k in _float_fields(SimConfig)),
    *((GOOD.replace("[policies.p]", f"[nodes.sim.faults]\n{k} = inf\n[policies.p]"),
       f"nodes[0].sim.faults.{k}") for k in _float_fields(FaultConfig)),
    *((GOOD + f"{k} = inf\n", f"[policies.p] policy 'p': {k}") for k in _float_fields(zml.Policy)),
]


def test_the_infinity_cases_cover_every_rate_delay_cost_and_policy_number() -> None:
    keys = [key for _, key in INF_CASES]
    assert len(keys) >= 16 and "nodes[0].sim.faults.stall_s" in keys


@pytest.mark.parametrize(("text", "key"), INF_CASES, ids=[key for _, key in INF_CASES])
def test_infinity_is_refused_like_nan(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text)
    for value in ("inf", "-inf", "nan"):
        path.write_text(text.replace("= inf", f"= {value}"))
        with pytest.raises(zml.PolicyConfigError) as info:
            zml.Client(config=path)
        assert str(info.value).endswith(f"{key} = {value}: Input should be a finite number")
