"""OTLP backend: trajectories as OpenTelemetry spans, POSTed over OTLP/HTTP to any collector.

One trace per trajectory (the trace id is the record's), one span per op. Attributes follow
MLflow's span attributes plus the semantic conventions named in ``config.otlp_conventions``
(default both): the OpenTelemetry GenAI ones (:mod:`tracer.backends.otel_spans`) and
OpenInference's (:mod:`tracer.backends.openinference`), so the same stream lands well in an
MLflow server (``/v1/traces`` with header ``x-mlflow-experiment-id``), Arize Phoenix
(``phoenix serve``, ``http://host:6006/v1/traces``), Langfuse or Jaeger.

Endpoint: ``config.otlp_endpoint`` (a base URL such as ``http://host:4318`` gets
``/v1/traces`` appended), else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else
``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``, else ``http://localhost:4318/v1/traces``.
Headers: ``OTEL_EXPORTER_OTLP_TRACES_HEADERS`` / ``OTEL_EXPORTER_OTLP_HEADERS``, overridden by
``config.otlp_headers``. Each POST (with the SDK exporter's own retries) is bounded by
``config.export_timeout_s``; a failed POST returns ``ExportResult.FAILURE`` and the pipeline
retries it ``export_max_retries`` times, then counts it as failed.

Annotations (``tracer.annotate``) are sent as one more span of the trajectory's trace (same
trace id, child of its root span, the span id derived from the trace id and the value names,
so sending it again is the same span): OTLP is write-only, so the backend cannot read the
stored trace. The span therefore carries the values and the aggregates of the values it holds
(``tracer.tokens.summarize``: ``ref_kl_*``, ``entropy_mean``, ...), not those that need the
rollout's log-probs (``mismatch_kl_*``: a reader derives them), is stamped with the time of
the annotation, and every annotation counts as applied (nothing can be skipped).

Spans are built as finished SDK ``ReadableSpan`` objects and handed straight to the SDK's
``OTLPSpanExporter``: no global ``TracerProvider`` is installed or touched.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from tracer.annotations import AnnotationRecord, annotation_span
from tracer.backends.base import Exporter, ExportResult, RecentIds
from tracer.backends.otel_spans import encode_otlp, to_readable_spans
from tracer.config import OTLP_CONVENTIONS as CONVENTIONS
from tracer.config import TraceConfig
from tracer.credentials import store_address
from tracer.record import SpanRecord, TrajectoryRecord

log = logging.getLogger("tracer")

TRACES_PATH = "/v1/traces"


def resolve_endpoint(config: TraceConfig) -> str | None:
    """The configured endpoint with ``/v1/traces`` added to a bare base URL; None lets the OTel
    SDK read the standard environment variables."""
    endpoint = config.otlp_endpoint
    if not endpoint:
        return None
    parts = urlsplit(endpoint)
    if not parts.scheme or not parts.netloc:
        raise ValueError(
            f"otlp_endpoint must be an http(s) URL such as http://127.0.0.1:4318/v1/traces, "
            f"got {endpoint!r}"
        )
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + TRACES_PATH
    return endpoint


def to_otel_spans(
    record: TrajectoryRecord,
    resource: Any = None,
    conventions: Sequence[str] = CONVENTIONS,
) -> list[Any]:
    """The OTel ``ReadableSpan`` objects the OTLP backend sends for one trajectory."""
    return to_readable_spans(record, conventions=conventions, encode=encode_otlp, resource=resource)


def annotation_otel_spans(
    ann: AnnotationRecord, config: TraceConfig, resource: Any = None
) -> list[Any]:
    """The OTel span an annotation becomes: a child of its trajectory's root span."""
    at = ann.created_ns
    root = SpanRecord(span_id=ann.root_span_id, parent_id=None, name="trajectory",
                      kind="trajectory", start_ns=at, end_ns=at)  # fmt: skip
    span, _tags = annotation_span(ann, root.span_id, at, None)
    holder = TrajectoryRecord(
        trace_id=ann.trace_id, name="annotation", project_name=config.project_name,
        experiment_name=config.experiment_name, step=ann.step, sample_index=ann.sample_index,
        rollout_n=ann.rollout_n, validate=ann.validate, worker_id=config.worker_id,
        start_ns=at, end_ns=at, spans=[root, span],
    )  # fmt: skip
    # the root (first) is only the parent's identity: the stored root stays as it is
    return to_readable_spans(holder, conventions=CONVENTIONS, encode=encode_otlp,
                             resource=resource)[1:]  # fmt: skip


