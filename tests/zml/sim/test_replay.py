"""Replay in virtual time: accounting, determinism, node model effects, cost, the router seam."""

from __future__ import annotations

from pathlib import Path

import pytest

from zml.config import load_registry, registry_from_mapping
from zml.errors import PolicyConfigError
from zml.policy import validate_policy_tables
from zml.sim.from_config import node_profile
from zml.sim.profiles import profile_for
from zml.sim.replay import Reject, ReplayFleet, StrategyRouter, replay
from zml.sim.report import replay_document, summarize
from zml.sim.traces import Arrival, read_trace
from zml.sim.virtual import replay_policy
from zml.strategies import STRATEGIES

FIXTURES = Path(__file__).parents[2] / "fixtures" / "traces"
MODEL = "meta-llama/llama-3-8b-instruct"


def registry(slots: int = 8, max_queue: int = 8, queue_size: int = 64, nodes: int = 2):
    table: dict = {
        "accelerators": {"H100": {"cost_per_hour": 4.0}, "A100": {"cost_per_hour": 1.8}},
        "nodes": [
            {"id": f"{fam.lower()}-{i}", "family": fam, "url": f"http://10.0.0.{k}:8000",
             "models": [MODEL], "max_concurrency": slots, "max_queue": max_queue,
             "sim": {"queue_size": queue_size}}
            for k, (fam, i) in enumerate([(f, i) for f in ("A100", "H100") for i in range(nodes)])
        ],
        "policies": {"cheap": {"accelerator_chain": ["A100", "H100"], "latency_target_ms": 2000,
                               "cost_priority": "cost"}},
    }
    return registry_from_mapping(table)


def runs(reg, arrivals, **kw):
    """The policy row (through the production core) and every strategy row."""
    policies = validate_policy_tables(reg)
    yield replay_policy(arrivals, reg, policies, policies["cheap"], name="cheap",
                        default_model=MODEL, **kw)
    for name in STRATEGIES:
        yield replay(arrivals, ReplayFleet(reg), StrategyRouter(name), name=name,
                     kind="strategy", default_model=MODEL, **kw)


@pytest.mark.parametrize("trace", ["azure-conv-300.csv", "mooncake-conv-300.jsonl", "zml-sample.jsonl"])
def test_every_request_is_accounted_for_in_every_row(trace):
    arrivals = list(read_trace(FIXTURES / trace))
    reg = registry(slots=4, max_queue=2, queue_size=4)
    for run in runs(reg, arrivals, rate_scale=4.0, slo_ms=1000):
        name = run.name
        row = summarize(run)
        assert row["requests"] == len(arrivals)
        assert row["completed"] + sum(row["errors"].values()) == len(arrivals), name
        assert all(n.model.load == 0 for n in run.fleet.nodes)
        assert sum(row["share_by_family"].values()) == pytest.approx(
            row["completed"] / len(arrivals), abs=1e-5)


def test_replay_is_deterministic_and_rate_scale_compresses_virtual_time():
    arrivals = list(read_trace(FIXTURES / "azure-conv-300.csv"))
    reg = registry()
    one = [summarize(replay(arrivals, ReplayFleet(reg), StrategyRouter("random", seed=3),
                            name="r", kind="strategy", default_model=MODEL)) for _ in range(2)]
    assert one[0] == one[1]
    slow = replay(arrivals, ReplayFleet(reg), StrategyRouter("round_robin"), name="r",
                  kind="strategy", default_model=MODEL)
    fast = replay(arrivals, ReplayFleet(reg), StrategyRouter("round_robin"), name="r",
                  kind="strategy", default_model=MODEL, rate_scale=2.0)
    last_arrival = max(o.start_s for o in slow.outcomes)
    assert max(o.start_s for o in fast.outcomes) == pytest.approx(last_arrival / 2)
    assert fast.virtual_s < slow.virtual_s


def test_more_load_means_slower_answers():
    arrivals = list(read_trace(FIXTURES / "azure-conv-300.csv"))
    reg = registry(slots=4, max_queue=64)
    rows = [summarize(replay(arrivals, ReplayFleet(reg), StrategyRouter("round_robin"),
                             name="r", kind="strategy", default_model=MODEL, rate_scale=x))
            for x in (1.0, 30.0)]
    assert rows[1]["e2e_ms"]["p50"] > rows[0]["e2e_ms"]["p50"]


def test_prefix_sharing_traces_hit_the_cache_and_sizes_only_traces_do_not():
    reg = registry(nodes=1)
    mooncake = list(read_trace(FIXTURES / "mooncake-conv-300.jsonl"))
    azure = list(read_trace(FIXTURES / "azure-conv-300.csv"))
    hit = summarize(replay(mooncake, ReplayFleet(reg), StrategyRouter("round_robin"), name="r",
                           kind="strategy", default_model=MODEL))["prefix_cache_hit_rate"]
    miss = summarize(replay(azure, ReplayFleet(reg), StrategyRouter("round_robin"), name="r",
                            kind="strategy", default_model=MODEL))["prefix_cache_hit_rate"]
    assert hit > 0.0 and miss == 0.0


