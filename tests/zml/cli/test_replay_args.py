"""``zml sim replay``: ``--plot`` and ``TRACE`` arguments refused up front, in one line.

``--plot OUT`` ends in ``.png`` (matplotlib) or ``.html``, in any case; anything else (another
extension, none) is exit status 2 before the replay runs, as is a ``.png`` without matplotlib.
Where matplotlib is "installed", it is a stub on ``PYTHONPATH`` that writes a file at the path
``savefig`` is given, and fails any test that makes it draw when nothing should be drawn.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zml.cli import main
from zml.errors import InvalidRequestError
from zml.sim.report import plot
from zml.sim.traces import TraceError, read_trace

from .test_replay_cli import AZURE, CONFIG

STUB_PYPLOT = """
import os
DRAW = os.environ.get("STUB_MPL_DRAW") == "1"

class _Axes:
    def __getattr__(self, name):
        return lambda *a, **k: None

class _Figure:
    def tight_layout(self):
        pass
    def savefig(self, fname, **kwargs):
        fmt = kwargs.get("format") or os.path.splitext(str(fname))[1][1:].lower() or "png"
        if fmt not in ("png", "pdf", "svg"):
            raise ValueError(f"Format {fmt!r} is not supported")
        with open(fname, "wb") as f:
            f.write(b"\\x89PNG stub")

def subplots(rows, cols, **kwargs):
    if not DRAW:
        raise AssertionError("the stub matplotlib was asked to draw")
    return _Figure(), [[_Axes()] for _ in range(rows)]

def close(fig):
    pass
"""


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "zml.toml"
    path.write_text(CONFIG)
    return str(path)


@pytest.fixture
def stub_matplotlib(tmp_path: Path) -> Path:
    pkg = tmp_path / "stubs" / "matplotlib"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("def use(backend):\n    pass\n")
    (pkg / "pyplot.py").write_text(STUB_PYPLOT)
    return pkg.parent


def _replay(*args: str, stubs: Path | None = None, draw: bool = False,
            no_matplotlib: bool = False) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    env.update(COLUMNS="200", STUB_MPL_DRAW="1" if draw else "0")
    if stubs is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(stubs), env.get("PYTHONPATH")]))
    prelude = "import sys; sys.modules['matplotlib'] = None\n" if no_matplotlib else ""
    code = (prelude + "from zml.cli import main\n"
            f"raise SystemExit(main(['sim', 'replay', *{list(args)!r}]))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def _one_line_error(proc: subprocess.CompletedProcess[str], message: str) -> None:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stdout == ""  # refused before the replay: no table
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", ["out.txt", "out.pdf", "out.svg", "out.jpg", "out.png.txt"])
def test_an_unsupported_plot_extension_is_refused_before_the_replay(
        config: str, tmp_path: Path, stub_matplotlib: Path, name: str) -> None:
    target = tmp_path / name
    suffix = Path(name).suffix
    proc = _replay(AZURE, "--config", config, "--policy", "cheap", "--limit", "50",
                   "--json", str(tmp_path / "r.json"), "--plot", str(target),
                   stubs=stub_matplotlib, draw=True)
    _one_line_error(proc, f"--plot {str(target)!r} has an unsupported extension {suffix!r}; "
                    "name a .png or .html file")
    assert not target.exists() and not (tmp_path / "r.json").exists()


def test_an_unsupported_plot_extension_is_named_without_matplotlib_too(
        config: str, tmp_path: Path) -> None:
    proc = _replay(AZURE, "--config", config, "--limit", "20", "--strategy", "random",
                   "--plot", str(tmp_path / "out.txt"), no_matplotlib=True)
    _one_line_error(proc, "has an unsupported extension '.txt'; name a .png or .html file")
    assert "matplotlib" not in proc.stderr


@pytest.mark.parametrize("matplotlib", ["stub", "missing"])
def test_a_plot_without_an_extension_is_refused(config: str, tmp_path: Path,
                                                stub_matplotlib: Path, matplotlib: str) -> None:
    target = tmp_path / "out"
    proc = _replay(AZURE, "--config", config, "--limit", "20", "--strategy", "random",
                   "--plot", str(target), stubs=stub_matplotlib, draw=True,
                   no_matplotlib=matplotlib == "missing")
    _one_line_error(proc, f"--plot {str(target)!r} has no extension; name a .png or .html "
                    f"file, e.g. {str(target) + '.html'!r}")
    assert not target.exists() and not (tmp_path / "out.png").exists()


def test_a_png_without_matplotlib_is_refused_before_the_trace_is_replayed(
        config: str, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    proc = _replay(AZURE, "--config", config, "--strategy", "random", "--json", str(out_json),
                   "--plot", str(tmp_path / "p.png"), no_matplotlib=True)
    _one_line_error(proc, "PNG plots need matplotlib; install it with `pip install "
                    "'zmlai[plot]'`")
    assert not out_json.exists()  # the results were not computed (nor written) first
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("name", ["p.png", "p.PNG"])
def test_a_png_plot_is_written_at_the_path_given(config: str, tmp_path: Path,
                                                 stub_matplotlib: Path, name: str) -> None:
    target = tmp_path / name
    proc = _replay(AZURE, "--config", config, "--limit", "20", "--strategy", "random",
                   "--plot", str(target), stubs=stub_matplotlib, draw=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"plot written to {target}" in proc.stdout
    assert target.read_bytes().startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.lower().startswith("p.")) == [name]


def test_an_html_plot_takes_any_case(config: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "out.HTML"
    status = main(["sim", "replay", AZURE, "--config", config, "--limit", "20", "--strategy",
                   "random", "--plot", str(target)])
    assert status == 0
    assert f"plot written to {target}" in capsys.readouterr().out
    assert target.read_text().startswith("<!doctype html>")


@pytest.mark.parametrize(("name", "problem"), [
    ("out", "has no extension"), ("out.txt", "has an unsupported extension '.txt'"),
    (".png", "has no extension")])
def test_plot_itself_refuses_what_it_cannot_write(tmp_path: Path, name: str,
                                                  problem: str) -> None:
    from zml.sim.report import check_plot

    target = str(tmp_path / name)
    with pytest.raises(InvalidRequestError, match=problem):
        check_plot(target)
    with pytest.raises(InvalidRequestError, match=problem):
        plot([], target)
    assert not Path(target).exists() and not Path(target + ".png").exists()


def test_a_directory_given_as_the_trace_is_named_a_directory(
        config: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "adir"
    folder.mkdir()
    status = main(["sim", "replay", str(folder), "--config", config, "--strategy", "random"])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err == (f"error: TraceError: {folder}: is a directory, not a trace file; "
                            "pass the path of a .csv (Azure) or .jsonl (Mooncake or zml) trace "
                            "in it\n")
    assert "no such" not in captured.err


def test_read_trace_tells_a_missing_file_a_directory_and_a_device_apart(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such trace file") as missing:
        read_trace(tmp_path / "missing.csv")
    assert missing.value.path == str(tmp_path / "missing.csv") and missing.value.line is None
    with pytest.raises(TraceError, match=r": is a directory, not a trace file"):
        read_trace(tmp_path)
    if Path("/dev/null").exists():
        with pytest.raises(TraceError, match="/dev/null: is not a regular file"):
            read_trace("/dev/null")
