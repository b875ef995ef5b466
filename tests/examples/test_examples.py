"""Every script in examples/ runs, as a user would run it, against the simulated fleet.

The fleet is examples/zml.toml itself, served on free loopback ports (the file's own ports may
be busy on a shared machine); the script runs in a subprocess from a folder holding that copy.
"""

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

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
TESTS = ROOT / "tests"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def example_dir(tmp_path: Path) -> Iterator[Path]:
    text = re.sub(r"127\.0\.0\.1:\d+", lambda _: f"127.0.0.1:{_free_port()}",
                  (EXAMPLES / "zml.toml").read_text())
    (tmp_path / "zml.toml").write_text(text)
    specs, ports = specs_from_registry(load_registry(tmp_path / "zml.toml"))
    with SimFleet(specs, ports=ports):
        yield tmp_path


def run_example(name: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_quickstart(example_dir: Path) -> None:
    out = run_example("quickstart.py", example_dir)
    assert re.search(r"served by h100-\d \(H100\), queue depth 0", out), out


def test_toml_policies(example_dir: Path) -> None:
    out = run_example("toml_policies.py", example_dir)
    assert "policy llama3-production: H100 -> MI300X -> H100_PCIe" in out
    assert "llama3-production: h100-" in out
    assert "batch: h100-pcie-1 (H100_PCIe)" in out


def test_async_client(example_dir: Path) -> None:
    out = run_example("async_client.py", example_dir)
    lines = out.splitlines()
    families = [line.split("(")[1].rstrip(")") for line in lines[:6]]
    assert families.count("H100") >= 2 and "MI300X" in families  # H100 filled, then fallback
    assert lines[6].startswith("streamed: ")
    assert lines[-1] == "in flight after cancelling: 0"


def test_fallback_02_style(example_dir: Path) -> None:
    out = run_example("fallback_02_style.py", example_dir)
    assert re.search(r"served on H100 by h100-\d", out), out


def test_every_example_is_run_by_a_test() -> None:
    test_text = "\n".join(p.read_text() for p in TESTS.rglob("test_*.py"))
    examples = [p for p in EXAMPLES.rglob("*.py") if p.name != "__init__.py"]
    assert examples
    missing = [str(p.relative_to(EXAMPLES)) for p in examples
               if p.name not in test_text and p.parent.name not in test_text]
    assert not missing, f"examples no test runs: {missing}"
