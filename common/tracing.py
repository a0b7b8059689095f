"""OpenTelemetry traces, off unless an OTLP endpoint is configured.

With an endpoint (``--otlp-endpoint``/``RACER_OTLP_ENDPOINT``, or OpenTelemetry's own
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``/``OTEL_EXPORTER_OTLP_ENDPOINT``) a service process installs an
SDK tracer provider that batches spans to that collector over OTLP/gRPC, and its gRPC servers and
the gateway's channels get the maintained ``opentelemetry-instrumentation-grpc`` interceptors: the
trace context travels in gRPC metadata, so one turn is one trace across gateway, drafter and
verifier. Sampling is the SDK's, set by the standard ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG``
(default: every trace, or as the caller's trace was sampled).

Without one nothing is installed: the API's tracer is a no-op, no interceptor is added, and the SDK
and exporter are never imported.

Spans of one turn (``Generate`` on the gateway):

    /racer.v1.Generation/Generate                 gateway, server
      prefill                                     gateway: open the verifier and drafter streams
        /racer.v1.Verifier/Session (client)  ──▶  /racer.v1.Verifier/Session (server)
                                                    verifier.prefill (history_tokens, reused_tokens)
        /racer.v1.Drafter/Session (client)   ──▶  /racer.v1.Drafter/Session (server)
                                                    drafter.open (restored_from)
      rounds × ⌈rounds / ROUNDS_PER_SPAN⌉          rounds, drafted, accepted, emitted, draft_ms, verify_ms
      save                                        end the drafter's turn, save the session record

A turn not started by a traced RPC (the HTTP API) gets a ``turn`` span of its own in place of
``Generate``.

A round is one message on each open stream, not an RPC, so it has no gRPC span; rounds are
aggregated because a turn has hundreds of them: a span each would multiply the export volume while
the breakdown (draft vs verify time, acceptance) reads as well from their sums.

Cost with an endpoint (README, "Metrics, dashboard and traces"): the interceptors add about 0.1 ms
to each message round trip on a stream (two per round) and about 1 ms per stream opened.
"""

from __future__ import annotations

import os
import time

from opentelemetry import trace

ROUNDS_PER_SPAN = 16
UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.")  # probes and tools, not the pipeline


def endpoint(configured: str = "") -> str:
    """Where spans go: the racer setting, else OpenTelemetry's standard variables; empty: off."""
    return (
        configured
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
    )


def setup(service: str, configured_endpoint: str = "", exporter=None):
    """Installs the process's tracer provider for ``service`` and returns it, or returns None and
    installs nothing when there is no endpoint (and no ``exporter``: tests and benchmarks pass an
    in-memory or console one, exported span by span instead of in batches)."""
    url = endpoint(configured_endpoint)
    if exporter is None and not url:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"racer-{service}"}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # The racer setting names the collector; otherwise the exporter reads every OTEL_* variable
        # itself (endpoint, headers, TLS).
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=configured_endpoint or None)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return provider


def enabled() -> bool:
    """Whether this process installed a tracer provider (the API's default is a no-op proxy)."""
    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def _filter():
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.any_of(*(filters.service_prefix(s) for s in UNTRACED_SERVICES)))


def server_interceptors() -> list:
    """The gRPC aio server interceptor that continues the caller's trace, when tracing is on."""
    if not enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(filter_=_filter())]


def client_interceptors() -> list:
    """The gRPC aio channel interceptors that send the current trace along, when tracing is on."""
    if not enabled():
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return aio_client_interceptors(filter_=_filter())


class TurnSpans:
    """The phase spans of one turn, children of the span current when the turn starts (the
    ``Generate`` RPC's server span); a turn started outside a traced RPC (the OpenAI-compatible HTTP
    API) gets a ``turn`` span of its own as their parent, so it is one trace all the same.

    The parent is passed explicitly rather than made current, because a turn is an async generator
    whose consumer may resume it in another context. ``phase`` wraps an await with no yield inside;
    ``round`` groups ``every`` rounds into one ``rounds`` span: rounds, drafted, accepted and emitted
    tokens, time inside the drafter and the verifier (ms)."""

    def __init__(self, tracer: trace.Tracer, every: int = ROUNDS_PER_SPAN, **attributes):
        self.tracer = tracer
        self.every = every
        parent = trace.get_current_span()
        self.own = None
        if not parent.get_span_context().is_valid and enabled():
            self.own = parent = tracer.start_span("turn")
        self.on = parent.get_span_context().is_valid  # off: nothing to record
        if self.on:
            parent.set_attributes(attributes)
        self.context = trace.set_span_in_context(parent)
        self._reset()

    def phase(self, name: str, **attributes):
        """A span around one phase, current while it runs (the RPCs it makes are its children)."""
        return self.tracer.start_as_current_span(name, context=self.context, attributes=attributes)

    def _reset(self) -> None:
        self.start_ns = time.time_ns()
        self.rounds = self.drafted = self.accepted = self.emitted = 0
        self.draft_ms = self.verify_ms = 0.0

    def start_rounds(self) -> None:
        """The first round starts now (after the prefill)."""
        self._reset()

    def round(self, drafted: int, accepted: int, emitted: int, draft_ms: float, verify_ms: float) -> None:
        if not self.on:
            return
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.draft_ms += draft_ms
        self.verify_ms += verify_ms
        if self.rounds >= self.every:
            self._flush()

    def _flush(self) -> None:
        if self.rounds:
            attributes = {
                "racer.rounds": self.rounds,
                "racer.drafted_tokens": self.drafted,
                "racer.accepted_tokens": self.accepted,
                "racer.emitted_tokens": self.emitted,
                "racer.draft_ms": round(self.draft_ms, 3),
                "racer.verify_ms": round(self.verify_ms, 3),
            }
            self.tracer.start_span("rounds", self.context, start_time=self.start_ns, attributes=attributes).end()
        self._reset()

    def close_rounds(self) -> None:
        """Ends the open group of rounds (before the save)."""
        if self.on:
            self._flush()

    def close(self) -> None:
        """Ends the open group of rounds (a turn that failed midway), and the turn's own span."""
        self.close_rounds()
        if self.own is not None:
            self.own.end()
            self.own = None
