"""Fixtures of the LangChain integration tests: one simulated fleet on loopback for the session
and the zml.toml that describes it; outbound connections are limited to loopback.

The fleet: one H100 node with a single slot (easy to saturate, so the fallback to MI300X can be
seen) and two MI300X nodes. Only MI300X serves ``OTHER_MODEL``, the model used by the
per-call ``model=`` override tests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from zml.sim import SimFleet, SimNodeSpec

HERE = Path(__file__).parent
LOOPBACK = ["127.0.0.1", "::1", "localhost"]
MODEL = "meta-llama/llama-3-8b-instruct"
OTHER_MODEL = "qwen2.5-7b-instruct"
POLICY = "llama3-production"
H100_NODE = "h100-1"
NODES = [
    SimNodeSpec(id=H100_NODE, family="H100", models=(MODEL,), max_concurrency=1),
    SimNodeSpec(id="mi300x-1", family="MI300X", models=(MODEL, OTHER_MODEL), max_concurrency=4),
    SimNodeSpec(id="mi300x-2", family="MI300X", models=(MODEL, OTHER_MODEL), max_concurrency=4),
]
COST_PER_HOUR = {"H100": 4.0, "MI300X": 3.2}
# Simulated time runs 20x faster than the families' profiles: a reply takes ~20 ms.
TIME_SCALE = 0.05


def render_config(fleet: SimFleet) -> str:
    """The zml.toml of the running fleet, with the ``llama3-production`` policy."""
    lines: list[str] = []
    for family, cost in COST_PER_HOUR.items():
        lines += [f"[accelerators.{family}]", f"cost_per_hour = {cost}", ""]
    for spec in NODES:
        lines += [
            "[[nodes]]",
            f"id = {json.dumps(spec.id)}",
            f"family = {json.dumps(spec.family)}",
            f"url = {json.dumps(fleet.url(spec.id))}",
            f"models = {json.dumps(list(spec.models))}",
            f"max_concurrency = {spec.max_concurrency}",
            "",
        ]
    lines += [f"[policies.{POLICY}]", 'accelerator_chain = ["H100", "MI300X"]', ""]
    return "\n".join(lines)


@pytest.fixture(scope="session")
def sim_fleet() -> Iterator[SimFleet]:
    """The simulated nodes, serving on loopback for the whole session."""
    with SimFleet(NODES, time_scale=TIME_SCALE) as fleet:
        yield fleet


@pytest.fixture(scope="session")
def zml_config(sim_fleet: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The path of a zml.toml pointing at :func:`sim_fleet`."""
    path = tmp_path_factory.mktemp("langchain-zml") / "zml.toml"
    path.write_text(render_config(sim_fleet))
    return path


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "install: installs a package into a fresh virtual environment (uses uv)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Any connection to a host other than loopback fails a test here (pytest-socket)."""
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.allow_hosts(LOOPBACK))
