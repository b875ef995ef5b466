"""``zml sim replay``: the table, --json, --plot, and one clear error for each bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zml.cli import main

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"
AZURE = str(FIXTURES / "azure-conv-300.csv")
CONFIG = """
[accelerators.A100]
cost_per_hour = 1.8
[accelerators.H100]
cost_per_hour = 4.0

[[nodes]]
id = "a100-1"
family = "A100"
url = "http://10.0.0.1:8000"
models = ["m"]
max_concurrency = 8
max_queue = 8

[[nodes]]
id = "h100-1"
family = "H100"
url = "http://10.0.0.2:8000"
models = ["m"]
max_concurrency = 8
max_queue = 8

[policies.cheap]
accelerator_chain = ["A100", "H100"]
latency_target_ms = 800
cost_priority = "cost"
"""


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "zml.toml"
    path.write_text(CONFIG)
    return str(path)


def test_replay_prints_a_row_per_policy_and_strategy_and_writes_json(
        config: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "r.json"
    out_html = tmp_path / "r.html"
    status = main(["sim", "replay", AZURE, "--config", config, "--policy", "cheap",
                   "--strategy", "round_robin", "--strategy", "least_busy", "--limit", "120",
                   "--rate-scale", "2", "--json", str(out_json), "--plot", str(out_html)])
    out = capsys.readouterr().out
    assert status == 0
    assert "cheap (policy)" in out and "round_robin" in out and "least_busy" in out
    doc = json.loads(out_json.read_text())
    assert doc["requests"] == 120 and doc["trace"] == AZURE
    assert [(r["name"], r["kind"]) for r in doc["results"]] == [
        ("cheap", "policy"), ("round_robin", "strategy"), ("least_busy", "strategy")]
    for row in doc["results"]:
        assert row["completed"] + sum(row["errors"].values()) == 120
        assert row["slo_ms"] == 800  # the policy's own target, and the default for strategies
    page = out_html.read_text()
    assert page.startswith("<!doctype html>") and "<svg" in page and "round_robin" in page


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "zml", "sim", "replay", *args],
                          capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "COLUMNS": "200"})


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.csv"], "no such trace file"),
        (["BAD"], "line 3: field 'GeneratedTokens'"),
        ([AZURE, "--strategy", "round_robbin"], "unknown strategy 'round_robbin'"),
        ([AZURE, "--policy", "cheep"], "no policy 'cheep'"),
        ([AZURE, "--rate-scale", "0"], "--rate-scale must be a number > 0"),
        ([AZURE, "--rate-scale", "-2"], "--rate-scale must be a number > 0"),
        ([AZURE, "--rate-scale", "1e-300"], "--rate-scale must be from 0.001 to 1000"),
        ([AZURE, "--rate-scale", "1e6"], "--rate-scale must be from 0.001 to 1000"),
        ([AZURE, "--slo-ms", "inf"], "--slo-ms must be a finite number > 0, got inf"),
        ([AZURE, "--model", "other"], "no node of the config serves --model 'other'"),
    ],
)
def test_bad_input_is_one_clear_error_with_status_2(config: str, tmp_path: Path,
                                                    args: list[str], message: str) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6,10,3\n"
                   "2023-11-16 18:15:47.6,10,lots\n")
    args = [str(bad) if a == "BAD" else str(tmp_path / a) if a == "missing.csv" else a
            for a in args]
    proc = _run(*args, "--config", config)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_a_png_plot_without_matplotlib_says_how_to_get_it(config: str, tmp_path: Path) -> None:
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from zml.cli import main\n"
            f"sys.exit(main(['sim', 'replay', {AZURE!r}, '--config', {config!r}, '--limit', '20',"
            f" '--strategy', 'random', '--plot', {str(tmp_path / 'p.png')!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "pip install 'zmlai[plot]'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "p.png").exists()


@pytest.mark.parametrize(
    ("flag", "target", "message"),
    [
        ("--json", "{d}", "is a directory, not a file; name a file in it, e.g. '{d}/results.json'"),
        ("--plot", "{d}", "is a directory, not a file; name a file in it, e.g. '{d}/plot.html'"),
        ("--json", "{d}/missing/r.json", "cannot be created: '{d}/missing' does not exist"),
        ("--plot", "{f}/p.html", "cannot be created: '{f}' is not a folder"),
        ("--json", "", "is empty; name the file to write"),
    ],
)
def test_an_output_that_cannot_be_written_is_refused_before_the_replay(
        config: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str, target: str,
        message: str) -> None:
    (tmp_path / "file").write_text("not a folder")

    def place(text: str) -> str:
        return text.format(d=tmp_path, f=tmp_path / "file")

    out = place(target)
    status = main(["sim", "replay", AZURE, "--config", config, "--limit", "20", "--strategy",
                   "random", flag, out])
    captured = capsys.readouterr()
    assert status == 2
    assert captured.err.startswith(f"error: InvalidRequestError: {flag} {out!r} {place(message)}")
    assert captured.out == ""  # nothing was replayed: the table comes before the files
