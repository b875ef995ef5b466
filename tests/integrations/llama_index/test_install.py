"""The distribution installs into a fresh virtualenv beside llama-index-core, as a PEP 420
namespace portion: it ships llama_index/llms/zml/ only, no llama_index/__init__.py or
llama_index/llms/__init__.py that would shadow other integrations."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

CHECK = """
import importlib.metadata, json
import llama_index, llama_index.llms
from llama_index.llms.zml import ZML
from llama_index.core.llms.function_calling import FunctionCallingLLM
import llama_index.llms.zml as package
files = [str(f) for f in importlib.metadata.files("llama-index-llms-zml")]
print(json.dumps({
    "all": package.__all__,
    "function_calling": issubclass(ZML, FunctionCallingLLM),
    "namespace_files": [llama_index.__file__, llama_index.llms.__file__],
    "files": files,
}))
"""


@pytest.mark.skipif(shutil.which("uv") is None, reason="needs the uv command")
def test_fresh_venv_install(tmp_path: Path) -> None:
    uv = shutil.which("uv")
    assert uv is not None
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                                timeout=300, check=False)
        assert result.returncode == 0, result.stderr
        return result

    run(uv, "venv", "--quiet", "--python", sys.executable, str(venv))
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    run(uv, "pip", "install", "--quiet", "--python", str(python),
        "./zml_core", "./integrations/llama-index")
    report = json.loads(run(str(python), "-c", CHECK).stdout)

    assert report["all"] == ["ZML"]
    assert report["function_calling"] is True
    assert report["namespace_files"] == [None, None]  # both are namespace packages
    packaged = [f for f in report["files"] if not f.startswith("llama_index_llms_zml-")]
    assert packaged
    assert all(f.startswith("llama_index/llms/zml/") for f in packaged), packaged
    assert "llama_index/llms/zml/py.typed" in packaged
