"""Active probes: Prometheus parsing per backend kind, and what a probe makes of a node's answers.

The metric samples below are written by hand from the metric names each serving stack
documents (vLLM, SGLang, TGI, llama.cpp's server), with the HELP/TYPE lines, label sets and
neighbouring metrics a real exposition carries. The probe functions run against
``httpx2.MockTransport``; the end-to-end probing of simulated nodes is in tests/e2e/test_health.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest

from zml.config import load_registry
from zml.fleet import Fleet
from zml.probe import LOAD_GAUGES, Prober, parse_load, probe_node, probe_node_async

VLLM = """\
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",gpu_memory_utilization="0.9"} 1.0
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.41
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 123456.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.04",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.71
"""

VLLM_TWO_MODELS = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/llama-3-8b-instruct"} 1.0
vllm:num_requests_running{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 6.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/llama-3-8b-instruct"} 2.0
vllm:num_requests_waiting{model_name="mistralai/Mistral-7B-Instruct-v0.3"} 3.0
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{dp_rank="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
sglang:num_running_reqs{dp_rank="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{dp_rank="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4096.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{dp_rank="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
sglang:num_queue_reqs{dp_rank="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{dp_rank="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
"""

TGI = """\
# TYPE tgi_request_count counter
tgi_request_count 1042
# TYPE tgi_queue_size gauge
tgi_queue_size 6
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 16
# TYPE tgi_batch_current_max_tokens gauge
tgi_batch_current_max_tokens 21504
# TYPE tgi_request_duration summary
tgi_request_duration{quantile="0.5"} 1.2
tgi_request_duration{quantile="0.99"} 4.8
tgi_request_duration_sum 1250.0
tgi_request_duration_count 1042
"""

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 5120
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 20480
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.125
# HELP llamacpp:requests_processing Number of request processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 3
# HELP llamacpp:requests_deferred Number of request deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 2
"""

NO_GAUGES = """\
# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 12.5
# HELP python_info Python platform information
# TYPE python_info gauge
python_info{implementation="CPython",major="3",minor="11",patchlevel="9",version="3.11.9"} 1.0
"""


@pytest.mark.parametrize(
    ("kind", "text", "expected"),
    [
        ("vllm", VLLM, (5, 4)),
        ("vllm", VLLM_TWO_MODELS, (7, 5)),
        ("sglang", SGLANG, (12, 3)),
        ("tgi", TGI, (16, 6)),
        ("llamacpp", LLAMACPP, (3, 2)),
    ],
)
def test_parse_load_per_backend(kind: str, text: str, expected: tuple[int, int]) -> None:
    assert parse_load(kind, text) == expected


@pytest.mark.parametrize("kind", ["vllm", "sglang", "tgi", "llamacpp"])
def test_a_text_without_the_gauges_gives_none(kind: str) -> None:
    assert parse_load(kind, NO_GAUGES) == (None, None)
    assert parse_load(kind, "") == (None, None)


@pytest.mark.parametrize(
    ("kind", "other"), [("vllm", SGLANG), ("sglang", TGI), ("tgi", LLAMACPP), ("llamacpp", VLLM)]
)
def test_another_backends_gauges_are_not_read(kind: str, other: str) -> None:
    assert parse_load(kind, other) == (None, None)


def test_only_one_of_the_two_gauges() -> None:
    text = "# TYPE tgi_queue_size gauge\ntgi_queue_size 4\n"
    assert parse_load("tgi", text) == (None, 4)
    text = "# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 1\n"
    assert parse_load("llamacpp", text) == (1, None)


def test_gauges_without_help_or_type_and_with_timestamps() -> None:
    text = (
        'vllm:num_requests_running{model_name="m"} 2 1712345678000\n'
        'vllm:num_requests_waiting{model_name="m"} 1 1712345678000\n'
    )
    assert parse_load("vllm", text) == (2, 1)


def test_openai_kind_has_no_gauges_and_unknown_kinds_read_vllm_names() -> None:
    assert LOAD_GAUGES["openai"] == ((), ())
    assert parse_load("openai", VLLM) == (None, None)
    assert parse_load("some-new-backend", VLLM) == (5, 4)


def test_unparseable_text_raises_value_error() -> None:
    with pytest.raises(ValueError):
        parse_load("vllm", "<html><body>Bad gateway</body></html>")


@pytest.mark.parametrize("bad", ["NaN", "+Inf", "-Inf"])
def test_non_finite_gauge_values_count_as_missing(bad: str) -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{model_name="m"}} {bad}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m"} 2\n'
    )
    assert parse_load("vllm", text) == (None, 2)


# --- probe_node / probe_node_async / Prober against scripted nodes ---------------------------

CONFIG = """
[accelerators.H100]

