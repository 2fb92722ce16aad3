"""The rows MLflow's SQL store holds for one trace, built from a trajectory record.

What MLflow 3.18's ``SqlAlchemyStore._log_spans_once`` and ``create_assessment`` compute for a
trace they create, through MLflow's own helpers (``parts``: see ``mlflow_bulk._MLFLOW_NAMES``):
the ``trace_info`` row, its tags and request metadata, one ``spans`` row per span (the content
JSON with MLflow's attribute translation applied) and the reward's ``assessments`` row. No I/O:
:mod:`tracer.backends.mlflow_bulk` writes the rows.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from tracer.backends.mlflow_bulk_attrs import ContentText, stored_attributes
from tracer.backends.mlflow_bulk_span import SpanDict, b64, id_forms, span_dict, span_type
from tracer.backends.otel_spans import encode_all_json, span_attributes
from tracer.json_text import encode_function
from tracer.record import TrajectoryRecord

REQUEST_ID_KEY = "mlflow.traceRequestId"
TAG_MEMO = 4096  # trace tags whose stored form is kept (RowBuilder._tag)
_COST_KEYS = ("input_cost", "output_cost", "total_cost")  # the span columns, in order


@dataclass
class TraceRows:
    """The rows of one trace, built before the transaction opens."""

    trace_id: str
    info: dict[str, Any]
    tags: list[dict[str, Any]]
    spans: list[dict[str, Any]]
    metadata: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None


class RowBuilder:
    """Builds the rows of traces for one MLflow experiment (pure: no database)."""

    def __init__(
        self,
        parts: SimpleNamespace,
        experiment_id: int,
        artifact_location: str,
        *,
        trace_id_of: Callable[[str], str],
        reward_name: str,
    ) -> None:
        self.m = parts
        self.experiment_id = experiment_id
        self.artifact_location = artifact_location
        self.trace_id_of = trace_id_of
        self.reward_name = reward_name
        # json.dumps(cls=...) builds an encoder per call; this one keeps no state between calls
        self._encode = encode_function(parts.TraceJSONEncoder(ensure_ascii=False))
        self._plain_content = ContentText(self._encode)
        self._tag_memo: dict[tuple[str, Any], tuple[str, str] | None] = {}
        self._location_parts: tuple[str, str] | tuple[()] | None = None

    def _content(self, translated: dict[str, Any]) -> str:
        """The span's content JSON, byte for byte what MLflow's ``_log_spans_once`` writes
        (its encoder, its separators): MLflow's span-attribute filters (``span.attributes.x
        RLIKE ...``) match ``"key": "value"`` in this text, with the space."""
        return self._encode(translated)

    def _model_dimension(self, value: Any) -> str | None:
        """A span's model or provider column, as ``_log_spans_once`` makes it of the
        attribute (asked only of a span that has one: most spans have none, and MLflow's
        parse would raise and catch an exception for each)."""
        m = self.m
        return m.bounded_model_dimension(m._try_parse_json_string(value))  # type: ignore[no-any-return]

    def reward_row(self, t: TraceRows, now_ms: int) -> dict[str, Any]:
        """What ``SqlAssessments.from_mlflow_entity`` makes of the reward ``Feedback``."""
        value = float(t.reward)  # type: ignore[arg-type]
        aggregate, numeric = self.m.assessment_aggregate(value)
        digest = hashlib.blake2b(
            f"{t.trace_id}\0{self.reward_name}".encode(), digest_size=16
        ).hexdigest()
        return {
            "assessment_id": f"a-{digest}",  # the shape of MLflow's ids: a-<32 hex>
            "trace_id": t.trace_id,
            "name": self.reward_name,
            "assessment_type": "feedback",
            "value": json.dumps(value),
            "error": None,
            "created_timestamp": now_ms,
            "last_updated_timestamp": now_ms,
            "experiment_id": self.experiment_id,
            "trace_timestamp_ms": t.info["timestamp_ms"],
            "aggregate_value": aggregate,
            "is_numeric_value": numeric,
            "source_type": "CODE",
            "source_id": "rollout-tracer",
            "run_id": None,
            "span_id": None,
            "rationale": None,
            "overrides": None,
            "valid": True,
            "assessment_metadata": None,
        }

    def trace(self, record: TrajectoryRecord) -> TraceRows:
        """One trace's rows, as ``_log_spans_once`` computes them for a trace it creates."""
        m = self.m
        keys = m.SpanAttributeKey
        # the keys read of every span, looked up once a trace
        usage_key, cost_key, model_key, provider_key, type_key = (
            keys.CHAT_USAGE, keys.LLM_COST, keys.MODEL, keys.MODEL_PROVIDER, keys.SPAN_TYPE)
        experiment_id, dimension = self.experiment_id, self._model_dimension
        trace_id = self.trace_id_of(record.trace_id)
        trace_b64 = b64(int(record.trace_id, 16), 16)
        spans: list[dict[str, Any]] = []
        # (span id, parent id, stored attributes) per span: MLflow's usage and cost nodes are
        # built only when a span holds usage or cost (with none, the totals are empty anyway)
        tree: list[tuple[str, str | None, dict[str, Any]]] = []
        has_usage = has_cost = False
        root: dict[str, Any] | None = None
        root_status: str | None = None
        session_id = user_id = None
        forms: dict[str, tuple[str, str]] = {}  # a span's id forms, again as its children's parent
        for i, span in enumerate(record.spans):
            plain = {REQUEST_ID_KEY: trace_id, **span_attributes(record, span, i == 0)}
            span_id, span_b64 = forms[span.span_id] = id_forms(span.span_id)
            parent_id, parent_b64 = (
                (forms.get(span.parent_id) or id_forms(span.parent_id))
                if span.parent_id else (None, None)
            )  # fmt: skip
            status = "ERROR" if span.status == "ERROR" else "OK"
            pieces: list[str] = []
            attrs = stored_attributes(plain, pieces)
            if attrs is None:  # attributes MLflow's translators read: they decide
                attrs = {k: encode_all_json(k, v) for k, v in plain.items()}
                translated = m.translate_span_when_storing(
                    SpanDict(
                        span_dict(span, trace_b64, span_b64, parent_b64, status, attrs)
                    )
                )
                content = self._content(translated)
                a = translated.get("attributes", {})
            else:
                content = self._plain_content.of_span(span, trace_b64, span_b64, parent_b64,
                                                      status, attrs, pieces)  # fmt: skip
                a = attrs
            tree.append((span_id, parent_id, a))
            has_usage = has_usage or usage_key in a
            has_cost = has_cost or cost_key in a
            if session_id is None and (
                sid := a.get(keys.SESSION_ID) or a.get(m.GenAiSemconvKey.CONVERSATION_ID)
            ):
                session_id = m.validate_session_id(m._try_parse_json_string(sid))
            if user_id is None and (uid := a.get("user.id")):
                user_id = m._try_parse_json_string(uid)
            costs: list[float | None] = [None, None, None]  # the span has none: most spans
            if raw_cost := a.get(cost_key):
                try:
                    cost = json.loads(raw_cost)
                except (TypeError, ValueError):
                    cost = {}
                costs = [m.finite_float_or_none(cost.get(key)) for key in _COST_KEYS]
            type_value = plain.get(type_key)
            model, provider = a.get(model_key), a.get(provider_key)
            spans.append(
                {
                    "trace_id": trace_id,
                    "experiment_id": experiment_id,
                    "span_id": span_id,
                    "parent_span_id": parent_id,
                    "name": span.name,
                    "type": span_type(type_value),
                    "status": status,
                    "start_time_unix_nano": span.start_ns,
                    "end_time_unix_nano": span.end_ns,
                    "content": content,
                    "input_cost": costs[0],
                    "output_cost": costs[1],
                    "total_cost": costs[2],
                    "model_name": None if model is None else dimension(model),
                    "model_provider": None if provider is None else dimension(provider),
                }
            )
            if parent_id is None and root is None:
                root, root_status = a, ("ERROR" if status == "ERROR" else "OK")
        info = self._info(trace_id, record, spans, root, root_status)
        if session_id:
            info["session_id"] = session_id
        for present, attribute, aggregate, columns, convert in (
            (
                has_usage,
                keys.CHAT_USAGE,
                m.aggregate_usage_from_span_nodes,
                m.TOKEN_COLUMN_BY_KEY,
                m.token_count_or_none,
            ),
            (
                has_cost,
                keys.LLM_COST,
                m.aggregate_cost_from_span_nodes,
                m.COST_COLUMN_BY_KEY,
                m.finite_float_or_none,
            ),
        ):
            if not present:
                continue
            nodes = [m._span_aggregation_node(sid, pid, a, attribute) for sid, pid, a in tree]
            totals = aggregate(nodes) or {}
            for key, column in columns.items():
                if (value := convert(totals.get(key))) is not None:
                    info[column] = value
        tags = self._tags(trace_id, root, info)
        metadata = (
            [{"request_id": trace_id, "key": m.TraceMetadataKey.TRACE_USER, "value": user_id}]
            if user_id
            else []
        )
        return TraceRows(trace_id, info, tags, spans, metadata, record.reward)

    def _info(
        self,
        trace_id: str,
        record: TrajectoryRecord,
        spans: list[dict[str, Any]],
        root: dict[str, Any] | None,
        root_status: str | None,
    ) -> dict[str, Any]:
        m = self.m
        start_ms = min(s["start_time_unix_nano"] for s in spans) // 1_000_000
        ends = [s["end_time_unix_nano"] for s in spans if s["end_time_unix_nano"] is not None]
        end_ms = max(ends) // 1_000_000 if ends else None
        info: dict[str, Any] = {
            "request_id": trace_id,
            "experiment_id": self.experiment_id,
            "timestamp_ms": start_ms,
            "execution_time_ms": (end_ms - start_ms) if end_ms else None,
            "status": root_status or "IN_PROGRESS",
            "client_request_id": None,
            "request_preview": None,
            "response_preview": None,
            "db_payload_generation": 1,  # log_spans bumps it once for a trace it creates
            "trace_name": None,
            "session_id": None,
        }
        # Every row has every column: a multi-row insert needs the same keys in each row.
        for column in (*m.TOKEN_COLUMN_BY_KEY.values(), *m.COST_COLUMN_BY_KEY.values()):
            info[column] = None
        if root is not None:
            for column, key, role in (
                ("request_preview", m.SpanAttributeKey.INPUTS, "user"),
                ("response_preview", m.SpanAttributeKey.OUTPUTS, "assistant"),
            ):
                value = root.get(key)
                with contextlib.suppress(Exception):  # MLflow skips a preview it cannot build
                    info[column] = m._get_truncated_preview(value, role=role) if value else None
        return info

    def _tags(
        self, trace_id: str, root: dict[str, Any] | None, info: dict[str, Any]
    ) -> list[dict[str, Any]]:
        m = self.m
        tags = {
            m.MLFLOW_ARTIFACT_LOCATION: self._location(trace_id),
            m.TraceTagKey.SPANS_LOCATION: m.SpansLocation.TRACKING_STORE.value,
        }
        prefix = m.SpanAttributeKey.TRACE_TAG_PREFIX
        for attr_key, attr_value in (root or {}).items():
            if not attr_key.startswith(prefix):
                continue
            tag = self._tag(attr_key[len(prefix) :], attr_value)
            if tag is None:  # MLflow skips an invalid tag, too
                continue
            key, value = tag
            if key == m.TraceTagKey.TRACE_NAME:
                info["trace_name"] = m.validate_trace_name(value)
            else:
                tags[key] = value
        return [{"request_id": trace_id, "key": k, "value": v} for k, v in tags.items()]

    def _tag(self, key: str, attr_value: Any) -> tuple[str, str] | None:
        """The (key, value) MLflow stores of one ``mlflow.traceTag.<key>`` attribute (its
        JSON string parsed, validated, the value truncated), None when MLflow skips it. A
        trace's tags repeat from trace to trace (the worker, the step, the attempt, the end
        reason), and MLflow's validation of one is ~10 us, so the answers of these pure
        functions are kept, up to :data:`TAG_MEMO` of them (then forgotten all at once)."""
        memo_key = (key, attr_value)
        try:
            return self._tag_memo[memo_key]
        except KeyError:
            pass
        except TypeError:  # a value that cannot be a dict key: asked every time
            return self._validated_tag(key, attr_value)
        tag = self._validated_tag(key, attr_value)
        if len(self._tag_memo) >= TAG_MEMO:
            self._tag_memo.clear()
        self._tag_memo[memo_key] = tag
        return tag

    def _validated_tag(self, key: str, attr_value: Any) -> tuple[str, str] | None:
        m = self.m
        try:
            return m._validate_trace_tag(key, str(m._try_parse_json_string(attr_value)))  # type: ignore[no-any-return]
        except Exception:
            return None

    def _location(self, trace_id: str) -> str:
        """The trace's artifact location, as MLflow's ``append_to_uri_path`` makes it: the
        experiment's location, the traces folder, the id, the artifacts folder. Made once for
        a probe id; when the probe's location is that id between a fixed head and tail (a path
        or a URL), later ones are the head, the id and the tail, else asked of MLflow."""
        if self._location_parts is None:
            probe = "tr-" + "0" * 32
            head, found, tail = self._asked_location(probe).partition(probe)
            self._location_parts = (head, tail) if found and probe not in tail else ()
        if not self._location_parts or not _opaque(trace_id):
            return self._asked_location(trace_id)
        head, tail = self._location_parts
        return head + trace_id + tail

    def _asked_location(self, trace_id: str) -> str:
        m = self.m
        return m.append_to_uri_path(  # type: ignore[no-any-return]
            self.artifact_location,
            m.SqlAlchemyStore.TRACE_FOLDER_NAME,
            trace_id,
            m.SqlAlchemyStore.ARTIFACTS_FOLDER_NAME,
        )


def _opaque(segment: str) -> bool:
    """Whether ``segment`` is ASCII letters, digits and dashes: what no URI or path function
    changes (no slash, dot, percent, query or space)."""
    return segment.isascii() and segment.replace("-", "").isalnum()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
