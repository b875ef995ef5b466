"""The ``zml`` command line, run as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest

from zml.cli import main
from zml.cli.demo import demo_config


def _zml(*args: str, cwd: Path | None = None,
         timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    env["COLUMNS"] = "200"
    return subprocess.run([sys.executable, "-m", "zml", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_demo_shows_a_fallback_and_a_routing_context(tmp_path: Path) -> None:
    proc = _zml("demo", "--dir", str(tmp_path), "--time-scale", "0.3")
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr + out
    assert "fallback H100 → MI300X shown: yes; routing error shown: yes" in out
    assert '"final_error": "no_viable_node"' in out
    assert '"rejected_reason": "all_nodes_over_capacity"' in out
    assert "MI300X" in out and "H100 above high water" in out
    assert (tmp_path / "zml.toml").read_text().count("[[nodes]]") == 5
    assert "cancelled 20 held streams" in out


def test_a_demo_burst_larger_than_the_fleet_narrates_its_refusals(tmp_path: Path) -> None:
    """21 concurrent requests on 20 slots (the policy does not queue): one is refused, and the
    demo says so and goes on to the end instead of stopping with the error."""
    proc = _zml("demo", "--requests", "21", "--time-scale", "0.3")
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr + out
    assert "1 of 21 requests refused: zml.RoutingError no_viable_node" in out
    assert "all nodes over capacity" in out and "the fleet has 20 slots" in out
    assert "routing error shown: yes" in out and "Traceback" not in proc.stderr


def test_demo_config_is_valid_and_has_the_seed_policy(tmp_path: Path) -> None:
    path = tmp_path / "zml.toml"
    path.write_text(demo_config())
    assert main(["policy", "check", "--config", str(path)]) == 0
    text = path.read_text()
    assert 'accelerator_chain = ["H100", "MI300X", "H100_PCIe"]' in text


def test_route_explain_is_a_dry_run(seed_fleet: Any, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["route", "--config", str(seed_fleet.path), "--policy", "llama3-production",
                   "--model", "meta-llama/llama-3-8b-instruct", "--explain", "--probe"])
    out = capsys.readouterr().out
    assert status == 0
    assert "would route to" in out and "h100-" in out and "chosen" in out
    assert sum(n.stats.requests_total for n in seed_fleet.fleet.nodes.values()) == 0


def test_route_for_an_unserved_model_explains_why(seed_fleet: Any,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["route", "--config", str(seed_fleet.path), "--policy", "llama3-production",
                   "--model", "no-such-model", "--explain"])
    out = capsys.readouterr().out
    assert status == 1
    assert "no_nodes_for_model" in out and "register nodes serving no-such-model" in out


def test_fleet_status_probes_every_node(seed_fleet: Any,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "status", "--config", str(seed_fleet.path)]) == 0
    out = capsys.readouterr().out
    for node_id in seed_fleet.fleet.nodes:
        assert node_id in out
    seed_fleet.fleet.kill("h100-pcie-1")
    assert main(["fleet", "status", "--config", str(seed_fleet.path)]) == 1
    assert "down" in capsys.readouterr().out


def test_errors_are_one_clear_line_not_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "zml.toml"
    bad.write_text('[accelerators.H100]\n[[nodes]]\nid = "a"\nfamily = "H10"\n'
                   'url = "http://127.0.0.1:1"\nmodels = ["m"]\nmax_concurrency = 1\n')
    proc = _zml("policy", "check", "--config", str(bad))
    assert proc.returncode == 2
    assert "PolicyConfigError" in proc.stderr and "did you mean 'H100'" in proc.stderr
    assert "Traceback" not in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _zml("policy", "check", cwd=empty)
    assert proc.returncode == 2 and "no zml.toml found" in proc.stderr


def test_sim_serve_serves_the_configs_nodes(tmp_path: Path) -> None:
    path = tmp_path / "zml.toml"
    path.write_text(demo_config())
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    proc = subprocess.Popen([sys.executable, "-m", "zml", "sim", "serve", str(path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        from zml.config import load_registry

        url = load_registry(path).nodes[0].url
        deadline = time.monotonic() + 30
        while True:
            try:
                r = httpx2.get(url + "/health", timeout=1)
                break
            except httpx2.HTTPError:
                assert time.monotonic() < deadline, "zml sim serve did not start"
                time.sleep(0.1)
        assert r.status_code == 200
        models = httpx2.get(url + "/v1/models").json()
        assert models["data"][0]["id"] == "meta-llama/llama-3-8b-instruct"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_plugins_can_add_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    import zml
    from zml.plugins import register, unregister

    class Hello:
        @zml.hookimpl
        def zml_register_commands(
            self, subparsers: argparse._SubParsersAction[argparse.ArgumentParser]
        ) -> None:
            p = subparsers.add_parser("hello", help="say hello")
            p.add_argument("--name", default="fleet")
            p.set_defaults(handler=lambda args: print(f"hello {args.name}") or 3)

    class Broken:
        @zml.hookimpl
        def zml_register_commands(self, subparsers: object) -> None:
            raise RuntimeError("boom")

    names = [register(Hello()), register(Broken())]
    try:
        assert main(["hello", "--name", "zml"]) == 3
        assert "hello zml" in capsys.readouterr().out
    finally:
        for name in names:
            unregister(name=name)


@pytest.mark.parametrize(("gateway", "says"), [
    ('default_policy = "nosuch"\n', "[gateway] default_policy = 'nosuch' is not a known policy"),
    ('[gateway.aliases]\n"chat" = { model = "nosuch" }\n', "no node serves model 'nosuch'"),
    ('[gateway.aliases]\n"chat" = { model = "meta-llama/llama-3-8b-instruct", '
     'policy = "nosuch" }\n', "policy 'nosuch' is not a known policy"),
])
def test_policy_check_refuses_the_gateway_names_serve_would(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], gateway: str, says: str) -> None:
    path = tmp_path / "zml.toml"
    path.write_text(demo_config() + "\n[gateway]\n" + gateway)
    assert main(["policy", "check", "--config", str(path)]) == 2
    assert says in capsys.readouterr().err.replace("\n", " ")


def test_a_warning_is_one_line_of_the_command(tmp_path: Path) -> None:
    path = tmp_path / "zml.toml"
    path.write_text(demo_config())
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    env["ZML_PLUGINS"] = "nosuch"
    proc = subprocess.run([sys.executable, "-m", "zml", "policy", "check", "--config",
                           str(path)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "zml: warning: ZML_PLUGINS names plugin(s) that are not installed: nosuch"]


@pytest.mark.parametrize(("url", "other", "problem"), [
    ("http://localhost", None, "has no port"),
    ("https://127.0.0.1:{port}", None, "serves plain http"),
    ("http://[::1]:{port}", None, "listens on 127.0.0.1"),
    ("http://127.0.0.2:{port}", None, "listens on 127.0.0.1"),
    ("http://127.0.0.1:{port}", "http://127.0.0.1:{port}", "give each simulated node its own"),
])
def test_sim_serve_refuses_a_node_it_could_not_serve_where_its_url_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str, other: str | None,
    problem: str,
) -> None:
    """It served such nodes elsewhere (a random port, plain http, 127.0.0.1) without a word,
    out of reach of every client of the same file, or crashed with a traceback for two nodes
    on one port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [("n1", url.format(port=port))] + ([("n2", other.format(port=port))] if other else [])
    text = "[accelerators.H100]\n" + "".join(
        f'[[nodes]]\nid = "{nid}"\nfamily = "H100"\nurl = "{u}"\nmodels = ["m"]\n'
        "max_concurrency = 1\n" for nid, u in nodes)
    path = tmp_path / "zml.toml"
    path.write_text(text)
    assert main(["sim", "serve", str(path)]) == 2
    err = capsys.readouterr().err
    assert problem in err and "Traceback" not in err and len(err.strip().splitlines()) <= 3


def test_ctrl_c_while_the_command_is_still_starting_is_exit_130_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C in the first second of `zml demo` (while its modules were imported, before the
    command's own handler) printed a KeyboardInterrupt traceback."""
    import zml.cli

    def interrupted() -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(zml.cli, "build_parser", interrupted)
    assert main(["demo"]) == 130
