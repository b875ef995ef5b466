"""What the ``zml_request_headers`` seam costs per attempt (``Call.headers_for``).

The trace context reaches nodes through a hook called once per attempt when the request's
headers are built. This prints the time of one ``headers_for`` call, median of rounds, in
three set-ups:

* ``no plugin``: no implementation of the hook (the telemetry plugin unregistered): a cached
  lookup, then the client's shared header dict is returned as it is;
* ``otel idle``: the built-in OpenTelemetry plugin with no SDK configured (zml's default):
  one pluggy call whose implementation finds no span and returns;
* ``otel traced``: an SDK tracer provider: the request span's ``traceparent`` is injected
  through ``opentelemetry.propagate`` and merged with the client's headers.

Figures, not a gate; always exits 0. Run: ``uv run python benchmarks/header_hook.py``
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

import zml
from zml.plugins.default.otel import OpenTelemetryPlugin

CONFIG = """
[accelerators.H100]

[[nodes]]
id = "a"
family = "H100"
url = "http://127.0.0.1:9"
models = ["m"]
max_concurrency = 4
"""
CALLS = 20_000
ROUNDS = 7


def per_call_us(client: zml.Client) -> float:
    dispatcher: Any = client._dispatcher
    call = dispatcher.start(model="m", messages=[{"role": "user", "content": "hi"}],
                            policy=None, accelerator=None, params={}, stream=False,
                            metadata=None, timeouts=zml.Timeouts())
    node = next(iter(client.fleet))
    step = SimpleNamespace(node=node, routing=None)
    rounds = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(CALLS):
            call.headers_for(step)
        rounds.append((time.perf_counter() - t0) / CALLS * 1e6)
    call.ended(None)
    return statistics.median(rounds)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "zml.toml"
        path.write_text(CONFIG)
        with zml.Client(config=path, api_key="k") as client:
            client.plugins.unregister(name="zml.otel")
            bare = per_call_us(client)
        with zml.Client(config=path, api_key="k") as client:
            client.plugins.unregister(name="zml.otel")
            client.plugins.register(OpenTelemetryPlugin(), name="zml.otel")
            idle = per_call_us(client)
        with zml.Client(config=path, api_key="k") as client:
            client.plugins.unregister(name="zml.otel")
            client.plugins.register(OpenTelemetryPlugin(tracer_provider=TracerProvider()),
                                    name="zml.otel")
            traced = per_call_us(client)
    print(f"headers_for no plugin:   {bare:.2f} us")
    print(f"headers_for otel idle:   {idle:.2f} us")
    print(f"headers_for otel traced: {traced:.2f} us")


if __name__ == "__main__":
    main()
