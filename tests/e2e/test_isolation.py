"""No hidden process-wide state: clients on different configs in one process never disturb
each other, and nothing in ``zml`` keeps mutable state at module level."""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
import shutil
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import zml
from tests.conftest import MODEL

A_NODES = [
    {"id": "a-h100", "family": "H100", "max_concurrency": 4},
    {"id": "a-mi", "family": "MI300X", "max_concurrency": 4},
]
B_NODES = [{"id": "b-mi", "family": "MI300X", "max_concurrency": 8}]
MSGS = [{"role": "user", "content": "hello"}]


@pytest.fixture
def two_configs(sim_fleet: Any, tmp_path: Path) -> tuple[Path, Path]:
    a = sim_fleet(A_NODES)
    a_path = shutil.copy(a.path, tmp_path / "a.toml")
    b = sim_fleet(B_NODES)
    b_path = shutil.copy(b.path, tmp_path / "b.toml")
    return Path(a_path), Path(b_path)


def test_two_clients_on_different_configs_route_independently_under_load(
    two_configs: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    a_path, b_path = two_configs
    monkeypatch.setenv("ZML_CONFIG", str(a_path))  # the default registry: a's file

    async def main() -> None:
        async with zml.AsyncClient(config=a_path, probe_interval_s=None) as a, \
                zml.AsyncClient(config=b_path, probe_interval_s=None) as b:
            pa = zml.Policy(name="pa", accelerator_chain=["H100", "MI300X"])
            pb = b.policy({"name": "pb", "accelerator_chain": ["MI300X"]})
            with pytest.raises(zml.PolicyConfigError, match=r"b\.toml: policy 'pa'.*'H100'"):
                await b.infer(MODEL, MSGS, policy=pa)
            third = zml.Client(config=b_path)  # changes neither client nor zml.Policy
            assert zml.Policy(name="again", accelerator_chain=["H100"]).name == "again"
            third.close()

            ra = [a.infer(MODEL, MSGS, policy=pa) for _ in range(8)]
            rb = [b.infer(MODEL, MSGS, policy=pb) for _ in range(8)]
            results = await asyncio.gather(*ra, *rb, return_exceptions=True)
            ok = [r for r in results if isinstance(r, zml.ChatCompletion)]
            assert len(ok) == 16, [r for r in results if not isinstance(r, zml.ChatCompletion)]
            assert {r.routing.node_id for r in ok[:8]} <= {"a-h100", "a-mi"}
            assert {r.routing.node_id for r in ok[8:]} == {"b-mi"}
            assert a.fleet.in_flight == 0 and b.fleet.in_flight == 0

    asyncio.run(main())


def test_unrelated_clients_share_no_fleet_waiters_or_registry(
    two_configs: tuple[Path, Path],
) -> None:
    a_path, _ = two_configs
    with zml.Client(config=a_path) as one, zml.Client(config=a_path) as two:
        one.infer(MODEL, MSGS)
        assert one.fleet is not two.fleet
        assert one.fleet.lock is not two.fleet.lock
        assert one.fleet.node("a-h100") is not two.fleet.node("a-h100")
        assert one._dispatcher.effects.queues is not two._dispatcher.effects.queues
        assert one.registry is not two.registry
        # the first client's reservations are invisible to the second
        held = one.infer_stream(MODEL, MSGS, accelerator="H100")
        assert one.fleet.node("a-h100").in_flight == 1
        assert two.fleet.node("a-h100").in_flight == 0
        held.close()
        # shared on purpose: the same fleet object, the same accounting
        with zml.Client(fleet=one.fleet) as shared:
            stream = shared.infer_stream(MODEL, MSGS, accelerator="H100")
            assert one.fleet.node("a-h100").in_flight == 1
            stream.close()
        assert one.fleet.node("a-h100").in_flight == 0


_ALLOWED_CACHES = {
    ("zml.config", "_file_cache"),  # a file's parsed registry, keyed by path and mtime
    ("zml.plugins.fleet_sources", "_default_cache"),  # keyed by that registry and plugin set
    ("zml.plugins.manager", "_process"),  # the installed plugins, discovered once
}


def _zml_modules() -> list[types.ModuleType]:
    names = ["zml"]
    for info in pkgutil.walk_packages(zml.__path__, "zml."):
        if not info.name.endswith("__main__"):
            names.append(info.name)
    out = []
    for name in names:
        if name.startswith("zml.gateway") and importlib.util.find_spec(name) is None:
            continue
        out.append(importlib.import_module(name))
    return out


def test_no_module_of_zml_keeps_mutable_state_at_module_level() -> None:
    offenders = []
    for module in _zml_modules():
        for attr, value in vars(module).items():
            if attr.startswith("__") or (module.__name__, attr) in _ALLOWED_CACHES:
                continue
            if isinstance(value, types.ModuleType | type | types.FunctionType):
                continue
            if attr.lstrip("_").isupper():  # a constant, by convention (never rebound)
                continue
            if isinstance(value, list | dict | set | bytearray):
                offenders.append(f"{module.__name__}.{attr}")
    assert offenders == [], offenders
    assert "zml" in sys.modules
