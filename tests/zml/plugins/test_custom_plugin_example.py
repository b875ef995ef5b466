"""examples/custom_plugin/ runs as a user would run it, against the simulated fleet."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from zml.config import load_registry
from zml.sim import SimFleet
from zml.sim.from_config import specs_from_registry

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "custom_plugin"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def fleet_dir(tmp_path: Path) -> Iterator[Path]:
    text = re.sub(r"127\.0\.0\.1:\d+", lambda _: f"127.0.0.1:{_free_port()}",
                  (ROOT / "examples" / "zml.toml").read_text())
    (tmp_path / "zml.toml").write_text(text)
    specs, ports = specs_from_registry(load_registry(tmp_path / "zml.toml"))
    with SimFleet(specs, ports=ports, time_scale=0.05):
        yield tmp_path


def test_custom_plugin_example(fleet_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    proc = subprocess.run([sys.executable, str(EXAMPLE / "run.py")], cwd=fleet_dir, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "policies: batch, interactive, llama3-production, support-bot"
    assert re.match(r"search interactive: h100-\d \(H100\), 0\.\d+ USD", lines[1]), lines
    assert re.match(r"support support-bot: mi300x-1 \(MI300X\), 0\.\d+ USD", lines[2]), lines
    assert lines[4].startswith("finance llama3-production: ")
    report = lines[5:]
    assert sorted(line.split(":")[0] for line in report) == ["finance", "search", "support"]
    assert any(line.startswith("support: 2 request(s), 0.0") for line in report), report
