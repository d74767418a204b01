"""Optional OpenTelemetry tracing of the HTTP front doors (``pip install 'mesh[tracing]'``).

``--trace-exporter console|otlp`` (``--trace-endpoint`` for OTLP/HTTP) turns it on in ``mesh
broker --http`` and ``mesh gateway``: one SERVER span per HTTP request, a child of the caller's
W3C ``traceparent`` when one is sent, carrying the request id (``x-request-id``), the model, the
worker that answered, the attempt, the routing reason, prompt and cached tokens, and a
``first_token`` event. Off (the default) every call here is a cheap no-op, and nothing imports
OpenTelemetry. Tests install an SDK provider with an in-memory exporter (:func:`use_provider`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Mapping

from mesh.errors import ConfigError

__all__ = ["EXPORTERS", "configure_tracing", "use_provider", "server_span", "client_span", "current_traceparent",
           "annotate", "set_attributes", "add_event", "enabled"]

EXPORTERS = ("none", "console", "otlp")
_tracer: Any = None  # an opentelemetry Tracer while tracing is on


def enabled() -> bool:
    return _tracer is not None


def configure_tracing(exporter: str, endpoint: str = "", service: str = "mesh") -> None:
    """Turn tracing on for this process (``exporter`` none: leave it off). ConfigError naming
    the field when the packages it needs are missing."""
    if exporter == "none":
        return
    if exporter not in EXPORTERS:
        raise ConfigError(f"trace_exporter: must be one of {', '.join(EXPORTERS)}")
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        raise ConfigError("trace_exporter: tracing needs the 'tracing' extra (pip install 'mesh[tracing]')") from None
    if exporter == "console":
        exp = ConsoleSpanExporter()
    else:
        if not endpoint:
            raise ConfigError("trace_endpoint: otlp needs the collector's URL, e.g. http://otel-collector:4318/v1/traces")
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ConfigError("trace_exporter: otlp needs opentelemetry-exporter-otlp-proto-http installed") from None
        exp = OTLPSpanExporter(endpoint=endpoint)
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(exp))
    use_provider(provider)


def use_provider(provider: Any) -> None:
    """Trace with ``provider`` (an SDK TracerProvider; None turns tracing off again)."""
    global _tracer
    _tracer = provider.get_tracer("mesh") if provider is not None else None


def server_span(name: str, headers: Mapping[str, str], attributes: dict[str, Any]):
    """A context manager: the SERVER span of one request (child of its ``traceparent``), or nothing."""
    if _tracer is None:
        return contextlib.nullcontext()
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    return _tracer.start_as_current_span(name, context=propagate.extract(dict(headers)), kind=SpanKind.SERVER,
                                         attributes={k: v for k, v in attributes.items() if v is not None})


def client_span(name: str, traceparent: str | None, attributes: dict[str, Any]):
    """A context manager: a CLIENT span continuing the trace ``traceparent`` names (the adapter's
    call to its engine), or nothing when tracing is off or there is no trace to continue."""
    if _tracer is None or traceparent is None:
        return contextlib.nullcontext()
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind

    return _tracer.start_as_current_span(name, context=propagate.extract({"traceparent": traceparent}),
                                         kind=SpanKind.CLIENT,
                                         attributes={k: v for k, v in attributes.items() if v is not None})


def current_traceparent() -> str | None:
    """The W3C ``traceparent`` of the current span (to carry it on), None when there is none."""
    if _tracer is None:
        return None
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


def annotate(**attributes: Any) -> None:
    """Set attributes on the current span (no-op when tracing is off)."""
    if _tracer is None:
        return
    from opentelemetry import trace

    trace.get_current_span().set_attributes({f"mesh.{k}": v for k, v in attributes.items() if v is not None})


def set_attributes(attributes: dict[str, Any]) -> None:
    """Set attributes under their own names (``http.response.status_code``) on the current span."""
    if _tracer is None:
        return
    from opentelemetry import trace

    trace.get_current_span().set_attributes({k: v for k, v in attributes.items() if v is not None})


def add_event(name: str, **attributes: Any) -> None:
    if _tracer is None:
        return
    from opentelemetry import trace

    trace.get_current_span().add_event(name, {k: v for k, v in attributes.items() if v is not None})
