"""/metrics under each backend kind, parsed with prometheus_client's own parser."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

LOAD_NAMES = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", True),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", True),
    "tgi": ("tgi_batch_current_size", "tgi_queue_size", False),
    "llamacpp": ("llamacpp:requests_processing", "llamacpp:requests_deferred", False),
}


def _samples(text):
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def _total(samples, name):
    return sum(value for _, value in samples[name])


@pytest.mark.parametrize("kind", sorted(LOAD_NAMES))
async def test_metrics_names_per_kind_idle(make_node, client_for, chat, kind):
    node = make_node(kind=kind, models=("m1", "m2"))
    client = client_for(node)
    assert (await chat(client)).status_code == 200
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    samples = _samples(r.text)
    running, waiting, labelled = LOAD_NAMES[kind]
    assert _total(samples, running) == 0
    assert _total(samples, waiting) == 0
    if labelled:
        assert sorted(labels["model_name"] for labels, _ in samples[running]) == ["m1", "m2"]
    else:
        assert samples[running] == [({}, 0.0)]
    assert samples["zml_sim_requests_total"] == [({}, 1.0)]
    assert samples["zml_sim_requests_aborted_total"] == [({}, 0.0)]
    assert samples["zml_sim_requests_running_peak"] == [({}, 1.0)]
    other_kinds = {n for k, names in LOAD_NAMES.items() if k != kind for n in names[:2]}
    assert not other_kinds & set(samples)


async def test_openai_kind_has_no_metrics(make_node, client_for):
    client = client_for(make_node(kind="openai"))
    assert (await client.get("/metrics")).status_code == 404
    assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize("kind", sorted(LOAD_NAMES))
async def test_metrics_report_live_load(make_node, client_for, chat, tk, kind):
    node = make_node(kind=kind, max_concurrency=1, time_scale=1.0, ttft_ms=5000)
    client = client_for(node)
    tasks = [asyncio.ensure_future(chat(client)) for _ in range(3)]
    try:
        await tk.wait_for(lambda: node.stats.waiting == 2)
        samples = _samples((await client.get("/metrics")).text)
        running, waiting, labelled = LOAD_NAMES[kind]
        assert _total(samples, running) == 1
        assert _total(samples, waiting) == 2
        if labelled:
            assert samples[running] == [({"model_name": "m1"}, 1.0)]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    assert node.stats.running == 0 and node.stats.waiting == 0


def test_unknown_kind_rejected(tk):
    with pytest.raises(ValueError, match="kind"):
        tk.spec(kind="triton")
