"""MLflow backend: one MLflow trace per trajectory, written in batches off the hot path.

Spans are built as finished OpenTelemetry spans and written with MLflow's TracingClient
``log_spans`` (one DB transaction per batch for a sqlite store; OTLP/HTTP for a tracking
server). This bypasses MLflow's own async trace queue, which drops traces when it fills.
Trace tags come from ``mlflow.traceTag.<key>`` attributes on the root span (read by MLflow's
store), the reward is an MLflow feedback assessment named ``reward``. Re-exporting a
trajectory is idempotent: spans are upserted by (trace id, span id) and the reward is only
logged for traces that do not have one yet.

Uses ``TracingClient`` and ``Span(ReadableSpan)``, semi-internal MLflow APIs: the version is
pinned in pyproject.toml and tests exercise them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

from tracer.backends.base import ExportResult
from tracer.config import TraceConfig
from tracer.record import KINDS, SpanRecord, TrajectoryRecord

log = logging.getLogger("tracer")

REWARD_ASSESSMENT = "reward"


def resolve_tracking_uri(config: TraceConfig) -> str:
    """config.tracking_uri, else MLFLOW_TRACKING_URI, else MLflow's default ./mlflow.db."""
    if config.tracking_uri:
        return config.tracking_uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{os.path.abspath('mlflow.db')}"


class MlflowExporter:
    name = "mlflow"

    def __init__(self, config: TraceConfig) -> None:
        import mlflow  # noqa: F401  (ImportError -> "pip install rollout-tracer[mlflow]")
        from mlflow.tracking import MlflowClient

        self.config = config
        self.tracking_uri = resolve_tracking_uri(config)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.experiment_id = self._experiment_id(config.project_name)
        from mlflow.tracing.client import TracingClient

        self.tracing = TracingClient(self.tracking_uri)

    def _experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return str(exp.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except Exception:  # created concurrently by another worker
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return str(exp.experiment_id)

    def export(self, batch: Sequence[TrajectoryRecord]) -> ExportResult:
        spans = [s for record in batch for s in to_mlflow_spans(record)]
        self.tracing.log_spans(self.experiment_id, spans)
        self._log_rewards(batch)
        return ExportResult.SUCCESS

    def _log_rewards(self, batch: Sequence[TrajectoryRecord]) -> None:
        from mlflow.entities import AssessmentSource, Feedback

        for record in batch:
            if record.reward is None:
                continue
            trace_id = mlflow_trace_id(record.trace_id)
            try:
                existing = self.tracing.get_trace_info(trace_id).assessments
            except Exception:
                existing = []
            if any(a.name == REWARD_ASSESSMENT for a in existing or []):
                continue  # a replayed batch: already there
            self.tracing.log_assessment(
                trace_id,
                Feedback(
                    name=REWARD_ASSESSMENT,
                    value=float(record.reward),
                    source=AssessmentSource(source_type="CODE", source_id="rollout-tracer"),
                ),
            )

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        return None


def mlflow_trace_id(trace_id: str) -> str:
    return f"tr-{trace_id}"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def to_mlflow_spans(record: TrajectoryRecord) -> list[Any]:
    """Finished MLflow ``Span`` objects for one trajectory (root first)."""
    from mlflow.entities import Span
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

    trace_int = int(record.trace_id, 16)
    request_id = _dumps(mlflow_trace_id(record.trace_id))
    resource = Resource.get_empty()
    out = []
    for i, span in enumerate(record.spans):
        attrs: dict[str, Any] = {
            "mlflow.traceRequestId": request_id,
            "mlflow.spanType": _dumps(KINDS.get(span.kind, "UNKNOWN")),
            "mlflow.spanInputs": _dumps(_inputs(record, span) if i == 0 else span.inputs),
            "mlflow.spanOutputs": _dumps(_outputs(record, span) if i == 0 else span.outputs),
            "rollout_tracer.kind": _dumps(span.kind),
        }
        for key, value in span.attributes.items():
            attrs[key] = _dumps(value)
        if i == 0:
            for key, value in record.tags().items():
                attrs[f"mlflow.traceTag.{key}"] = _dumps(value)
            if record.reward is not None:
                attrs["mlflow.traceTag.reward"] = _dumps(repr(float(record.reward)))
                attrs["reward"] = _dumps(record.reward)
            attrs["mlflow.traceTag.mlflow.traceName"] = _dumps(record.name)
        events = []
        if span.error is not None:
            events.append(
                Event(
                    "exception",
                    {
                        "exception.type": span.error.get("type", ""),
                        "exception.message": span.error.get("message", ""),
                        "exception.stacktrace": span.error.get("traceback", ""),
                    },
                    timestamp=span.end_ns,
                )
            )
        ctx = SpanContext(
            trace_int,
            int(span.span_id, 16),
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )
        parent = (
            SpanContext(trace_int, int(span.parent_id, 16), is_remote=False)
            if span.parent_id
            else None
        )
        status = (
            Status(StatusCode.ERROR, (span.error or {}).get("message", ""))
            if span.status == "ERROR"
            else Status(StatusCode.OK)
        )
        otel = ReadableSpan(
            name=span.name,
            context=ctx,
            parent=parent,
            resource=resource,
            attributes=attrs,
            events=events,
            start_time=span.start_ns,
            end_time=span.end_ns,
            status=status,
        )
        out.append(Span(otel))
    return out


def _inputs(record: TrajectoryRecord, root: SpanRecord) -> Any:
    return {
        "step": record.step,
        "sample_index": record.sample_index,
        "rollout_n": record.rollout_n,
        "validate": record.validate,
        **({"attributes": record.attributes} if record.attributes else {}),
    }


def _outputs(record: TrajectoryRecord, root: SpanRecord) -> Any:
    return {"reward": record.reward, "num_spans": len(record.spans), "status": record.status}
