"""OpenTelemetry tracing and metrics for every request, through ``opentelemetry-api`` only.

zml depends on the API, never the SDK: without a configured SDK the API's no-op providers make
this plugin nearly free, and an application that configures one (``TracerProvider``,
``MeterProvider``) gets, per the GenAI semantic conventions:

* one span per request, kind CLIENT, named ``chat {model}``, with ``gen_ai.operation.name``,
  ``gen_ai.provider.name`` (and the older ``gen_ai.system``) = ``"zml"``,
  ``gen_ai.request.model``, the request's parameters (``gen_ai.request.max_tokens``,
  ``temperature``, ``top_p``, ``seed``, ``frequency_penalty``, ``presence_penalty``,
  ``stop_sequences``, ``choice.count`` when not 1), ``gen_ai.request.stream`` (set, true, on
  streams only), ``gen_ai.response.model``, ``gen_ai.response.id``,
  ``gen_ai.response.finish_reasons``, ``gen_ai.response.time_to_first_chunk`` (streams: seconds
  from the call to the first chunk, queueing and failover included), ``zml.ttft_s`` (streams:
  seconds from sending to the first token on the node that answered: the TTFT policies route
  on),
  ``gen_ai.usage.input_tokens``,
  ``gen_ai.usage.output_tokens``, ``server.address``/``server.port``, plus ``zml.policy``,
  ``zml.accelerator``, ``zml.node_id``, ``zml.queue_depth``, ``zml.attempts`` and the cost;
* an event ``zml.route.family`` per family evaluated by each routing decision (with
  ``zml.family``, ``zml.nodes_checked``, ``zml.rejected_reason`` when rejected), and an event
  ``zml.attempt.failed`` per failed attempt (``zml.node_id``, ``zml.accelerator``,
  ``error.type``, ``http.response.status_code``);
* on failure, status ERROR with ``error.type`` (the exception's class name; for a
  RoutingError also ``zml.final_error``) and the exception recorded; a request the caller
  cancelled (a stream closed early, a cancelled task) is marked ``zml.cancelled``, without an
  error status;
* histograms ``gen_ai.client.operation.duration`` (s), ``gen_ai.client.token.usage``
  ({token}, with ``gen_ai.token.type`` = ``input`` | ``output``) and, for streams,
  ``gen_ai.client.operation.time_to_first_chunk`` (s), each with ``server.address`` and
  ``server.port`` of the node that answered. The duration is recorded for every request, a
  failed one with ``error.type`` (as its span), a cancelled one with ``error.type`` =
  ``cancelled`` (and the node that had it, if any);
* the trace context sent to nodes: inside a recorded request, each attempt carries the
  request span's context in the headers of the application's propagator
  (``opentelemetry.propagate``: W3C ``traceparent`` by default), so a node's own traces (vLLM's)
  join the caller's.

No prompt or completion text is recorded unless ``ZML_TELEMETRY_CAPTURE_CONTENT=1`` (or
``OpenTelemetryPlugin(capture_content=True)``): then the request's messages are added as the
span attribute ``gen_ai.input.messages``, JSON in the conventions' parts schema (``role`` and
``parts``: ``text``, ``tool_call``, ``tool_call_response``, ``uri`` or ``blob`` parts).
The request body is parsed only while a span records.

The tracer and meter come from the global providers, fetched on first use (so an application
may configure OpenTelemetry after importing zml), unless providers are passed to the plugin.
While neither global provider is configured, the plugin does nothing per request (it looks
again every second), so tracing costs nothing to an application that does not use it; until
the application imports the OpenTelemetry API (or names a provider in
``OTEL_PYTHON_TRACER_PROVIDER`` / ``OTEL_PYTHON_METER_PROVIDER``), it does not even import it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..hookspecs import hookimpl
from .genai import decode_body, input_messages, request_attributes

if TYPE_CHECKING:
    from opentelemetry.metrics import Histogram, MeterProvider
    from opentelemetry.trace import Span, Tracer, TracerProvider

    from ...dispatch import CallView as Call
    from ...errors import NodeError, ZMLError
    from ...types import Attempt, Cost, RoutingInfo

__all__ = ["ENV_CAPTURE_CONTENT", "OpenTelemetryPlugin", "plugin"]

ENV_CAPTURE_CONTENT = "ZML_TELEMETRY_CAPTURE_CONTENT"
PROVIDER = "zml"
RECHECK_S = 1.0
_SPAN = "zml.otel.span"
_CONTEXT = "zml.otel.context"
_ROUTED = "zml.otel.routing"
_CANCELLED = "cancelled"  # the error.type of a request the caller cancelled (zml.cancelled)

DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                    40.96, 81.92)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                 16777216, 67108864)


_PROVIDER_ENV = ("OTEL_PYTHON_TRACER_PROVIDER", "OTEL_PYTHON_METER_PROVIDER")


def _api_in_use() -> bool:
    """Whether a global provider may be configured: the application imported the OpenTelemetry
    API (``set_tracer_provider`` and ``set_meter_provider`` live there), or names a provider
    in the environment, which the API loads on first use. Otherwise no provider exists, and
    importing the API (some 10 ms) to learn that is left out of the first request."""
    return ("opentelemetry.trace" in sys.modules or "opentelemetry.metrics" in sys.modules
            or any(name in os.environ for name in _PROVIDER_ENV))


def _version() -> str:
    from ... import __version__

    return __version__


class OpenTelemetryPlugin:
    """The telemetry plugin; zml registers one instance (``plugin``) as ``zml.otel``.

    Args:
        tracer_provider: the provider to trace with (default: the global one, at first use).
        meter_provider: the provider to measure with (default: the global one, at first use).
        capture_content: record the request's messages; None reads
            ``ZML_TELEMETRY_CAPTURE_CONTENT`` at each request.
    """

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
        capture_content: bool | None = None,
    ) -> None:
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        self._capture_content = capture_content
        self._tracer: Tracer | None = None
        self._duration: Histogram | None = None
        self._tokens: Histogram | None = None
        self._ttfc: Histogram | None = None
        self._explicit = tracer_provider is not None or meter_provider is not None
        self._enabled = False
        self._recheck_at = 0.0

    def enabled(self) -> bool:
        """Whether requests are observed: providers were given, or a global one is configured.

        Without any configured provider every span and instrument would be a no-op, so the
        plugin skips its work; the global providers are looked at again every
        ``RECHECK_S`` seconds, so configuring OpenTelemetry after the first request works.
        """
        if self._explicit:
            return True
        now = time.monotonic()
        if now >= self._recheck_at:
            self._recheck_at = now + RECHECK_S
            if not _api_in_use():  # nothing can have configured a provider: skip the import
                self._enabled = False
                return False
            from opentelemetry import metrics, trace

            traced = not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)
            # The API hands out a proxy until a meter provider is set; it has no public type.
            measured = type(metrics.get_meter_provider()).__name__ != "_ProxyMeterProvider"
            self._enabled = traced or measured
        return self._enabled

    def zml_idle(self) -> bool:
        """Idle (zml skips the hooks only this plugin implements) while not :meth:`enabled`:
        every hook here acts only on a request whose start it recorded."""
        return not self.enabled()

    # --- lazily fetched OpenTelemetry objects ------------------------------------------------

    @property
    def tracer(self) -> Tracer:
        """The tracer (``get_tracer("zml", version)`` on the given or the global provider)."""
        if self._tracer is None:
            from opentelemetry import trace

            self._tracer = trace.get_tracer(
                "zml", _version(), tracer_provider=self._tracer_provider
            )
        return self._tracer

    def _histograms(self) -> tuple[Histogram, Histogram]:
        if self._duration is None or self._tokens is None or self._ttfc is None:
            from opentelemetry import metrics

            meter = metrics.get_meter("zml", _version(), meter_provider=self._meter_provider)
            self._duration = meter.create_histogram(
                "gen_ai.client.operation.duration",
                unit="s",
                description="GenAI operation duration",
                explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
            )
            self._tokens = meter.create_histogram(
                "gen_ai.client.token.usage",
                unit="{token}",
                description="Measures number of input and output tokens used",
                explicit_bucket_boundaries_advisory=TOKEN_BUCKETS,
            )
            self._ttfc = meter.create_histogram(
                "gen_ai.client.operation.time_to_first_chunk",
                unit="s",
                description="Time to receive the first chunk of a streamed answer",
                explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
            )
        return self._duration, self._tokens

    def _time_to_first_chunk(self) -> Histogram:
        self._histograms()
        assert self._ttfc is not None
        return self._ttfc

    def _capture(self) -> bool:
        if self._capture_content is not None:
            return self._capture_content
        return os.environ.get(ENV_CAPTURE_CONTENT, "").strip().lower() in ("1", "true", "yes")

    # --- hooks -------------------------------------------------------------------------------

    @hookimpl
    def zml_request_started(self, call: Call) -> None:
        """Start the request's span."""
        if not self.enabled():
            return
        from opentelemetry.trace import SpanKind

        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.system": PROVIDER,
            "gen_ai.request.model": call.model,
            "zml.stream": call.stream,
        }
        if call.policy_name is not None:
            attributes["zml.policy"] = call.policy_name
        if call.accelerator is not None:
            attributes["zml.pinned_accelerator"] = call.accelerator
        if call.stream:
            attributes["gen_ai.request.stream"] = True
        span = self.tracer.start_span(
            f"chat {call.model}", kind=SpanKind.CLIENT, attributes=attributes
        )
        if span.is_recording():
            body = decode_body(call.body)
            span.set_attributes(request_attributes(body))
            if self._capture():
                messages = input_messages(body.get("messages"))
                span.set_attribute("gen_ai.input.messages",
                                   json.dumps(messages, ensure_ascii=False))
        call.state[_SPAN] = span
        if span.get_span_context().is_valid:
            from opentelemetry import trace

            call.state[_CONTEXT] = trace.set_span_in_context(span)

    @hookimpl
    def zml_request_routed(self, call: Call, routing: RoutingInfo) -> None:
        """Record the decision: the node, its family and load, and each family evaluated."""
        span: Span | None = call.state.get(_SPAN)
        if span is None:
            return
        call.state[_ROUTED] = routing  # where a request cancelled from now on is counted
        if not span.is_recording():
            return
        host, port = _split_address(routing.server_address)
        span.set_attributes(
            {
                "zml.accelerator": routing.accelerator,
                "zml.node_id": routing.node_id,
                "zml.queue_depth": routing.queue_depth,
                "zml.node_load": routing.node_load,
                "zml.predicted_ttft_ms": routing.predicted_ttft_ms,
                "server.address": host,
            }
        )
        if port is not None:
            span.set_attribute("server.port", port)
        _family_events(span, routing.evaluated)

    @hookimpl
    def zml_request_headers(self, call: Call, headers: dict[str, str]) -> None:
        """Put the request span's trace context in ``headers`` (the configured propagator's
        fields: ``traceparent`` and ``tracestate`` by default), so the node's spans join the
        trace. Nothing outside a traced request."""
        context = call.state.get(_CONTEXT)
        if context is None:
            return
        from opentelemetry import propagate

        propagate.inject(headers, context=context)

    @hookimpl
    def zml_attempt_failed(self, call: Call, attempt: Attempt, error: NodeError) -> None:
        """Add a ``zml.attempt.failed`` event."""
        call.state.pop(_ROUTED, None)  # that node no longer has the request
        span: Span | None = call.state.get(_SPAN)
        if span is None or not span.is_recording():
            return
        attributes: dict[str, Any] = {
            "zml.attempt": len(call.attempts),
            "zml.node_id": attempt.node_id,
            "zml.accelerator": attempt.accelerator,
            "error.type": attempt.error,
        }
        if attempt.status_code is not None:
            attributes["http.response.status_code"] = attempt.status_code
        span.add_event("zml.attempt.failed", attributes)

    @hookimpl
    def zml_request_completed(
        self,
        call: Call,
        routing: RoutingInfo,
        usage: Mapping[str, Any] | None,
        cost: Cost | None,
    ) -> None:
        """Finish the span with usage and cost; record duration and token histograms."""
        span: Span | None = call.state.pop(_SPAN, None)
        call.state.pop(_CONTEXT, None)
        if span is None:
            return
        input_tokens, output_tokens = _tokens(usage)
        host, port = _split_address(routing.server_address)
        ttfc = call.first_chunk_s if call.stream else None
        node_ttft = call.ttft_s if call.stream else None  # a whole answer shows no first token
        if span.is_recording():
            response = call.response
            attributes: dict[str, Any] = {
                "gen_ai.response.model": _response_model(call),
                "zml.attempts": call.sent,
            }
            if response is not None and response.id:
                attributes["gen_ai.response.id"] = response.id
            if response is not None and (response.finish_reasons or response.finish_reason):
                attributes["gen_ai.response.finish_reasons"] = \
                    response.finish_reasons or (response.finish_reason,)
            if input_tokens is not None:
                attributes["gen_ai.usage.input_tokens"] = input_tokens
            if output_tokens is not None:
                attributes["gen_ai.usage.output_tokens"] = output_tokens
            if ttfc is not None:
                attributes["gen_ai.response.time_to_first_chunk"] = max(0.0, ttfc)
            if node_ttft is not None:
                attributes["zml.ttft_s"] = max(0.0, node_ttft)
            if cost is not None:
                attributes["zml.cost.amount"] = cost.amount
                attributes["zml.cost.currency"] = cost.currency
                attributes["zml.cost.basis"] = cost.basis
            span.set_attributes(attributes)
        span.end()
        metric_attrs = self._metric_attributes(call, host, port, routing.accelerator)
        metric_attrs["gen_ai.response.model"] = _response_model(call)
        duration, tokens = self._histograms()
        duration.record(max(0.0, call.elapsed_s), metric_attrs)
        if ttfc is not None:
            self._time_to_first_chunk().record(max(0.0, ttfc), metric_attrs)
        if input_tokens is not None:
            tokens.record(input_tokens, {**metric_attrs, "gen_ai.token.type": "input"})
        if output_tokens is not None:
            tokens.record(output_tokens, {**metric_attrs, "gen_ai.token.type": "output"})

    @hookimpl
    def zml_request_failed(self, call: Call, error: ZMLError) -> None:
        """Finish the span with status ERROR and ``error.type``; record the duration."""
        span: Span | None = call.state.pop(_SPAN, None)
        call.state.pop(_CONTEXT, None)
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        error_type = type(error).__name__
        if span.is_recording():
            span.set_attribute("error.type", error_type)
            span.set_attribute("zml.attempts", call.sent)
            context = getattr(error, "routing_context", None)
            if isinstance(context, Mapping):
                final = context.get("final_error")
                if final:
                    span.set_attribute("zml.final_error", str(final))
                if not call.attempts:
                    # no decision was made, so no routed event listed the families
                    _family_events(span, context.get("evaluated") or ())
            span.record_exception(error)
            span.set_status(Status(StatusCode.ERROR, _first_line(error)))
        span.end()
        self._record_unanswered(call, getattr(error, "routing", None), error_type)

    @hookimpl
    def zml_request_cancelled(self, call: Call) -> None:
        """Finish the span, marked ``zml.cancelled`` (no error status: the caller chose);
        record the duration with ``error.type`` = ``cancelled``, under the node that had
        the request (none if it had not reached one)."""
        span: Span | None = call.state.pop(_SPAN, None)
        call.state.pop(_CONTEXT, None)
        routing: RoutingInfo | None = call.state.pop(_ROUTED, None)
        if span is None:
            return
        if span.is_recording():
            span.set_attribute("zml.cancelled", True)
        span.end()
        self._record_unanswered(call, routing, _CANCELLED)

    def _record_unanswered(self, call: Call, routing: RoutingInfo | None,
                           error_type: str) -> None:
        """Record the duration of a request that ended without an answer, with
        ``error.type`` and the node that had it (if it reached one)."""
        host = accelerator = None
        port: int | None = None
        if routing is not None:
            host, port = _split_address(routing.server_address)
            accelerator = routing.accelerator
        metric_attrs = self._metric_attributes(call, host, port, accelerator)
        metric_attrs["error.type"] = error_type
        duration, _ = self._histograms()
        duration.record(max(0.0, call.elapsed_s), metric_attrs)

    @staticmethod
    def _metric_attributes(
        call: Call, host: str | None, port: int | None, accelerator: str | None
    ) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": call.model,
        }
        if host:
            attrs["server.address"] = host
            if port is not None:
                attrs["server.port"] = port
        if accelerator:
            attrs["zml.accelerator"] = accelerator
        if call.policy_name is not None:
            attrs["zml.policy"] = call.policy_name
        return attrs