[[nodes]]
id = "v"
family = "H100"
url = "http://v:8000"
models = ["m"]
max_concurrency = 4
kind = "vllm"

[[nodes]]
id = "o"
family = "H100"
url = "http://o:8000"
models = ["m"]
max_concurrency = 4
kind = "openai"

[[nodes]]
id = "t"
family = "H100"
url = "http://t:8000"
models = ["m"]
max_concurrency = 4
kind = "tgi"
"""


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    path = tmp_path / "zml.toml"
    path.write_text(CONFIG)
    return Fleet(load_registry(path))


def scripted(answers: dict[tuple[str, str], Any]) -> tuple[httpx2.MockTransport, list[str]]:
    seen: list[str] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(f"{request.url.host}{request.url.path}")
        answer = answers.get((request.url.host, request.url.path), 404)
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, int):
            return httpx2.Response(answer, json={"error": "x"})
        return httpx2.Response(200, text=answer)

    return httpx2.MockTransport(handler), seen


ANSWERS: dict[tuple[str, str], Any] = {
    ("v", "/health"): "",
    ("v", "/metrics"): VLLM,
    ("o", "/health"): "",
    ("t", "/health"): "",
    ("t", "/metrics"): TGI,
}


def test_probe_node_sync_and_async_agree(fleet: Fleet) -> None:
    transport, seen = scripted(ANSWERS)
    with httpx2.Client(transport=transport) as http:
        sync_results = [probe_node(http, node) for node in fleet]

    async def main() -> list[Any]:
        async with httpx2.AsyncClient(transport=transport) as http:
            return [await probe_node_async(http, node) for node in fleet]

    async_results = asyncio.run(main())
    assert sync_results == async_results
    by_id = {r.node_id: r for r in sync_results}
    assert (by_id["v"].healthy, by_id["v"].running, by_id["v"].waiting, by_id["v"].load) == (
        True, 5, 4, 9)
    assert (by_id["t"].running, by_id["t"].waiting, by_id["t"].load) == (16, 6, 22)
    # an "openai" node is never asked for /metrics; it has no reported load
    assert (by_id["o"].healthy, by_id["o"].load, by_id["o"].error) == (True, None, None)
    assert "o/metrics" not in seen


def test_probe_marks_down_nodes_and_tolerates_missing_metrics(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="zml")
    answers: dict[tuple[str, str], Any] = {
        ("v", "/health"): 503,
        ("o", "/health"): httpx2.ConnectError("refused"),
        ("t", "/health"): "",
        ("t", "/metrics"): "<html>not prometheus</html>",
    }
    transport, _ = scripted(answers)
    with httpx2.Client(transport=transport) as http:
        results = {node.id: probe_node(http, node) for node in fleet}
    assert results["v"].healthy is False and "503" in (results["v"].error or "")
    assert results["o"].healthy is False and "ConnectError" in (results["o"].error or "")
    assert results["t"].healthy is True and results["t"].load is None
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_prober_merges_reported_load_into_node_state(fleet: Fleet) -> None:
    transport, _ = scripted(ANSWERS)
    prober = Prober(fleet, interval_s=60)
    v = fleet.node("v")
    fleet.reserve(v, 0.0)  # this client's own request: in_flight 1
    with httpx2.Client(transport=transport) as http:
        prober.probe_all(http)
    status = {s["id"]: s for s in fleet.status()}
    assert status["v"]["in_flight"] == 1
    assert status["v"]["reported_load"] == 9 and status["v"]["load"] == 9
    assert status["t"]["reported_load"] == 22 and status["t"]["load"] == 22
    assert status["o"]["reported_load"] is None and status["o"]["load"] == 0

    async def main() -> None:
        async with httpx2.AsyncClient(transport=scripted({
            ("v", "/health"): "", ("v", "/metrics"): NO_GAUGES,
            ("o", "/health"): "", ("t", "/health"): 500,
        })[0]) as http:
            await prober.aprobe_all(http)

    asyncio.run(main())
    status = {s["id"]: s for s in fleet.status()}
    # no gauges any more: back to the client's own accounting
    assert status["v"]["reported_load"] is None and status["v"]["load"] == 1
    assert status["t"]["health"] == 0.0


ONE_RUNNING = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_request_that_ends_while_the_report_is_on_its_way_is_not_counted(
    fleet: Fleet, mode: str
) -> None:
    """The node counted this client's request, which ended before the report was applied:
    the node is free (it stayed full until the next round, two seconds later, before)."""
    v = fleet.node("v")
    reservation = fleet.reserve(v, time.monotonic())

    def handler(request: httpx2.Request) -> httpx2.Response:
        if request.url.path == "/metrics" and request.url.host == "v":
            fleet.release(reservation)  # the request ends while the node's answer travels
            return httpx2.Response(200, text=ONE_RUNNING)
        return httpx2.Response(200 if request.url.host == "v" else 404, text="")

    transport = httpx2.MockTransport(handler)
    if mode == "sync":
        with httpx2.Client(transport=transport) as http:
            Prober(fleet).probe_all(http)
    else:
        async def main() -> None:
            async with httpx2.AsyncClient(transport=transport) as http:
                await Prober(fleet).aprobe_all(http)

        asyncio.run(main())
    assert (v.in_flight, v.reported_load, v.load) == (0, 0, 0)


def test_a_report_errs_low_for_the_requests_it_may_have_counted(fleet: Fleet) -> None:
    v = fleet.node("v")
    now = time.monotonic()
    long = fleet.reserve(v, now)
    mark = fleet.load_mark(v)  # the probe asks: one request of ours is in flight
    short = fleet.reserve(v, now)  # one more starts, the node counts it, and it ends...
    fleet.release(short)  # ... before the report arrives: it is gone from the report
    fleet.record_probe(v, now, healthy=True, reported_load=3, mark=mark)
    assert (v.in_flight, v.reported_load, v.load) == (1, 2, 2)
    fleet.release(long)  # in flight when the report came: it may be in it, it goes
    assert (v.in_flight, v.reported_load, v.load) == (0, 1, 1)
    later = fleet.reserve(v, now + 1.0)  # started after the report: not in it
    fleet.release(later)
    assert (v.reported_load, v.load) == (1, 1)


def test_a_report_that_frees_a_node_wakes_queued_requests(fleet: Fleet) -> None:
    """As a shared ledger's lower count does: a request queued for capacity need not wait for
    a release of this client's."""
    woken: list[int] = []
    fleet.add_capacity_listener(lambda: woken.append(1))
    v = fleet.node("v")
    fleet.record_probe(v, time.monotonic(), healthy=True, reported_load=4)
    assert woken == []
    fleet.record_probe(v, time.monotonic(), healthy=True, reported_load=1)
    assert woken == [1]
    fleet.record_probe(v, time.monotonic(), healthy=True, reported_load=1)
    assert woken == [1]


