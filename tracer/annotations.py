"""Values attached to a stored trajectory after its rollout (``tracer.annotate``): the record
every backend receives, and the span it becomes.

An annotation is stored as one extra span of the trajectory's trace, kind ``annotation``, child
of the root span, with the root's start time and no duration (the trace's duration is
unchanged). Its id is derived from the trace id and the names of the values it carries, so
annotating again with the same names replaces it (idempotent). Attributes:

- ``rollout_tracer.values.<name>``: a per-token array, ``tracer.tokens`` encoding (``f32:``
  base64), aligned with the trajectory's model tokens (the generate spans' response tokens, in
  order); or a per-trajectory number;
- the per-trajectory aggregates of :func:`tracer.tokens.summarize` (``mismatch_kl_mean``,
  ``mismatch_kl_max``, ``ref_kl_mean``, ``ref_kl_max``, ``logprob_min``, ``entropy_mean``,
  ...) where the backend could compute them (it needs the rollout log-probs the trace holds).

Backends that can also tag a trace (MLflow) set the aggregates and the per-trajectory numbers
as trace tags, so ``tags.mismatch_kl_max > '0.1'`` style filters work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tracer.ids import derived_span_id
from tracer.record import SpanRecord, TrajectoryRecord
from tracer.tokens import (
    ANNOTATION_KIND,
    LOGPROBS_ATTR,
    VALUE_ATTR_PREFIX,
    decode_floats,
    summarize,
)

RECORD_TYPE = "annotation"  # the ``record_type`` of an annotation line in a JSONL file


@dataclass
class AnnotationRecord:
    """What ``tracer.annotate`` hands every backend: encoded values for one trace.

    ``attempt`` None: the caller named no attempt and this process did not trace one, so
    ``trace_id`` is attempt 0's and a backend that can look traces up annotates the latest
    attempt it holds (``tracer.ids.attempt_trace_id``)."""

    trace_id: str
    step: Any
    sample_index: Any
    rollout_n: Any
    validate: bool
    created_ns: int
    # name -> "f32:<base64>" (per token, model tokens only) or a float (per trajectory)
    values: dict[str, Any] = field(default_factory=dict)
    attempt: int | None = None

    @property
    def span_id(self) -> str:
        return derived_span_id(self.trace_id, "annotation:" + ",".join(sorted(self.values)))

    @property
    def root_span_id(self) -> str:
        return derived_span_id(self.trace_id, "root")

    def to_dict(self) -> dict[str, Any]:
        return {"record_type": RECORD_TYPE, **vars(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AnnotationRecord:
        data = {k: v for k, v in data.items() if k not in ("record_type", "schema_version")}
        return cls(**data)

    def token_values(self) -> dict[str, list[float]]:
        out = {}
        for name, value in self.values.items():
            decoded = decode_floats(value) if isinstance(value, str) else None
            if decoded is not None:
                out[name] = decoded
        return out

    def scalars(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.values.items() if isinstance(v, (int, float))}


def rollout_logprobs(spans: list[SpanRecord]) -> list[float] | None:
    """The engine's log-probs over a trajectory's model tokens: its generate spans', in order."""
    out: list[float] = []
    found = False
    for span in sorted(spans, key=lambda s: s.start_ns):
        if span.kind != "generate":
            continue
        values = decode_floats(span.attributes.get(LOGPROBS_ATTR))
        if values is not None:
            out.extend(values)
            found = True
    return out if found else None


def token_values(spans: list[SpanRecord]) -> dict[str, list[float]]:
    """Every per-token value a trajectory holds: ``rollout_logprob`` from its generate spans,
    the rest from its annotation spans (a later annotation wins for the same name)."""
    values: dict[str, list[float]] = {}
    rollout = rollout_logprobs(spans)
    if rollout is not None:
        values["rollout_logprob"] = rollout
    for span in sorted(spans, key=lambda s: s.end_ns):
        if span.kind != ANNOTATION_KIND:
            continue
        for key, value in span.attributes.items():
            if key.startswith(VALUE_ATTR_PREFIX):
                decoded = decode_floats(value)
                if decoded is not None:
                    values[key[len(VALUE_ATTR_PREFIX):]] = decoded
    return values


def _round(value: float) -> float:
    return round(value, 6) if math.isfinite(value) else value


def annotation_span(
    ann: AnnotationRecord, root_span_id: str, start_ns: int, rollout: list[float] | None
) -> tuple[SpanRecord, dict[str, str]]:
    """The annotation as a span of its trace, and the trace tags it adds."""
    tokens = ann.token_values()
    scalars = ann.scalars()
    known = dict(tokens)
    if rollout is not None and "rollout_logprob" not in known:
        known["rollout_logprob"] = rollout
    summary = {k: _round(v) for k, v in summarize(known).items()}
    attrs: dict[str, Any] = {VALUE_ATTR_PREFIX + k: v for k, v in ann.values.items()}
    attrs.update(summary)
    attrs["annotated_ns"] = ann.created_ns
    span = SpanRecord(
        span_id=ann.span_id,
        parent_id=root_span_id,
        name="annotation",
        kind=ANNOTATION_KIND,
        start_ns=start_ns,
        end_ns=start_ns,
        # readable in a trace UI: names and sizes, the numbers, never the arrays
        inputs={"token_values": {k: len(v) for k, v in sorted(tokens.items())}},
        outputs={**scalars, **summary},
        attributes=attrs,
    )
    tags = {k: repr(float(v)) for k, v in {**scalars, **summary}.items()}
    return span, tags


def apply_to_record(record: TrajectoryRecord, ann: AnnotationRecord) -> dict[str, str]:
    """Add (or replace) the annotation's span in a record held in memory; returns its tags."""
    root = record.spans[0]
    span, tags = annotation_span(ann, root.span_id, root.start_ns,
                                 rollout_logprobs(record.spans))  # fmt: skip
    record.spans = [s for s in record.spans if s.span_id != span.span_id] + [span]
    return tags
