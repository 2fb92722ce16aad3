"""What MLflow is given of a batch: the first record of each trace id, each as MLflow's UI
should show it.

:func:`mlflow_view`: the root carries its session, long per-token lists are shown compactly.
Both of the MLflow backend's paths (the bulk writer and MLflow's own ``log_spans``) store
this view.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tracer.record import SpanRecord, TrajectoryRecord
from tracer.token_lists import FULL_LISTS_ATTRIBUTE, compact_view


def first_of_each_id(batch: Sequence[TrajectoryRecord]) -> list[TrajectoryRecord]:
    """The batch without a second record of a trace id (the first one is what is stored)."""
    seen: set[str] = set()
    out = []
    for record in batch:
        if record.trace_id not in seen:
            seen.add(record.trace_id)
            out.append(record)
    return out


def session_id(record: TrajectoryRecord) -> str:
    """The MLflow session of a trajectory: its GRPO group (the ``rollout_n`` samples of one
    prompt at one step), so MLflow's Sessions view lists one row per group."""
    kind = "val" if record.validate else "step"
    name = record.experiment_name or record.project_name or "rollout"
    return f"{name}/{kind}-{record.step}/sample-{record.sample_index}"


def mlflow_view(record: TrajectoryRecord) -> TrajectoryRecord:
    """A copy of ``record`` for MLflow: the root carries the session (its GRPO group), and
    spans show long per-token lists compactly (MLflow's UI prints a list one value per line),
    the full lists moved to one attribute per span."""
    spans = []
    own_session = any("session.id" in span.attributes for span in record.spans)  # user's wins
    for i, span in enumerate(record.spans):
        attributes = span.attributes
        if i == 0 and not own_session:  # MLflow makes the root's `session.id` the session
            attributes = {**attributes, "session.id": session_id(record)}
        inputs, outputs, full_lists = compact_view(span.inputs, span.outputs)
        if full_lists is not None:
            attributes = {**attributes, FULL_LISTS_ATTRIBUTE: full_lists}
            span = _span_with(span, inputs, outputs, attributes)
        elif attributes is not span.attributes:
            span = _span_with(span, span.inputs, span.outputs, attributes)
        spans.append(span)
    return _record_with(record, spans)


# By position, not dataclasses.replace: a trace's 9 copies were 12 us of the export child's
# ~400 a trace (keywords and replace's field loop); the frozen rows' test sees a field missed.
def _span_with(s: SpanRecord, inputs: Any, outputs: Any, attributes: dict[str, Any]) -> SpanRecord:
    return SpanRecord(s.span_id, s.parent_id, s.name, s.kind, s.start_ns, s.end_ns, s.status,
                      s.error, inputs, outputs, attributes)  # fmt: skip


def _record_with(r: TrajectoryRecord, spans: list[SpanRecord]) -> TrajectoryRecord:
    return TrajectoryRecord(r.trace_id, r.name, r.project_name, r.experiment_name, r.step,
                            r.sample_index, r.rollout_n, r.validate, r.worker_id, r.start_ns,
                            r.end_ns, r.status, r.reward, r.policy_version, r.attempt,
                            r.attributes, spans, r.schema_version)  # fmt: skip
