"""The routing index gives the same decisions as a straightforward scan.

A real :class:`zml.fleet.Fleet` keeps a :class:`zml.routing_index.FamilyIndex` per (model,
family) up to date from its state changes; routing reads it instead of scanning. Here random
fleets go through random sequences of state changes (reservations, releases, successes with
latencies, failures that open circuits, probes reporting load or an unhealthy node, lease
refusals, time passing), and after each one the indexed decision is compared with the decision
of the same engine on a view of the same fleet without indexes (the scan): same node, same
family, same prediction, same trace, for every policy mode (and no policy), prompt size, exclusion and pin.
"""

from __future__ import annotations

import random
import typing
from collections.abc import Sequence

from hypothesis import given, settings, strategies as st

from zml import routing, routing_index
from zml.config import load_registry
from zml.fleet import Fleet
from zml.routing import Decision, route

FAMILIES = ("H100", "MI300X", "L4")
MODEL = "m"


class ScanView:
    """The same fleet, without its routing index (so routing scans it)."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def families(self) -> Sequence[str]:
        return self._fleet.families()

    def family_cost(self, family: str) -> float | None:
        return self._fleet.family_cost(family)

    def nodes_for(self, model: str, family: str) -> Sequence[typing.Any]:
        return self._fleet.nodes_for(model, family)

    def family_prior(self, family: str) -> tuple[float, float | None]:
        return self._fleet.family_prior(family)


@typing.no_type_check
def _fleet(tmp_path_factory: typing.Any, sizes: list[tuple[int, int, int]]) -> Fleet:
    lines = [f"[accelerators.{f}]\ncost_per_hour = {1.0 + i}\n" for i, f in enumerate(FAMILIES)]
    for i, (fam, mc, mq) in enumerate(sizes):
        lines.append(
            f'[[nodes]]\nid = "n{i}"\nfamily = "{FAMILIES[fam]}"\nurl = "http://127.0.0.1:{i + 1}"\n'
            f'models = ["{MODEL}"]\nmax_concurrency = {mc}\nmax_queue = {mq}\n'
        )
    path = tmp_path_factory.mktemp("ix") / "zml.toml"
    path.write_text("\n".join(lines))
    return Fleet(load_registry(path))


class P(typing.NamedTuple):
    name: str
    accelerator_chain: tuple[str, ...]
    latency_target_ms: float | None
    cost_priority: typing.Literal["cost", "latency", "balanced"]
    health_threshold: float
    affinity: str | None


nodes_st = st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3), st.integers(0, 2)),
                    min_size=1, max_size=14)
ops_st = st.lists(
    st.tuples(st.sampled_from(["reserve", "release", "first", "ok", "fail", "probe", "sick",
                               "refuse", "tick"]),
              st.integers(0, 13), st.integers(0, 4000), st.sampled_from([5.0, 20.0, 80.0, 300.0])),
    max_size=40,
)
policy_st = st.builds(
    P,
    name=st.just("p"),
    accelerator_chain=st.lists(st.sampled_from(FAMILIES), unique=True, min_size=1).map(tuple),
    latency_target_ms=st.sampled_from([None, 60.0, 200.0, 1000.0]),
    cost_priority=st.sampled_from(["cost", "latency", "balanced"]),
    health_threshold=st.sampled_from([0.0, 0.5, 1.0]),
    affinity=st.sampled_from([None, "prefix"]),
)


@settings(max_examples=120, deadline=None)
@given(nodes_st, ops_st, st.lists(st.none() | policy_st, min_size=1, max_size=3),
       st.integers(0, 2**31),
       st.data())
def test_indexed_decisions_equal_the_scan(
    tmp_path_factory: typing.Any, sizes: list[tuple[int, int, int]],
    ops: list[tuple[str, int, int, float]], pols: list[P | None], seed: int,
    data: st.DataObject,
) -> None:
    fleet = _fleet(tmp_path_factory, sizes)
    scan = ScanView(fleet)
    held: list[typing.Any] = []
    now = 100.0
    nodes = list(fleet)

    def compare() -> None:
        # the index is current: the same entries as one built from scratch
        for family in FAMILIES:
            ix = fleet.family_index(MODEL, family)
            if ix is None:
                continue
            fresh = routing_index.FamilyIndex(ix.nodes, ix.prior, fleet.family_prior(family)[1])
            assert ix.ordered == fresh.ordered
            assert ix.entries == fresh.entries
            assert ix.by_ratio == fresh.by_ratio
            assert ix.ratio_entries == fresh.ratio_entries
            assert ix.suspects == fresh.suspects
            assert (ix.sum_load, ix.sum_cap) == (fresh.sum_load, fresh.sum_cap)
        for policy in pols:
            tokens = data.draw(st.sampled_from([0, 50, 3000]))
            exclude = frozenset(data.draw(st.lists(st.sampled_from([n.id for n in nodes]),
                                                   max_size=2)))
            pinned = data.draw(st.sampled_from([None, None, *FAMILIES]))
            kw: dict[str, typing.Any] = dict(now=now, pinned_family=pinned, exclude=exclude,
                                             prompt_tokens=tokens, prefix_blocks=("b",))
            a = route(policy, MODEL, fleet, rng=random.Random(seed), **kw)
            b = route(policy, MODEL, scan, rng=random.Random(seed), **kw)
            assert type(a) is type(b)
            assert a.evaluated == b.evaluated
            if isinstance(a, Decision):
                assert isinstance(b, Decision)
                assert a.node is b.node
                assert a.family == b.family
                assert a.predicted_ttft_ms == b.predicted_ttft_ms
            else:
                assert a == b

    compare()
    for op, k, tokens, ms in ops:
        node = nodes[k % len(nodes)]
        with fleet.lock:
            if op == "reserve":
                if node.load < node.max_concurrency + node.max_queue:
                    held.append(fleet.reserve(node, now, tokens))
            elif op == "release" and held:
                fleet.release(held.pop(k % len(held)))
            elif op == "first" and held:
                fleet.first_token(held[k % len(held)])
            elif op == "ok":
                fleet.record_success(node, now, ms / 1000.0, ms * 5 / 1000.0)
            elif op == "fail":
                for _ in range(k % 6):
                    fleet.record_failure(node, now)
            elif op == "probe":
                fleet.record_probe(node, now, healthy=True, reported_load=k % 5)
            elif op == "sick":
                fleet.record_probe(node, now, healthy=False, reported_load=None)
            elif op == "refuse" and held:
                fleet.lease_refused(held.pop(k % len(held)), now)
            elif op == "tick":
                now += ms / 10.0
                fleet.refresh(now)
        compare()


def test_the_index_reads_only_what_it_needs() -> None:
    # the two copies of the service-time prior agree
    assert routing_index.PRIOR_SERVICE_MS == routing.PRIOR_SERVICE_MS