def test_one_bad_node_does_not_stop_the_others_being_probed(fleet: Fleet) -> None:
    inf = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running +Inf\n"
    answers = {**ANSWERS, ("v", "/metrics"): inf}
    transport, _ = scripted(answers)

    async def main() -> list[Any]:
        async with httpx2.AsyncClient(transport=transport) as http:
            return await Prober(fleet).aprobe_all(http)

    results = {r.node_id: r for r in asyncio.run(main())}
    assert results["t"].load == 22
    assert fleet.node("t").reported_load == 22


def test_the_async_prober_probes_every_interval_and_stops(fleet: Fleet) -> None:
    transport, seen = scripted(ANSWERS)

    async def main() -> tuple[int, int]:
        async with httpx2.AsyncClient(transport=transport) as http:
            prober = Prober(fleet, interval_s=0.05)
            prober.start(http)
            prober.start(http)  # idempotent: one schedule
            for _ in range(400):  # a hang guard; three rounds come within 0.1 s or so
                if seen.count("v/health") >= 3:
                    break
                await asyncio.sleep(0.01)
            await prober.stop()
            rounds = seen.count("v/health")
            await asyncio.sleep(0.2)
            return rounds, seen.count("v/health")

    rounds, later = asyncio.run(main())
    assert rounds >= 3 and later == rounds  # nothing after stop()


def test_a_loop_closed_without_shutdown_leaves_no_prober_task_behind(
    fleet: Fleet, caplog: pytest.LogCaptureFixture
) -> None:
    """Between rounds only a loop timer waits: ``run_until_complete`` then ``close()`` (no
    task cancellation) logs no "Task was destroyed but it is pending"; the prober moves to the
    next loop it is started in."""
    import gc

    transport, seen = scripted(ANSWERS)
    prober = Prober(fleet, interval_s=0.05)
    http = httpx2.AsyncClient(transport=transport)

    async def use() -> None:
        prober.start(http)
        while seen.count("v/health") < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.01)  # the round has ended: its timer waits

    loop = asyncio.new_event_loop()
    loop.run_until_complete(use())
    loop.close()
    del loop
    gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []

    async def again() -> None:
        before = seen.count("v/health")
        prober.start(http)  # the old loop's schedule is gone: a new one here
        while seen.count("v/health") < before + 2:
            await asyncio.sleep(0.01)
        await prober.stop()
        await http.aclose()

    asyncio.run(asyncio.wait_for(again(), 30))
