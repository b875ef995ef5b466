"""The 0.3 release post's examples, run as written, against simulated nodes on loopback.

Each snippet below is copied verbatim from the post (kept in tests/fixtures/seed/release-0.3.txt).
The post's client takes no config argument, so the fleet's zml.toml is found the way a user's
would be: in the current directory.
"""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path
from typing import Any

import pytest

import zml

SEED_POST = Path(__file__).resolve().parents[1] / "fixtures" / "seed" / "release-0.3.txt"

INLINE_POLICY = '''
import zml

client = zml.Client(api_key="...")

# Define a policy inline
policy = zml.Policy(
    name="llama3-production",
    accelerator_chain=["H100", "MI300X", "H100_PCIe"],
    latency_target_ms=500,
    cost_priority="balanced"
)

response = client.infer(
    model="meta-llama/llama-3-8b-instruct",
    messages=[{"role": "user", "content": "Hello"}],
    policy=policy
)
'''

POLICY_BY_NAME = '''
response = client.infer(
    model="meta-llama/llama-3-8b-instruct",
    messages=[{"role": "user", "content": "Hello"}],
    policy="llama3-production"  # references zml.toml entry
)
'''

ASYNC_CLIENT = '''
import asyncio
import zml

async def generate(prompt: str) -> str:
    async with zml.AsyncClient(api_key="...") as client:
        response = await client.infer(
            model="meta-llama/llama-3-8b-instruct",
            messages=[{"role": "user", "content": prompt}],
            policy="llama3-production"
        )
        return response.choices[0].message.content

asyncio.run(generate("Explain tensor parallelism in two sentences"))
'''

TOML_POLICY = '''
[policies.llama3-production]
accelerator_chain = ["H100", "MI300X", "H100_PCIe"]
latency_target_ms = 500
cost_priority = "balanced"
'''


def _run(code: str, namespace: dict[str, Any] | None = None) -> dict[str, Any]:
    ns: dict[str, Any] = namespace if namespace is not None else {}
    exec(compile(textwrap.dedent(code), "<seed example>", "exec"), ns)
    return ns


@pytest.fixture
def in_fleet_dir(seed_fleet: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.chdir(seed_fleet.path.parent)
    return seed_fleet


def test_seed_examples_are_quoted_verbatim() -> None:
    text = SEED_POST.read_text(encoding="utf-8")
    for snippet in (INLINE_POLICY, POLICY_BY_NAME, ASYNC_CLIENT, TOML_POLICY):
        for line in snippet.strip().splitlines():
            assert line in text, line


def test_toml_policy_table_is_the_one_the_fleet_uses(in_fleet_dir: Any) -> None:
    assert TOML_POLICY.strip() in Path("zml.toml").read_text()


def test_inline_policy(in_fleet_dir: Any) -> None:
    ns = _run(INLINE_POLICY)
    response = ns["response"]
    assert isinstance(response, zml.ChatCompletion)
    assert response.choices[0].message.content
    assert response.routing.policy == "llama3-production"
    assert response.routing.accelerator == "H100"
    assert response.routing.node_id.startswith("h100-")
    assert response.routing.queue_depth == 0


def test_policy_by_name(in_fleet_dir: Any) -> None:
    ns = _run("import zml\nclient = zml.Client(api_key='...')\n" + textwrap.dedent(POLICY_BY_NAME))
    routing = ns["response"].routing
    assert routing.policy == "llama3-production"
    assert routing.accelerator == "H100"
    assert routing.evaluated[0] == {"family": "H100", "nodes_checked": 3, "rejected_reason": None}


def test_async_client(in_fleet_dir: Any) -> None:
    ns = _run(ASYNC_CLIENT.replace("asyncio.run(generate(", "answer = asyncio.run(generate("))
    assert isinstance(ns["answer"], str) and ns["answer"]


def test_routing_error_context_has_exactly_the_seed_keys(in_fleet_dir: Any) -> None:
    client = zml.Client(api_key="...")

    async def saturate_then_try() -> zml.RoutingError:
        # the saturating client shares the post's client's fleet on purpose, so that its
        # reservations are the ones the post's client sees
        async with zml.AsyncClient(api_key="...", fleet=client.fleet) as aclient:
            streams = []
            try:
                for i in range(12):  # every slot of the fleet (6 nodes x 2)
                    s = aclient.infer_stream(
                        "meta-llama/llama-3-8b-instruct",
                        [{"role": "user", "content": f"hold {i}"}],
                        policy="llama3-production",
                    )
                    it = s.__aiter__()
                    await it.__anext__()
                    streams.append(it)
                # as in the post, around a plain infer call:
                try:
                    client.infer(
                        model="meta-llama/llama-3-8b-instruct",
                        messages=[{"role": "user", "content": "Hello"}],
                        policy="llama3-production",
                    )
                except zml.RoutingError as e:
                    print(e.routing_context)
                    return e
                raise AssertionError("expected a RoutingError with every slot held")
            finally:
                for it in streams:
                    await it.aclose()

    err = asyncio.run(saturate_then_try())
    ctx = err.routing_context
    assert list(ctx) == ["policy", "evaluated", "final_error", "recommendation"]
    assert ctx["policy"] == "llama3-production"
    assert ctx["final_error"] == "no_viable_node"
    assert ctx["recommendation"] == "increase fleet capacity or enable queue_on_saturation"
    assert ctx["evaluated"] == [
        {"family": "H100", "nodes_checked": 3, "rejected_reason": "all_nodes_over_capacity"},
        {"family": "MI300X", "nodes_checked": 2, "rejected_reason": "all_nodes_over_capacity"},
        {"family": "H100_PCIe", "nodes_checked": 1, "rejected_reason": "all_nodes_over_capacity"},
    ]
    # "also included in the exception's string representation"
    assert '"final_error": "no_viable_node"' in str(err)
    assert isinstance(err, zml.ZMLRoutingError)
    assert client.fleet.in_flight == 0


def test_unregistered_family_fails_at_construction(in_fleet_dir: Any) -> None:
    zml.Client(api_key="...")
    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Policy(
            name="llama3-production",
            accelerator_chain=["H100", "TPU_v9"],
            latency_target_ms=500,
            cost_priority="balanced",
        )
    message = str(info.value)
    assert "accelerator_chain" in message and "'TPU_v9'" in message
    assert "H100, MI300X, H100_PCIe" in message
    assert info.value.field == "accelerator_chain" and info.value.value == "TPU_v9"