def test_errors_have_their_final_error():
    reg = registry(slots=1, max_queue=0, queue_size=0, nodes=1)
    burst = [Arrival(i, 0.0, 100, 50) for i in range(5)]
    too_big = [Arrival(5, 0.0, 10_000_000, 10)]
    strategy = summarize(replay(burst + too_big, ReplayFleet(reg), StrategyRouter("round_robin"),
                                name="r", kind="strategy", default_model=MODEL))
    # 2 nodes (one A100, one H100), one slot each: two run, three find every node full
    assert strategy["completed"] == 2
    assert strategy["errors"] == {"attempts_exhausted": 3, "context_length_exceeded": 1}
    policies = validate_policy_tables(reg)
    policy = summarize(replay_policy(burst, reg, policies, policies["cheap"], name="cheap",
                                     default_model=MODEL, slo_ms=10_000))
    assert policy["errors"] == {"no_viable_node": 3}
    assert policy["slo_attainment"] == pytest.approx(2 / 5)  # errors count as misses


def test_cost_is_the_default_cost_model():
    reg = registry(nodes=1)
    run = replay([Arrival(0, 0.0, 1000, 100)], ReplayFleet(reg), lambda *a: "h100-0", name="x",
                 kind="strategy", default_model=MODEL)
    out = run.outcomes[0]
    assert out.family == "H100"
    assert out.cost_usd == pytest.approx(4.0 / 3600 * out.e2e_s / 8)
    row = summarize(run)
    assert row["usd_per_1m_output_tokens"] == pytest.approx(out.cost_usd / 100 * 1e6, rel=1e-4)


def test_the_router_seam_gets_the_fleet_and_the_excluded_nodes():
    reg = registry(slots=1, max_queue=0, queue_size=0, nodes=1)
    seen: list[frozenset[str]] = []
    events: list[tuple[str, int]] = []

    def router(arrival, model, now, fleet, exclude):
        seen.append(exclude)
        assert model == MODEL and fleet.nodes_for(MODEL, "A100")
        free = [n for n in fleet.serving(model) if n.id not in exclude]
        return free[0].id if free else Reject("no_viable_node")

    run = replay([Arrival(i, 0.0, 10, 10) for i in range(3)], ReplayFleet(reg), router,
                 name="x", kind="strategy", default_model=MODEL,
                 on_event=lambda kind, a, node, t: events.append((kind, a.index)))
    assert [o.error for o in run.outcomes] == [None, None, "no_viable_node"]
    assert seen[-3:] == [frozenset(), frozenset({"a100-0"}), frozenset({"a100-0", "h100-0"})]
    terminal = [e for e in events if e[0] in ("finished", "rejected")]
    assert sorted(i for _, i in terminal) == [0, 1, 2]


def test_profiles_come_from_the_family_then_the_node(tmp_path):
    path = tmp_path / "zml.toml"
    path.write_text(
        "[accelerators.H100]\n[accelerators.H100.sim]\nprefill_tokens_per_s = 5000\n"
        "kv_cache_tokens = 100000\n\n"
        "[[nodes]]\nid='a'\nfamily='H100'\nurl='http://10.0.0.1:8000'\nmodels=['m']\n"
        "max_concurrency=4\n[nodes.sim]\nkv_cache_tokens = 2000\ntokens_per_s = 50\n\n"
        "[[nodes]]\nid='b'\nfamily='H100'\nurl='http://10.0.0.2:8000'\nmodels=['m']\n"
        "max_concurrency=4\n"
    )
    reg = load_registry(path)
    a = node_profile(reg.node("a"), reg.families["H100"])
    b = node_profile(reg.node("b"), reg.families["H100"])
    base = profile_for("H100")
    assert (a.prefill_tokens_per_s, a.kv_cache_tokens, a.tokens_per_s) == (5000, 2000, 50)
    assert (b.prefill_tokens_per_s, b.kv_cache_tokens, b.tokens_per_s) == (5000, 100000, base.tokens_per_s)
    assert ReplayFleet(reg).by_id["a"].model.profile == a
    path.write_text(path.read_text().replace("kv_cache_tokens = 2000", "kv_cache_tokens = 0"))
    with pytest.raises(PolicyConfigError, match="kv_cache_tokens"):
        load_registry(path)


def test_the_json_document_has_the_documented_schema():
    arrivals = list(read_trace(FIXTURES / "zml-sample.jsonl"))
    reg = registry()
    run = replay(arrivals, ReplayFleet(reg), StrategyRouter("least_busy"), name="least_busy",
                 kind="strategy", default_model=MODEL, slo_ms=500)
    doc = replay_document("t.jsonl", len(arrivals), 1.0, run.virtual_s, [summarize(run)])
    assert set(doc) == {"trace", "requests", "wall_s", "virtual_s", "results"}
    row = doc["results"][0]
    assert set(row) == {"name", "kind", "requests", "completed", "errors", "ttft_ms", "e2e_ms",
                        "slo_ms", "slo_attainment", "share_by_family", "prefix_cache_hit_rate",
                        "cost_usd", "usd_per_1m_output_tokens"}
    assert set(row["ttft_ms"]) == {"p50", "p90", "p99"} and set(row["e2e_ms"]) == {"p50", "p99"}
    assert row["ttft_ms"]["p50"] <= row["ttft_ms"]["p90"] <= row["ttft_ms"]["p99"]
    assert 0.0 <= row["slo_attainment"] <= 1.0 and row["slo_ms"] == 500


def test_an_unknown_strategy_suggests_the_right_name():
    import zml
    from zml.sim.replay import StrategyRouter

    with pytest.raises(zml.InvalidRequestError, match="did you mean 'round_robin'"):
        StrategyRouter("round-robin")


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, "fast"])
def test_a_bad_time_scale_is_refused(scale):
    import zml
    from zml.sim import SimNode
    from zml.sim.spec import SimNodeSpec

    with pytest.raises(zml.InvalidRequestError, match="time_scale must be a finite number"):
        SimNode(SimNodeSpec(id="n", family="H100", models=("m",), max_concurrency=1),
                time_scale=scale)
