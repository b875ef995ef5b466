"""Every message the ``zml`` command prints, read at 80 columns as a user's terminal shows it.

Errors are one message (exit status 2, no traceback) whose text survives printing: bracketed
hints such as ``[policies.NAME]`` are not eaten as markup, and no line break is inserted
inside a message. Tables keep node ids and URLs (with their ports) whole, and never cut a
cell with an ellipsis.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from zml.cli.demo import demo_config

NODE = """
[[nodes]]
id = "{id}"
family = "{family}"
url = "{url}"
models = ["m"]
max_concurrency = {slots}
"""


def zml80(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
          timeout: float = 120) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    base.update(COLUMNS="80", LINES="50", **(env or {}))
    return subprocess.run([sys.executable, "-m", "zml", *args], cwd=cwd, env=base,
                          capture_output=True, text=True, timeout=timeout)


BORDERS = set("│┃┏┓┗┛┡┩╭╮╰╯─━")


def assert_fits(text: str) -> None:
    """Tables and panels fit in 80 columns, with no cell cut short; messages are not wrapped
    by zml (the terminal wraps them), so they may be longer."""
    assert "Traceback" not in text
    assert "…" not in text, text
    for line in text.splitlines():
        if BORDERS & set(line):
            assert len(line) <= 80, line


def assert_error(proc: subprocess.CompletedProcess[str], *messages: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_fits(proc.stdout)
    assert "Traceback" not in proc.stderr
    for message in messages:
        assert message in proc.stderr, proc.stderr


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_policy_check_lists_every_problem_in_the_file(tmp_path: Path) -> None:
    text = ("[accelerators.H100]\ncost_per_hour = -1\n[accelerators.MI300X]\n[acelerators.X]\n"
            + NODE.format(id="a", family="MI300X", url="http://127.0.0.1:1", slots='"2"')
            + NODE.format(id="b", family="MI300X", url="http://alice:PW@127.0.0.1:2", slots=1)
            + NODE.format(id="c", family="MI300X", url="http://127.0.0.1:3", slots=1)
            + NODE.format(id="c", family="MI300X", url="http://127.0.0.1:4", slots=1)
            + '[policies.p]\naccelerator_chain = ["TPU"]\n'
            + '[policies.q]\naccelerator_chain = ["MI300X"]\nlatency_target = 5\n')
    path = write(tmp_path / "zml.toml", text)
    proc = zml80("policy", "check", "--config", str(path))
    assert_error(
        proc,
        "unknown table [acelerators]; did you mean [accelerators]?",
        "accelerators.H100.cost_per_hour = -1",
        "nodes[0].max_concurrency = '2': Input should be a valid integer",
        "nodes[1]: node 'b': url 'http://127.0.0.1:2' (shown without them) contains credentials",
        "nodes[3].id 'c' is a duplicate of nodes[2].id",
        "[policies.p] policy 'p': accelerator_chain[0] = 'TPU' is not a registered",
        "[policies.q] policy 'q': unknown field 'latency_target'",
        f"7 problems in {path}",
    )
    assert "PW" not in proc.stderr and "alice" not in proc.stderr
    assert proc.stderr.count("error: PolicyConfigError: ") == 7


@pytest.mark.parametrize("text", ["", "# nothing yet\n"])
def test_an_empty_config_fails_the_check(tmp_path: Path, text: str) -> None:
    path = write(tmp_path / "zml.toml", text)
    assert_error(zml80("policy", "check", "--config", str(path)),
                 f"{path} is empty: define at least one [accelerators.NAME] family")


def test_a_valid_config_passes_the_check_and_its_table_fits(tmp_path: Path) -> None:
    path = write(tmp_path / "zml.toml", demo_config())
    proc = zml80("policy", "check", "--config", str(path))
    assert proc.returncode == 0, proc.stderr
    assert_fits(proc.stdout)
    assert "llama3-production" in proc.stdout
    assert "ok: 3 families, 5 nodes, 1 policies" in proc.stdout


def test_bracketed_hints_survive_printing(tmp_path: Path) -> None:
    path = write(tmp_path / "zml.toml", demo_config())
    proc = zml80("route", "--config", str(path), "--policy", "nope", "--model", "m")
    assert_error(proc, "define it under [policies.NAME] in zml.toml")


def test_an_unknown_accelerator_family_is_named(tmp_path: Path) -> None:
    path = write(tmp_path / "zml.toml", demo_config())
    proc = zml80("route", "--config", str(path), "--model", "m", "--accelerator", "TPU")
    assert_error(proc, "error: --accelerator TPU: unknown accelerator family (registered: "
                       "H100, MI300X, H100_PCIe)")
    proc = zml80("route", "--config", str(path), "--model", "m", "--accelerator", "h100")
    assert_error(proc, "did you mean H100?")


def test_no_config_is_one_message(tmp_path: Path) -> None:
    assert_error(zml80("fleet", "status", cwd=tmp_path), "error: PolicyConfigError: no zml.toml "
                 "found: pass --config PATH, set ZML_CONFIG, or run where a zml.toml is")


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf", "fast"])
def test_a_bad_time_scale_is_one_message(value: str) -> None:
    proc = zml80("demo", f"--time-scale={value}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "argument --time-scale:" in proc.stderr


def test_a_bad_request_count_is_one_message() -> None:
    proc = zml80("demo", "--requests", "0")
    assert proc.returncode == 2 and "argument --requests: '0': must be at least 1" in proc.stderr


def test_an_unwritable_dir_is_one_message(tmp_path: Path) -> None:
    blocker = write(tmp_path / "a-file", "")
    assert_error(zml80("demo", "--dir", str(blocker / "sub")),
                 f"error: --dir {blocker / 'sub'}: cannot create the folder")
    if os.geteuid() != 0:  # root can write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert_error(zml80("demo", "--dir", str(locked)), "cannot write")


def test_a_project_s_own_zml_toml_is_never_overwritten(tmp_path: Path) -> None:
    mine = write(tmp_path / "zml.toml", "[accelerators.H100]\n# my fleet\n")
    assert_error(zml80("demo", "--dir", str(tmp_path)),
                 f"error: --dir {tmp_path}: {mine} exists and was not written by `zml demo`")
    assert mine.read_text() == "[accelerators.H100]\n# my fleet\n"


def test_an_earlier_demo_s_zml_toml_may_be_replaced(tmp_path: Path) -> None:
    from zml.cli.demo import _refuse_to_overwrite, demo_config

    _refuse_to_overwrite(write(tmp_path / "zml.toml", demo_config()), str(tmp_path))


def test_a_busy_port_names_the_node_and_the_port(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        text = ("[accelerators.H100]\n"
                + NODE.format(id="free-1", family="H100", url="http://127.0.0.1:1", slots=1)
                .replace("127.0.0.1:1", f"127.0.0.1:{_free_port()}")
                + NODE.format(id="busy-1", family="H100", url=f"http://127.0.0.1:{port}",
                              slots=1))
        path = write(tmp_path / "zml.toml", text)
        proc = zml80("sim", "serve", str(path))
    assert_error(proc, f"error: node 'busy-1' cannot listen on 127.0.0.1:{port}: the port is "
                       "already in use")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_route_and_fleet_status_tables_keep_ids_and_urls_whole(seed_fleet: Any) -> None:
    proc = zml80("route", "--config", str(seed_fleet.path), "--policy", "llama3-production",
                 "--model", "meta-llama/llama-3-8b-instruct", "--explain")
    assert proc.returncode == 0, proc.stderr
    assert_fits(proc.stdout)
    assert re.search(r"would route to h100-\d \(H100\)", proc.stdout)
    seed_fleet.fleet.kill("h100-pcie-1")
    proc = zml80("fleet", "status", "--config", str(seed_fleet.path))
    assert proc.returncode == 1, proc.stderr
    assert_fits(proc.stdout)
    lines = proc.stdout.splitlines()
    for node_id, url in seed_fleet.fleet.urls.items():
        assert any(node_id in line and url in line for line in lines), (node_id, url)


def test_the_demo_fits_80_columns_and_leaves_no_folder_behind(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = zml80("demo", "--time-scale", "0.3", "--requests", "12", env={"TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert_fits(proc.stdout)
    out = proc.stdout
    assert list(tmp.iterdir()) == []
    assert "config: a temporary folder, now removed" in out
    for port in re.findall(r'url = "http://127\.0\.0\.1:(\d+)"', out):
        assert int(port) > 0
    assert len(re.findall(r'url = "http://127\.0\.0\.1:\d+"', out)) == 5
    # the cancellation is reported after the routing error it follows
    assert out.index('"final_error": "no_viable_node"') < out.index("cancelled 20 held streams")
