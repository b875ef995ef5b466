"""examples/llamaindex_settings.py runs against the session's simulated fleet."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from llama_index.core.instrumentation import get_dispatcher

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "llamaindex_settings.py"


def check_output(out: str) -> None:
    lines = out.splitlines()
    assert lines[0].startswith("answer: ") and len(lines[0]) > len("answer: ")
    routes = [line for line in lines if line.startswith("routed to ")]
    assert routes
    assert all("by policy llama3-production" in line for line in routes)


def test_example_with_a_path_argument(
    zml_config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In-process (the offline guard of conftest.py applies): the zml.toml given as argv[1]."""
    dispatcher = get_dispatcher()
    handlers = list(dispatcher.event_handlers)
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), str(zml_config)])
    try:
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(EXAMPLE), run_name="__main__")
    finally:
        dispatcher.event_handlers[:] = handlers
    assert exit_info.value.code == 0
    check_output(capsys.readouterr().out)


def test_example_with_zml_config(zml_config: Path, tmp_path: Path) -> None:
    """As a user runs it: a fresh interpreter, the zml.toml from $ZML_CONFIG."""
    env = {**os.environ, "ZML_CONFIG": str(zml_config)}
    result = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    check_output(result.stdout)


def test_example_reports_a_routing_error(
    zml_config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    dispatcher = get_dispatcher()
    handlers = list(dispatcher.event_handlers)
    monkeypatch.setenv("ZML_MODEL", "nobody/serves-this")
    monkeypatch.setattr(sys, "argv", [str(EXAMPLE), str(zml_config)])
    try:
        with pytest.raises(SystemExit) as exit_info:
            runpy.run_path(str(EXAMPLE), run_name="__main__")
    finally:
        dispatcher.event_handlers[:] = handlers
    assert exit_info.value.code == 1
    assert "no_viable_node" in capsys.readouterr().err
