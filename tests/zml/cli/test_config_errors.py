"""Each command that reads a ``zml.toml`` refuses a bad one with one message and status 2."""

from __future__ import annotations

from pathlib import Path

import pytest

import zml
from zml.cli import main
from zml.config import load_registry
from zml.gateway.settings import gateway_settings

NODE = ('[accelerators.H100]\n[[nodes]]\nid = "n1"\nfamily = "H100"\n'
        'url = "http://127.0.0.1:1"\nmodels = ["m"]\nmax_concurrency = 1\n')


def _commands(config: str) -> list[list[str]]:
    return [["policy", "check", "--config", config], ["route", "--model", "m", "--config", config],
            ["sim", "serve", config], ["fleet", "status", "--config", config]]


def _fails_with(argv: list[str], capsys: pytest.CaptureFixture[str], message: str) -> None:
    assert main(argv) == 2, argv
    captured = capsys.readouterr()
    assert message in captured.err, (argv, captured.err)
    assert captured.err.startswith("error: PolicyConfigError: ") and captured.out == ""


def test_a_file_that_is_not_utf8_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "zml.toml"
    path.write_bytes(NODE.encode() + b"# caf\xe9\n")
    for argv in _commands(str(path)):
        _fails_with(argv, capsys, f"{path} is not UTF-8 text: byte 0xe9 at offset {len(NODE) + 5} cannot be "
                    "decoded; a zml.toml must be UTF-8")


def test_a_directory_or_a_name_too_long_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in _commands(str(tmp_path)):
        _fails_with(argv, capsys, f"config file {str(tmp_path)!r} is a directory, not a file")
    for argv in _commands(str(tmp_path / ("a" * 5000))):
        _fails_with(argv, capsys, "cannot be used: File name too long")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (NODE + '[gateway]\ndefault_polcy = "p"\n',
         "unknown key gateway.default_polcy; did you mean 'default_policy'?"),
        (NODE + "[gateway]\nmax_body_bytes = 10\n", "gateway.max_body_bytes = 10"),
        ("gateway = 5\n" + NODE, "gateway = 5: Input should be a valid dictionary"),
    ],
)
def test_policy_check_validates_the_gateway_table_as_zml_serve_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "zml.toml"
    path.write_text(text)
    with pytest.raises(zml.PolicyConfigError) as info:  # what `zml serve` reports
        gateway_settings(load_registry(path))
    assert message in str(info.value)
    _fails_with(["policy", "check", "--config", str(path)], capsys, str(info.value))


def test_policy_check_accepts_a_valid_gateway_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "zml.toml"
    path.write_text(NODE + '[policies.p]\naccelerator_chain = ["H100"]\n'
                    '[gateway]\ndefault_policy = "p"\n')
    assert main(["policy", "check", "--config", str(path)]) == 0
    assert "ok: 1 families, 1 nodes, 1 policies" in capsys.readouterr().out


def test_policy_check_refuses_a_policy_value_of_the_wrong_type(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "zml.toml"
    path.write_text(NODE + '[policies.fast]\naccelerator_chain = ["H100"]\n'
                    "latency_target_ms = true\n[policies.q]\naccelerator_chain = [\"H100\"]\n"
                    "latency_target_ms = inf\n")
    assert main(["policy", "check", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "[policies.fast] policy 'fast': latency_target_ms = True: Input should be a valid " \
           "number" in err
    assert "[policies.q] policy 'q': latency_target_ms = inf: Input should be a finite number" in err
