"""``./integrations/langchain`` installs into a fresh virtual environment with only its declared
dependencies (and ``./zml_core``, which is not on the package index yet), and works there.

Runs in the normal suite; deselect with ``-m "not install"``. uv's cache makes it take a few
seconds; without a cached copy of a dependency it goes to the package index.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CHECK = """
import importlib.metadata, importlib.resources, sys
import langchain_zml
from langchain_zml import ChatZML

assert langchain_zml.__all__ == ["ChatZML"]
assert importlib.resources.files("langchain_zml").joinpath("py.typed").is_file()
for absent in ("langchain_tests",):  # test extras stay out
    assert importlib.util.find_spec(absent) is None, absent
llm = ChatZML(model="meta-llama/llama-3-8b-instruct", policy="llama3-production",
              config=sys.argv[1])
message = llm.invoke("Hello")
print(importlib.metadata.version("langchain-zml"), message.response_metadata["zml_routing"]["node_id"])
"""


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return subprocess.run(
        [str(a) for a in args], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.install
def test_fresh_venv_install(tmp_path: Path, zml_config: Path) -> None:
    uv = os.environ.get("UV") or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed")
    venv = tmp_path / "venv"
    made = run(uv, "venv", "--quiet", "--python", sys.executable, venv)
    assert made.returncode == 0, made.stderr
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    install = (uv, "pip", "install", "--quiet", "--python", python)
    packages = (ROOT / "zml_core", ROOT / "integrations" / "langchain")
    done = run(*install, "--offline", *packages)  # from uv's cache when it has everything
    if done.returncode != 0:
        done = run(*install, *packages)
    assert done.returncode == 0, done.stderr
    checked = run(python, "-c", CHECK, zml_config)
    assert checked.returncode == 0, checked.stderr
    version, node = checked.stdout.split()
    assert version == "0.1.0"
    assert node == "h100-1"
