"""The node performance model, driven in virtual time (no clock, no sleeping)."""

from __future__ import annotations

import math

import pytest

from zml.sim.model import BLOCK_TOKENS, ModelRequest, NodeModel, hit_rate, prompt_blocks
from zml.sim.profiles import FamilyProfile, profile_for

PROFILE = FamilyProfile(
    ttft_ms=10.0,
    tokens_per_s=100.0,
    prefill_tokens_per_s=10_000.0,
    batch_slowdown=0.1,
    context_ms_per_1k_tokens=0.0,
    kv_cache_tokens=100_000,
)


def run(node: NodeModel, until: float = math.inf) -> dict[tuple[str, object], float]:
    """Drive the node from event to event; {(kind, key): time}."""
    seen: dict[tuple[str, object], float] = {}
    while True:
        t = node.next_event_time()
        if t > until or t == math.inf:
            return seen
        for event in node.advance(t):
            seen[(event.kind, event.key)] = event.time


def req(key: object, prompt: int = 100, output: int = 10, blocks: tuple[object, ...] = ()) -> ModelRequest:
    return ModelRequest(key, prompt, output, blocks)  # type: ignore[arg-type]


def test_idle_ttft_is_overhead_plus_prefill_of_the_prompt():
    node = NodeModel(PROFILE, 4)
    assert node.admit(req("a", prompt=2000), 0.0) == "running"
    seen = run(node)
    assert seen[("first_token", "a")] == pytest.approx(0.010 + 2000 / 10_000)
    # nine more tokens, one decode step each at 100 tokens/s alone
    assert seen[("finished", "a")] == pytest.approx(0.210 + 9 * 0.01)


def test_a_longer_prompt_waits_longer_for_its_first_token():
    short, long = NodeModel(PROFILE, 4), NodeModel(PROFILE, 4)
    short.admit(req("s", prompt=200), 0.0)
    long.admit(req("l", prompt=12_000), 0.0)
    assert run(long)[("first_token", "l")] > run(short)[("first_token", "s")]


def test_decode_slows_down_as_the_batch_fills():
    idle = NodeModel(PROFILE, 8)
    idle.admit(req("x", output=101), 0.0)
    alone = run(idle)
    full = NodeModel(PROFILE, 8)
    for i in range(8):
        full.admit(req(i, output=101), 0.0)
    busy = run(full)
    decode_alone = alone[("finished", "x")] - alone[("first_token", "x")]
    decode_full = busy[("finished", 7)] - busy[("first_token", 7)]
    assert decode_alone == pytest.approx(100 * 0.01)
    # 8 sequences: each step takes 1 + 0.1 x 7 = 1.7 one-sequence steps
    assert decode_full > 1.5 * decode_alone


def test_context_held_by_the_batch_slows_each_step():
    profile = FamilyProfile(10.0, 100.0, 1e9, 0.0, 1.0, 1_000_000)  # +1 ms per 1k tokens of context
    small, large = NodeModel(profile, 2), NodeModel(profile, 2)
    small.admit(req("a", prompt=100, output=11), 0.0)
    large.admit(req("a", prompt=50_000, output=11), 0.0)
    s, big = run(small), run(large)
    assert (big[("finished", "a")] - big[("first_token", "a")]) > (s[("finished", "a")] - s[("first_token", "a")])


def test_fifo_queue_behind_the_slots_and_queue_full():
    node = NodeModel(PROFILE, 1, queue_size=2)
    assert node.admit(req(1), 0.0) == "running"
    assert node.admit(req(2), 0.0) == "queued"
    assert node.admit(req(3), 0.0) == "queued"
    assert node.admit(req(4), 0.0) == "queue_full"
    assert (node.running, node.waiting, node.load) == (1, 2, 3)
    seen = run(node)
    assert seen[("started", 2)] == seen[("finished", 1)]
    assert seen[("finished", 1)] < seen[("finished", 2)] < seen[("finished", 3)]
    assert node.load == 0


def test_kv_budget_limits_admission_and_rejects_what_never_fits():
    profile = FamilyProfile(0.0, 100.0, 10_000.0, 0.0, 0.0, 1_000)
    node = NodeModel(profile, 8)
    assert node.admit(req("big", prompt=990, output=20), 0.0) == "exceeds_kv_cache"
    assert node.admit(req("a", prompt=600, output=10), 0.0) == "running"
    assert node.admit(req("b", prompt=600, output=10), 0.0) == "queued"  # a slot, but no KV room
    assert node.kv_reserved == 610
    seen = run(node)
    assert seen[("started", "b")] == seen[("finished", "a")]


