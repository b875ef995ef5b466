"""``zml sim replay --live``: its own bad input is one clear error (exit 2), and a row's
prompt carries the trace's sizes and shared prefixes the way the live node counts them."""

from __future__ import annotations

from pathlib import Path

import pytest

from zml.cli import main
from zml.sim.live import PROMPT_OVERHEAD_TOKENS, prompt_for
from zml.sim.model import BLOCK_TOKENS, prompt_blocks
from zml.sim.traces import Arrival

AZURE = str(Path(__file__).parents[2] / "fixtures" / "traces" / "azure-conv-300.csv")
CONFIG = """
[accelerators.A100]
cost_per_hour = 1.8
[[nodes]]
id = "a100-1"
family = "A100"
url = "http://127.0.0.1:1"
models = ["m"]
max_concurrency = 8
[policies.p]
accelerator_chain = ["A100"]
"""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--live", "--strategy", "round_robin"], "--live replays policy rows only"),
        (["--live", "--time-scale", "0"], "--time-scale must be a number > 0"),
        (["--live", "--concurrency", "0"], "--concurrency must be >= 1"),
        # options of a live replay only: accepted and ignored, they misled
        (["--concurrency", "5"], "--concurrency applies only to a --live replay"),
        (["--time-scale", "0.5"], "--time-scale applies only to a --live replay"),
    ],
)
def test_bad_live_input_is_one_clear_error_with_status_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    config = tmp_path / "zml.toml"
    config.write_text(CONFIG)
    status = main(["sim", "replay", AZURE, "--config", str(config), *args])
    err = capsys.readouterr().err
    assert status == 2 and message in err and "Traceback" not in err


def test_a_rows_prompt_has_its_size_and_shares_a_prefix_with_rows_sharing_blocks() -> None:
    size = 3 * BLOCK_TOKENS + 100
    x = Arrival(0, 0.0, size, 10, blocks=("A", "B", "C", "E"))
    y = Arrival(1, 0.0, size, 10, blocks=("A", "B", "D", "F"))
    px, py = prompt_for(x), prompt_for(y)
    assert len(px.split()) == size - PROMPT_OVERHEAD_TOKENS
    bx = prompt_blocks([{"role": "user", "content": px}])
    by = prompt_blocks([{"role": "user", "content": py}])
    assert len(bx) == 3 and bx[:2] == by[:2] and bx[2] != by[2]
    plain = prompt_for(Arrival(2, 0.0, 50, 5))
    assert len(plain.split()) == 50 - PROMPT_OVERHEAD_TOKENS
    assert prompt_blocks([{"role": "user", "content": prompt_for(Arrival(3, 0.0, size, 5))}]) \
        != bx[:3]
