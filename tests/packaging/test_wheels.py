"""The built distributions work as PyPI would deliver them: wheels installed into fresh virtual
environments outside the workspace, and complete metadata in every wheel and sdist.

The other install tests (``tests/integrations/*/test_install.py``) install from the source
folders; these build the wheels and sdists with ``uv build`` exactly as a release would, so that
what is checked is what gets published: the files hatchling includes (LICENSE, py.typed), the
metadata PyPI shows (classifiers, URLs, a README that renders on its own), and that a plain
``pip install zmlai`` gives a working ``zml demo``.

Installs use uv's cache first (``--offline``) and go to the package index only when something
is missing from it.
"""

from __future__ import annotations

import email.parser
import os
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

pytestmark = pytest.mark.install

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = {
    # distribution name -> (source folder, import package as a path inside the wheel)
    "zmlai": ("zml_core", "zml"),
    "langchain-zml": ("integrations/langchain", "langchain_zml"),
    "llama-index-llms-zml": ("integrations/llama-index", "llama_index/llms/zml"),
    "zml-redis": ("plugins/redis", "zml_redis"),
    "zml-policy-sqlite": ("plugins/sqlite", "zml_policy_sqlite"),
}
PYTHONS = ("3.10", "3.11", "3.12", "3.13")
URLS = {
    "Homepage": "https://github.com/zmlai/zml",
    "Documentation": "https://zmlai.github.io/zml/",
    "Changelog": "https://github.com/zmlai/zml/blob/main/CHANGELOG.md",
    "Issues": "https://github.com/zmlai/zml/issues",
}
# Variables that would point a subprocess back at the workspace's environment.
_WORKSPACE_VARS = ("VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT", "PYTHONPATH", "PYTHONHOME",
                   "ZML_CONFIG", "ZML_API_KEY")
TIMEOUT_S = 600


def _uv() -> str:
    uv = os.environ.get("UV") or shutil.which("uv")
    assert uv, "these tests build and install with uv: `pip install uv`, then run them again"
    return uv


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _WORKSPACE_VARS}