def test_cached_prefix_blocks_skip_prefill():
    node = NodeModel(PROFILE, 4)
    blocks = ("b0", "b1", "b2", "b3")
    node.admit(req("cold", prompt=4 * BLOCK_TOKENS + 100, output=1, blocks=blocks), 0.0)
    cold = run(node)
    node.admit(req("warm", prompt=4 * BLOCK_TOKENS + 100, output=1, blocks=blocks), 10.0)
    warm = run(node)
    cold_ttft = cold[("first_token", "cold")]
    warm_ttft = warm[("first_token", "warm")] - 10.0
    assert warm_ttft == pytest.approx(0.010 + 100 / 10_000)
    assert cold_ttft > warm_ttft
    assert node.cached_tokens_total == 4 * BLOCK_TOKENS
    assert hit_rate([node]) == pytest.approx(4 * BLOCK_TOKENS / (2 * (4 * BLOCK_TOKENS + 100)))


def test_prefix_hits_stop_at_the_first_miss_and_partial_blocks_are_not_cached():
    node = NodeModel(PROFILE, 4)
    node.admit(req("a", prompt=2 * BLOCK_TOKENS + 10, output=1, blocks=("x", "y", "partial")), 0.0)
    run(node)
    assert node.cached_blocks == 2 and not node.has_block("partial")
    node.admit(req("b", prompt=3 * BLOCK_TOKENS, output=1, blocks=("x", "other", "y")), 1.0)
    run(node)
    assert node.cached_tokens_total == BLOCK_TOKENS


def test_prefix_cache_is_lru_within_the_kv_budget():
    # 4 blocks and a token: a running request of one block + 1 output token leaves room for 3
    profile = FamilyProfile(0.0, 100.0, 1e6, 0.0, 0.0, 4 * BLOCK_TOKENS + 1)
    node = NodeModel(profile, 1)
    for i, blocks in enumerate([("a",), ("b",), ("c",), ("a",), ("d",)]):
        node.admit(req(i, prompt=BLOCK_TOKENS, output=1, blocks=blocks), float(i))
        run(node)
    # room for 3 blocks: "a" was used again, so "b" was the least recently used one
    assert [node.has_block(b) for b in "abcd"] == [True, False, True, True]


def test_cancel_frees_the_slot_for_the_next_in_line():
    node = NodeModel(PROFILE, 1)
    node.admit(req(1, output=1000), 0.0)
    node.admit(req(2), 0.0)
    run(node, until=0.5)
    assert node.cancel(1, 0.5)
    assert not node.cancel(1, 0.5)
    seen = run(node)
    assert seen[("started", 2)] == pytest.approx(0.5)
    assert ("finished", 1) not in seen and node.load == 0


def test_time_scale_zero_does_everything_at_once_in_order():
    node = NodeModel(PROFILE, 1, time_scale=0.0)
    node.admit(req(1, prompt=5000, output=50), 3.0)
    node.admit(req(2, prompt=5000, output=50), 3.0)
    seen = run(node)
    assert set(seen.values()) == {3.0}
    assert node.load == 0


def test_token_pacing_for_live_streams():
    node = NodeModel(PROFILE, 2)
    node.admit(req("a", prompt=100, output=5), 0.0)
    first = run(node, until=0.02)[("first_token", "a")]
    assert node.tokens_out("a", first) == 1
    due = node.token_time("a", 3)
    assert due == pytest.approx(first + 3 * 0.01)
    assert node.tokens_out("a", due + 1e-6) == 4


def test_bad_requests_are_refused():
    node = NodeModel(PROFILE, 1)
    with pytest.raises(ValueError):
        node.admit(req("a", prompt=0), 0.0)
    node.admit(req("a"), 0.0)
    with pytest.raises(ValueError):
        node.admit(req("a"), 0.0)
    with pytest.raises(ValueError):
        NodeModel(PROFILE, 0)


def test_prompt_blocks_are_chained_hashes_of_full_512_token_chunks():
    system = {"role": "system", "content": " ".join(f"w{i}" for i in range(1100))}
    one = prompt_blocks([system, {"role": "user", "content": "first question"}])
    two = prompt_blocks([system, {"role": "user", "content": "another one"}])
    assert len(one) == 2 == len(two)  # 1,100 words + 2 roles + 2 = 1,104 tokens: two full blocks
    assert one == two  # both blocks lie inside the shared system prompt
    other = prompt_blocks([{"role": "system", "content": "x " + system["content"]}])
    assert other[0] != one[0] and other[1] != one[1]  # a changed first block changes every id
    assert prompt_blocks([{"role": "user", "content": "short"}]) == ()


def test_built_in_profiles_order_the_families_as_their_datasheets_do():
    h100, pcie, mi300x, a100, l4, cpu = (profile_for(f) for f in
                                         ("H100", "H100_PCIe", "MI300X", "A100", "L4", "CPU"))
    assert mi300x.tokens_per_s > h100.tokens_per_s > pcie.tokens_per_s > l4.tokens_per_s > cpu.tokens_per_s
    assert h100.prefill_tokens_per_s > pcie.prefill_tokens_per_s > a100.prefill_tokens_per_s > l4.prefill_tokens_per_s
    assert mi300x.kv_cache_tokens > h100.kv_cache_tokens == a100.kv_cache_tokens > l4.kv_cache_tokens
    assert profile_for("h100") == h100 and profile_for("unknown-family") == a100