class OtlpExporter(Exporter):
    name = "otlp"
    supports_annotations = True
    deduplicates = False  # a collector appends what it gets: a batch sent twice is stored twice

    def __init__(self, config: TraceConfig, span_exporter: Any = None) -> None:
        """``span_exporter``: any OTel SDK ``SpanExporter`` (default: OTLP/HTTP). Tests pass an
        ``InMemorySpanExporter`` to see exactly the spans that would be sent."""
        from opentelemetry.sdk.resources import Resource

        self.config = config
        resource = {
            "service.name": config.project_name,
            "rollout_tracer.experiment_name": config.experiment_name,
            "rollout_tracer.worker_id": config.worker_id,
        }
        if "openinference" in config.otlp_conventions:  # Phoenix files traces by this project
            resource["openinference.project.name"] = config.project_name
        self.resource = Resource.create(resource)
        if span_exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            span_exporter = OTLPSpanExporter(
                endpoint=resolve_endpoint(config),
                headers=dict(config.otlp_headers) or None,
                timeout=config.export_timeout_s,
            )
        self.span_exporter = span_exporter
        self.endpoint = str(getattr(span_exporter, "_endpoint", type(span_exporter).__name__))
        # where the spans go (names this backend's spool folder): endpoint + routing headers
        routing = sorted(k for k in config.otlp_headers if "auth" not in k.lower())
        self.destination = self.endpoint + "".join(
            f"|{k}={config.otlp_headers[k]}" for k in routing
        )
        self._lock = threading.Lock()
        self._exported: RecentIds[None] = RecentIds()
        self._failures = 0

    def export(self, batch: Sequence[TrajectoryRecord], *, replay: bool = False) -> ExportResult:
        from opentelemetry.sdk.trace.export import SpanExportResult

        with self._lock:
            todo = [r for r in batch if r.trace_id not in self._exported]
        if not todo:
            return ExportResult.SUCCESS
        conventions = self.config.otlp_conventions
        spans = [s for r in todo for s in to_otel_spans(r, self.resource, conventions)]
        result = self.span_exporter.export(spans)
        if result is not SpanExportResult.SUCCESS:
            self._failures += 1
            if self._failures in (1, 10, 100) or self._failures % 1000 == 0:
                log.warning(
                    "rollout-tracer: OTLP export of %d spans to %s failed [%d times]",
                    len(spans),
                    store_address(self.endpoint),
                    self._failures,
                )
            return ExportResult.FAILURE
        with self._lock:
            for r in todo:
                self._exported.add(r.trace_id, None)
        return ExportResult.SUCCESS

    def annotate(self, batch: Sequence[AnnotationRecord]) -> list[bool]:
        """Send each annotation as a span of its trace; a failed POST raises (the annotator
        retries, then counts the batch as failed)."""
        from opentelemetry.sdk.trace.export import SpanExportResult

        spans = [s for ann in batch for s in annotation_otel_spans(ann, self.config,
                                                                    self.resource)]  # fmt: skip
        if spans and self.span_exporter.export(spans) is not SpanExportResult.SUCCESS:
            raise ConnectionError(f"OTLP export of {len(spans)} annotation spans to "
                                  f"{store_address(self.endpoint)} failed")  # fmt: skip
        return [True] * len(batch)

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return bool(self.span_exporter.force_flush(int(timeout_s * 1000)))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self.span_exporter.shutdown()
