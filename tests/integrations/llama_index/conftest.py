"""Fixtures of the LlamaIndex integration tests: one simulated fleet on loopback for the session,
a zml.toml describing it, and guards that keep LlamaIndex off the internet.

LlamaIndex reaches out on its own in a few places (tiktoken encodings, NLTK data, default
OpenAI models when ``Settings.llm``/``embed_model`` are unset). The tests set a local tokenizer
and mock embeddings, and every outbound connection to a non-loopback address fails the test.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from llama_index.core import Settings
from llama_index.core.utils import set_global_tokenizer

from llama_index.llms.zml import ZML
from zml.sim import SimFleet, SimNodeSpec

MODEL = "meta-llama/llama-3-8b-instruct"
POLICY = "llama3-production"
FAMILIES = {"H100": 4.0, "MI300X": 3.2}
NODES = [
    SimNodeSpec(id="h100-a", family="H100", models=(MODEL,), max_concurrency=4),
    SimNodeSpec(id="h100-b", family="H100", models=(MODEL,), max_concurrency=4),
    SimNodeSpec(id="mi300x-a", family="MI300X", models=(MODEL,), max_concurrency=4),
]
# Simulated time runs 20x faster than the families' profiles: a reply takes ~20 ms.
TIME_SCALE = 0.05


def simple_tokenizer(text: str) -> list[str]:
    """A local stand-in for tiktoken: whitespace tokens."""
    return text.split()


def _is_loopback(address: Any) -> bool:
    if not isinstance(address, tuple):
        return True  # AF_UNIX paths and socketpairs
    host = address[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def _no_internet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail any connection to a non-loopback address made from this process."""
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex

    def connect(self: socket.socket, address: Any) -> Any:
        if not _is_loopback(address):
            raise OSError(f"test tried to reach {address!r}: only loopback is allowed")
        return real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> Any:
        if not _is_loopback(address):
            raise OSError(f"test tried to reach {address!r}: only loopback is allowed")
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)


@pytest.fixture(autouse=True)
def _local_llama_index(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A local tokenizer, and LlamaIndex's global Settings restored after each test."""
    import llama_index.core

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(Path(llama_index.core.__file__).parent
                                                  / "_static" / "tiktoken_cache"))
    saved_settings = dict(vars(Settings))
    saved_tokenizer = llama_index.core.global_tokenizer
    set_global_tokenizer(simple_tokenizer)
    yield
    llama_index.core.global_tokenizer = saved_tokenizer
    vars(Settings).clear()
    vars(Settings).update(saved_settings)


def _render(urls: dict[str, str], nodes: list[SimNodeSpec] = NODES) -> str:
    lines: list[str] = []
    for family, cost in FAMILIES.items():
        lines += [f"[accelerators.{family}]", f"cost_per_hour = {cost}", ""]
    for spec in nodes:
        lines += [
            "[[nodes]]",
            f'id = "{spec.id}"',
            f'family = "{spec.family}"',
            f'url = "{urls[spec.id]}"',
            f'models = ["{MODEL}"]',
            f"max_concurrency = {spec.max_concurrency}",
            "",
        ]
    lines += [
        f"[policies.{POLICY}]",
        'accelerator_chain = ["H100", "MI300X"]',
        "latency_target_ms = 500",
        'cost_priority = "balanced"',
        "",
    ]
    return "\n".join(lines)


@pytest.fixture(scope="session")
def sim_fleet() -> Iterator[SimFleet]:
    """Three simulated vLLM nodes (2x H100, 1x MI300X) serving MODEL on loopback."""
    with SimFleet(NODES, time_scale=TIME_SCALE) as fleet:
        yield fleet


@pytest.fixture(scope="session")
def zml_config(sim_fleet: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The path of a zml.toml for the session fleet, with the llama3-production policy."""
    path = tmp_path_factory.mktemp("zml") / "zml.toml"
    path.write_text(_render({spec.id: sim_fleet.url(spec.id) for spec in NODES}))
    return path


@pytest.fixture
def make_llm(zml_config: Path) -> Iterator[Callable[..., ZML]]:
    """Factory of ZML LLMs on the session fleet (llama3-production unless told otherwise)."""
    made: list[ZML] = []

    def make(**fields: Any) -> ZML:
        fields.setdefault("model", MODEL)
        fields.setdefault("policy", POLICY)
        fields.setdefault("config", zml_config)
        llm = ZML(**fields)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()


@pytest.fixture
def llm(make_llm: Callable[..., ZML]) -> ZML:
    return make_llm()


@pytest.fixture
async def allm(zml_config: Path) -> AsyncIterator[ZML]:
    """A ZML for async tests, its async client closed on the test's own event loop."""
    llm = ZML(model=MODEL, policy=POLICY, config=zml_config)
    yield llm
    await llm.aclose()


ONE_SLOT = SimNodeSpec(id="h100-a", family="H100", models=(MODEL,), max_concurrency=1,
                       tokens_per_s=20)


@pytest.fixture
async def one_slot_llm(tmp_path: Path) -> AsyncIterator[ZML]:
    """A ZML on a fleet of one node that runs one request at a time, in real time (20 tokens
    a second: a 200-token answer is still streaming when a test stops reading it)."""
    with SimFleet([ONE_SLOT], time_scale=1.0) as fleet:
        path = tmp_path / "zml.toml"
        path.write_text(_render({ONE_SLOT.id: fleet.url(ONE_SLOT.id)}, [ONE_SLOT]))
        llm = ZML(model=MODEL, policy=POLICY, config=path, max_tokens=200, max_retries=0)
        yield llm
        await llm.aclose()
