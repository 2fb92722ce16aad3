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

import logging
import os
from collections.abc import Sequence
from typing import Any

from tracer.backends.base import ExportResult
from tracer.backends.otel_spans import dumps, encode_all_json, to_readable_spans
from tracer.config import TraceConfig
from tracer.record import TrajectoryRecord

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


def to_mlflow_spans(record: TrajectoryRecord) -> list[Any]:
    """Finished MLflow ``Span`` objects for one trajectory (root first).

    Built by :func:`tracer.backends.otel_spans.to_readable_spans` (shared with the OTLP
    backend), every attribute value JSON-encoded as MLflow's in-process spans expect.
    """
    from mlflow.entities import Span

    request_id = dumps(mlflow_trace_id(record.trace_id))
    spans = to_readable_spans(
        record, encode=encode_all_json, extra_attributes={"mlflow.traceRequestId": request_id}
    )
    return [Span(otel) for otel in spans]
