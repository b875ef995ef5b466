"""Fixtures shared by the whole suite: simulated fleets on loopback and their zml.toml."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

MODEL = "meta-llama/llama-3-8b-instruct"


def system_tool(name: str, *, packages: Sequence[str], why: str, how: str) -> str:
    """The path of the program ``name`` that some tests run for real (redis-server, node, npm,
    curl). Where it is missing, on a Debian-like machine where we are root (CI, a fresh dev
    box), ``packages`` are installed with apt-get first, so that the README's one test command
    needs nothing installed beforehand; otherwise the test FAILS (never skips) saying ``why``
    it needs the program and ``how`` to install it."""
    path = shutil.which(name)
    if path is None and shutil.which("apt-get") is not None and hasattr(os, "geteuid") \
            and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, check=False, capture_output=True,
                       timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", *packages], env=env, check=False,
                       capture_output=True, timeout=900)
        path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed, and {why}: install it ({how}) and run the tests "
                    "again", pytrace=False)
    return path


@pytest.fixture(autouse=True)
def _no_zml_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no ZML_* environment (zml itself keeps no process-wide state)."""
    for var in ("ZML_CONFIG", "ZML_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    yield


def _toml_key(name: str) -> str:
    """A table name as TOML writes it: bare when it can be, else quoted."""
    bare = name and all(c.isascii() and (c.isalnum() or c in "-_") for c in name)
    return name if bare else json.dumps(name, ensure_ascii=False)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, Sequence):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def render_config(
    families: Mapping[str, Mapping[str, Any]],
    nodes: Sequence[Mapping[str, Any]],
    policies: Mapping[str, Mapping[str, Any]] | None = None,
) -> str:
    """A zml.toml text for the given tables (scalars, lists and one nested ``sim`` table)."""
    out: list[str] = []
    for name, table in families.items():
        out.append(f"[accelerators.{_toml_key(name)}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        out.append("")
    for node in nodes:
        out.append("[[nodes]]")
        out += [f"{k} = {_toml_value(v)}" for k, v in node.items() if not isinstance(v, Mapping)]
        sim = node.get("sim")
        if sim:
            out.append("[nodes.sim]")
            out += [f"{k} = {_toml_value(v)}" for k, v in sim.items() if k != "faults"]
            if sim.get("faults"):
                out.append("[nodes.sim.faults]")
                out += [f"{k} = {_toml_value(v)}" for k, v in sim["faults"].items()]
        out.append("")
    for name, table in (policies or {}).items():
        out.append(f"[policies.{_toml_key(name)}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        out.append("")
    return "\n".join(out)


@dataclass
class SimSetup:
    """A running simulated fleet and the zml.toml that describes it."""

    path: Path
    fleet: Any  # zml.sim.SimFleet

    def node(self, node_id: str) -> Any:
        """The SimNode with this id (its ``stats``, ``set_faults``...)."""
        return self.fleet.nodes[node_id]


@pytest.fixture
def sim_fleet(tmp_path: Path) -> Iterator[Callable[..., SimSetup]]:
    """Factory: start simulated nodes on loopback and write the zml.toml pointing at them.

    ``nodes`` entries are zml.toml ``[[nodes]]`` tables without ``url`` (added here); ``models``
    defaults to the seed's model.
    """
    from zml.config import load_registry
    from zml.sim import SimFleet
    from zml.sim.from_config import specs_from_registry

    started: list[Any] = []
    counter = iter(range(1000))

    def make(
        nodes: Sequence[Mapping[str, Any]],
        policies: Mapping[str, Mapping[str, Any]] | None = None,
        families: Mapping[str, Mapping[str, Any]] | None = None,
        time_scale: float = 1.0,
        api_key: str | None = None,
    ) -> SimSetup:
        fams = families or {n["family"]: {} for n in nodes}
        draft = [{"url": "http://127.0.0.1:1", "models": [MODEL], **n} for n in nodes]
        specs, _ = specs_from_registry(
            load_registry(_write(tmp_path / f"draft{next(counter)}.toml",
                                 render_config(fams, draft, None))),
            api_key=api_key,
        )
        fleet = SimFleet(specs, time_scale=time_scale).start()
        started.append(fleet)
        final = [{**n, "url": fleet.url(n["id"])} for n in draft]
        path = _write(tmp_path / "zml.toml", render_config(fams, final, policies))
        return SimSetup(path, fleet)

    yield make
    for fleet in started:
        fleet.stop()


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


SEED_FAMILIES = {
    "H100": {"cost_per_hour": 4.0},
    "MI300X": {"cost_per_hour": 3.2},
    "H100_PCIe": {"cost_per_hour": 2.4},
}
SEED_NODES = [
    {"id": "h100-1", "family": "H100", "max_concurrency": 2},
    {"id": "h100-2", "family": "H100", "max_concurrency": 2},
    {"id": "h100-3", "family": "H100", "max_concurrency": 2},
    {"id": "mi300x-1", "family": "MI300X", "max_concurrency": 2},
    {"id": "mi300x-2", "family": "MI300X", "max_concurrency": 2},
    {"id": "h100-pcie-1", "family": "H100_PCIe", "max_concurrency": 2},
]
SEED_POLICIES = {
    "llama3-production": {
        "accelerator_chain": ["H100", "MI300X", "H100_PCIe"],
        "latency_target_ms": 500,
        "cost_priority": "balanced",
    }
}


@pytest.fixture
def seed_fleet(sim_fleet: Callable[..., SimSetup]) -> SimSetup:
    """The fleet of the 0.3 release post: H100, MI300X and H100_PCIe, and llama3-production."""
    return sim_fleet(SEED_NODES, SEED_POLICIES, SEED_FAMILIES)


class LoadPeaks:
    """Polls each simulated node's running + waiting requests (the load the node took on):
    ``with LoadPeaks(fleet.nodes) as peaks: ...`` then ``peaks.peaks[node_id]``."""

    def __init__(self, nodes: Mapping[str, Any]) -> None:
        self.nodes = dict(nodes)
        self.peaks = dict.fromkeys(self.nodes, 0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            for node_id, node in self.nodes.items():
                stats = node.stats
                self.peaks[node_id] = max(self.peaks[node_id], stats.running + stats.waiting)
            time.sleep(0.002)

    def __enter__(self) -> LoadPeaks:
        for node in self.nodes.values():
            node.reset_peak()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
