"""``zml fleet status``: one table line per node, and why a node is down printed whole below."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

NODE = """
[[nodes]]
id = "{id}"
family = "{family}"
url = "http://127.0.0.1:{port}"
models = ["m"]
max_concurrency = 4
"""


def _status(config: Path, columns: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_") and k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = columns
    return subprocess.run([sys.executable, "-m", "zml", "fleet", "status", "--config",
                           str(config)], env=env, capture_output=True, text=True, timeout=120)


def _body(stdout: str) -> list[str]:
    """The table's body lines: between the header rule and the bottom border."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("┡"))
    end = next(i for i, line in enumerate(lines) if line.startswith("└"))
    return lines[start + 1:end]


def _closed_ports(n: int) -> list[int]:
    """Ports nothing listens on (bound, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("columns", ["80", None], ids=["80-columns", "piped"])
def test_down_nodes_keep_one_line_each_and_the_reason_is_printed_whole(
        tmp_path: Path, columns: str | None) -> None:
    ids = ["h100-1", "mi300x-1", "h100-pcie-1"]
    families = ["H100", "MI300X", "H100_PCIe"]
    config = tmp_path / "zml.toml"
    config.write_text("".join(f"[accelerators.{f}]\ncost_per_hour = 2.0\n" for f in families)
                      + "".join(NODE.format(id=i, family=f, port=p) for i, f, p in
                                zip(ids, families, _closed_ports(3), strict=True)))
    proc = _status(config, columns)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    body = _body(proc.stdout)
    assert len(body) == len(ids), proc.stdout  # one line per node, nothing folded
    for node_id, family, line in zip(ids, families, body, strict=True):
        assert node_id in line and family in line and " down " in line, line
        assert "Error" not in line, line
    for line in proc.stdout.splitlines():
        if set(line) & set("│┃┏┓┗┛┡┩─━"):
            assert len(line) <= 80, line
    reasons = [line for line in proc.stdout.splitlines() if "Connection refused" in line]
    assert [r.split(":", 1)[0] for r in reasons] == ids, proc.stdout
    for reason in reasons:  # whole, on one line (no wrap when piped or at 80 columns)
        assert ": down ConnectError: " in reason and reason.endswith("Connection refused")


def test_up_and_down_nodes_side_by_side(seed_fleet: Any) -> None:
    seed_fleet.fleet.kill("h100-pcie-1")
    proc = _status(seed_fleet.path, "80")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    body = _body(proc.stdout)
    assert len(body) == len(seed_fleet.fleet.urls), proc.stdout
    for line in body:
        assert (" down " in line) == ("h100-pcie-1" in line), line
    below = proc.stdout.split("└", 1)[1].splitlines()[1:]
    assert len(below) == 1 and below[0].startswith("h100-pcie-1: down "), proc.stdout