def run(args: Sequence[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a command outside the workspace; the result, whatever its exit status."""
    return subprocess.run([str(a) for a in args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S, check=False)


def run_ok(args: Sequence[str | Path], cwd: Path) -> subprocess.CompletedProcess[str]:
    done = run(args, cwd)
    command = " ".join(str(a) for a in args)
    assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def offline_then_online(args: Sequence[str | Path], cwd: Path) -> None:
    """Run a uv command from its cache; when the cache lacks something, let it fetch."""
    if run([*args, "--offline"], cwd).returncode != 0:
        run_ok(args, cwd)


@dataclass(frozen=True)
class Built:
    wheels: dict[str, Path]
    sdists: dict[str, Path]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """Every distribution's wheel and sdist, built by `uv build` into a folder of its own."""
    out = tmp_path_factory.mktemp("dist")
    for name in DISTRIBUTIONS:
        offline_then_online([_uv(), "build", "--quiet", "--package", name, "--out-dir", out],
                            ROOT)
    wheels: dict[str, Path] = {}
    sdists: dict[str, Path] = {}
    for name in DISTRIBUTIONS:
        stem = name.replace("-", "_")
        [wheel] = out.glob(f"{stem}-*-py3-none-any.whl")
        [sdist] = out.glob(f"{stem}-*.tar.gz")
        wheels[name], sdists[name] = wheel, sdist
    return Built(wheels, sdists)


def wheel_metadata(wheel: Path) -> tuple[Message, list[str]]:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        [meta] = [n for n in names if n.endswith(".dist-info/METADATA")]
        text = archive.read(meta).decode("utf-8")
    return email.parser.Parser().parsestr(text), names


# --- what the archives hold ---------------------------------------------------------------


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_wheel_ships_the_license_and_py_typed(built: Built, name: str) -> None:
    _, names = wheel_metadata(built.wheels[name])
    package = DISTRIBUTIONS[name][1]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert f"{package}/py.typed" in names
    license_text = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
    with zipfile.ZipFile(built.wheels[name]) as archive:
        assert b"Apache License" in archive.read(license_text)
        assert archive.read(license_text) == (ROOT / "LICENSE").read_bytes()


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_sdist_ships_the_license_readme_and_sources(built: Built, name: str) -> None:
    with tarfile.open(built.sdists[name]) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
    package = DISTRIBUTIONS[name][1]
    assert {"LICENSE", "README.md", "pyproject.toml"} <= names, sorted(names)
    assert any(n.startswith(package + "/") or f"/{package}/" in n for n in names), sorted(names)


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_an_sdists_pyproject_stands_on_its_own(built: Built, name: str) -> None:
    """No ``workspace = true`` source: uv refuses to build an unpacked sdist (or a path
    dependency on it) whose pyproject points into a workspace it is not part of."""
    with tarfile.open(built.sdists[name]) as archive:
        [member] = [m for m in archive.getmembers() if m.name.count("/") == 1
                    and m.name.endswith("/pyproject.toml")]
        extracted = archive.extractfile(member)
        assert extracted is not None
        pyproject = tomllib.loads(extracted.read().decode())
    assert "sources" not in pyproject.get("tool", {}).get("uv", {}), pyproject["tool"]


# --- what PyPI shows ----------------------------------------------------------------------


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_wheel_metadata_is_complete(built: Built, name: str) -> None:
    meta, _ = wheel_metadata(built.wheels[name])
    assert meta["Name"] == name
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["License-File"] == "LICENSE"
    assert meta["Author"] == "The zml authors"
    assert meta["Requires-Python"] == ">=3.10"
    assert meta["Keywords"]
    classifiers = set(meta.get_all("Classifier") or [])
    assert "Typing :: Typed" in classifiers
    assert {f"Programming Language :: Python :: {v}" for v in PYTHONS} <= classifiers
    assert any(c.startswith("Development Status :: ") for c in classifiers)
    assert any(c.startswith("Topic :: ") for c in classifiers)
    # PEP 639: the licence is the License-Expression; License :: classifiers are deprecated.
    assert not any(c.startswith("License :: ") for c in classifiers)
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL") or [])
    assert {k: urls.get(k) for k in URLS} == URLS
    if name != "zmlai":
        assert any(r.startswith("zmlai>=") for r in meta.get_all("Requires-Dist") or [])


@pytest.mark.parametrize("name", DISTRIBUTIONS)
def test_long_description_renders_on_its_own(built: Built, name: str) -> None:
    """The README is the PyPI page: every link is absolute, none into the repository."""
    meta, _ = wheel_metadata(built.wheels[name])
    assert meta["Description-Content-Type"] == "text/markdown"
    readme = meta.get_payload()
    assert isinstance(readme, str)
    assert len(readme) > 800, "a real README: what it is, how to install it, a first example"
    assert "See the project README" not in readme
    targets = re.findall(r"\]\(([^)\s]+)\)", readme) + re.findall(r"<([a-z]+:[^>\s]+)>", readme)
    assert targets, "links to the documentation and the repository"
    relative = [t for t in targets if not re.match(r"https?://|mailto:|#", t)]
    assert not relative, f"links that break on PyPI: {relative}"
    assert "pip install " + name in readme


# --- fresh installs -------------------------------------------------------------------------


@pytest.fixture
def fresh_python(tmp_path: Path) -> Callable[..., Path]:
    """Make a fresh virtual environment in a temporary folder, install wheels; its python."""

    def make(*wheels: Path) -> Path:
        venv = tmp_path / "venv"
        run_ok([_uv(), "venv", "--quiet", "--python", sys.executable, venv], tmp_path)
        python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
        offline_then_online([_uv(), "pip", "install", "--quiet", "--python", python, *wheels],
                            tmp_path)
        return python

    return make


# Runs in the fresh environment: a simulated node from the installed zml, and its zml.toml.
FLEET = textwrap.dedent('''
    import json, pathlib
    from zml.sim import SimFleet, SimNodeSpec

    MODEL = "meta-llama/llama-3-8b-instruct"
    fleet = SimFleet([SimNodeSpec(id="h100-1", family="H100", models=(MODEL,),
                                  max_concurrency=2)], time_scale=0.05).start()
    pathlib.Path("zml.toml").write_text(
        "[accelerators.H100]\\n\\n[[nodes]]\\n"
        'id = "h100-1"\\nfamily = "H100"\\n'
        f"url = {json.dumps(fleet.url('h100-1'))}\\n"
        f"models = {json.dumps([MODEL])}\\nmax_concurrency = 2\\n\\n"
        '[policies.llama3-production]\\naccelerator_chain = ["H100"]\\n'
    )
''')


def test_zmlai_wheel_gives_a_working_zml_demo(built: Built,
                                              fresh_python: Callable[..., Path],
                                              tmp_path: Path) -> None:
    python = fresh_python(built.wheels["zmlai"])
    zml = python.parent / ("zml.exe" if os.name == "nt" else "zml")
    demo_dir = tmp_path / "demo"
    done = run_ok([zml, "demo", "--time-scale", "0.05", "--dir", demo_dir], tmp_path)
    assert "RoutingError" in done.stdout, done.stdout
    assert (demo_dir / "zml.toml").is_file()
    # only the wheel's own code: nothing imported from the workspace
    where = run_ok([python, "-c", "import zml; print(zml.__file__)"], tmp_path).stdout
    assert str(python.parent.parent) in where and str(ROOT) not in where


def test_langchain_zml_wheel_invokes_a_simulated_node(built: Built,
                                                      fresh_python: Callable[..., Path],
                                                      tmp_path: Path) -> None:
    python = fresh_python(built.wheels["zmlai"], built.wheels["langchain-zml"])
    script = FLEET + textwrap.dedent('''
        from langchain_zml import ChatZML

        try:
            llm = ChatZML(model=MODEL, policy="llama3-production")
            message = llm.invoke("Hello")
            assert message.content, message
            print(message.response_metadata["zml_routing"]["node_id"])
        finally:
            fleet.stop()
    ''')
    done = run_ok([python, "-c", script], tmp_path)
    assert done.stdout.split() == ["h100-1"], done.stdout


def test_llama_index_wheel_completes_as_settings_llm(built: Built,
                                                     fresh_python: Callable[..., Path],
                                                     tmp_path: Path) -> None:
    python = fresh_python(built.wheels["zmlai"], built.wheels["llama-index-llms-zml"])
    script = FLEET + textwrap.dedent('''
        from llama_index.core import Settings
        from llama_index.llms.zml import ZML

        try:
            Settings.llm = ZML(model=MODEL, policy="llama3-production")
            response = Settings.llm.complete("Hello")
            assert response.text, response
            print(response.additional_kwargs["zml_routing"]["node_id"])
        finally:
            fleet.stop()
    ''')
    done = run_ok([python, "-c", script], tmp_path)
    assert done.stdout.split() == ["h100-1"], done.stdout