def _family_events(span: Span, evaluated: Any) -> None:
    for entry in evaluated:
        if not isinstance(entry, Mapping):
            continue
        attributes: dict[str, Any] = {
            "zml.family": str(entry.get("family")),
            "zml.nodes_checked": int(entry.get("nodes_checked") or 0),
        }
        reason = entry.get("rejected_reason")
        if reason is not None:
            attributes["zml.rejected_reason"] = str(reason)
        span.add_event("zml.route.family", attributes)


def _split_address(address: str) -> tuple[str, int | None]:
    """``host:port`` (or ``[v6]:port``) as (host, port); see :attr:`RoutingInfo.server_address`
    for the port of a URL that names none."""
    address = address.split("/", 1)[0]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or (host.startswith("[") != host.endswith("]")):
        return address, None
    return host.strip("[]"), int(port)


def _tokens(usage: Mapping[str, Any] | None) -> tuple[int | None, int | None]:
    if not usage:
        return None, None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    return (
        prompt if type(prompt) is int and prompt >= 0 else None,
        completion if type(completion) is int and completion >= 0 else None,
    )


def _first_line(error: BaseException) -> str:
    text = getattr(error, "message", None) or str(error)
    return str(text).splitlines()[0][:300] if text else type(error).__name__


plugin: OpenTelemetryPlugin = OpenTelemetryPlugin()
"""The instance zml registers (global providers)."""


def _response_model(call: Call) -> str:
    """The model the node says answered (it may differ from the requested name)."""
    response = call.response
    return response.model if response is not None and response.model else call.model
