"""examples/langchain_chat.py runs: against the session fleet, and with its own ``--sim``."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "examples" / "langchain_chat.py"
ROUTE = re.compile(
    r"^(invoke|stream|batch): served by (h100|mi300x)-\d \((H100|MI300X)\) under policy "
    r"llama3-production, queue depth \d+, \d+ tokens$",
    re.MULTILINE,
)


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("langchain_chat_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_output(out: str) -> None:
    assert out.startswith("answer: ")
    kinds = [m.group(1) for m in ROUTE.finditer(out)]
    assert kinds == ["invoke", "stream", "batch", "batch", "batch"], out


def test_langchain_chat_with_a_config_path(
    zml_config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert load_example().main([str(zml_config)]) == 0
    check_output(capsys.readouterr().out)


def test_langchain_chat_with_zml_config_env(
    zml_config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ZML_CONFIG", str(zml_config))
    assert load_example().main([]) == 0
    check_output(capsys.readouterr().out)


def test_langchain_chat_sim_as_a_script(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--sim"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    check_output(proc.stdout)
