"""Bulk writer for MLflow's SQL stores (sqlite, PostgreSQL): a whole batch in ONE transaction.

MLflow's own path costs one ``log_spans`` transaction per batch plus one transaction per reward
(``create_assessment``), and builds every span through OpenTelemetry and MLflow span objects.
This writer produces, per new trace, the rows that MLflow 3.17's ``SqlAlchemyStore`` writes
(``_log_spans_once`` + ``create_assessment``), through MLflow's own SQLAlchemy tables, with one
multi-row insert per table:

- ``trace_info``: timestamp and duration from the spans, state from the root span, request and
  response previews, trace name, session id and token usage / cost columns, payload generation 1;
- ``trace_tags``: the artifact location, ``mlflow.trace.spansLocation = TRACKING_STORE`` and the
  root span's ``mlflow.traceTag.<key>`` attributes;
- ``trace_request_metadata``: the user id, when a span carries ``user.id``;
- ``spans``: the content JSON MLflow stores (its own attribute translation applied), with the
  denormalized cost and model columns;
- ``assessments``: the reward as a ``CODE`` feedback, with its denormalized aggregate columns;
- the rollup rebuild queue, through MLflow's own function (a no-op unless rollups are enabled).
MLflow writes no size stats, schema version or trace/span metrics rows on this path either.

It stores what MLflow's own path stores (``MlflowExporter``) for a trace id sent again: the
first one stored wins. A trace whose ``trace_info`` row is already there gets no rows from a
later record with its id (no merged span sets, no second duration), only its reward when it
has none (looked up by name, so a reward logged by MLflow's own path with a random id counts);
within a batch the first record of an id is the one written. Every insert also skips rows
already there (``ON CONFLICT DO NOTHING``) and the reward's assessment id is derived from
(trace id, name), so two writers racing on one id still add each row once.

It relies on MLflow's schema and on a few of its internal helpers, whose behaviour can change
in a release that keeps the schema. So it runs only on the exact MLflow versions it was tested
with (``TESTED_VERSIONS``), each on the schema revision (``alembic_version``) that version
creates; one log line says which path an exporter takes and why. Anything else is written
through MLflow's own ``log_spans`` path. tests/test_mlflow_bulk.py runs both paths and compares
what MLflow's client reads back, and fails when the installed MLflow is not in
``TESTED_VERSIONS`` (a version bump means running those tests and adding the version here).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from tracer.backends.otel_spans import encode_all_json, span_attributes
from tracer.credentials import store_address
from tracer.record import TrajectoryRecord

log = logging.getLogger("tracer")

# The MLflow versions this writer was tested with (tests/test_mlflow_bulk.py), each with the
# alembic revision of the tracking schema it creates. Add a version only after those tests
# pass on it: the writer mirrors private helpers that a release may change without a migration.
TESTED_VERSIONS: dict[str, str] = {"3.17.2": "dc11669786a5"}
DIALECTS = ("sqlite", "postgresql")
REQUEST_ID_KEY = "mlflow.traceRequestId"


def open_bulk_writer(
    store: Any,
    tracking_uri: str,
    experiment_id: str,
    *,
    trace_id_of: Callable[[str], str],
    reward_name: str,
) -> BulkWriter | None:
    """A ``BulkWriter`` for ``store`` when it is a SQL store this writer was tested with, else
    None after one log line saying why (the caller then uses MLflow's ``log_spans`` path)."""
    db_type = getattr(store, "db_type", None)
    if db_type not in DIALECTS or not hasattr(store, "ManagedSessionMaker"):
        return None  # not a SQL store (a tracking server): nothing to say
    version = mlflow_version()
    tested_revision = TESTED_VERSIONS.get(version)
    revision = None
    if tested_revision is None:  # an untested MLflow: none of its internals is touched
        reason = (
            f"MLflow {version} is not a version it was tested with "
            f"({', '.join(sorted(TESTED_VERSIONS))})"
        )
    else:
        try:
            parts = _mlflow_parts()
            with store.ManagedSessionMaker() as session:
                from sqlalchemy import text

                query = text("SELECT version_num FROM alembic_version")
                revision = session.execute(query).scalar()
                experiment = store.get_experiment(experiment_id)
        except Exception as exc:  # internals that moved: MLflow's own path still works
            reason = f"cannot use it ({type(exc).__name__}: {exc})"
        else:
            reason = (
                ""
                if revision == tested_revision
                else f"the store's schema revision {revision!r} is not {tested_revision!r}, "
                f"the one MLflow {version} creates and the bulk writer was tested on"
            )
    where = store_address(tracking_uri)
    if reason:
        log.warning(
            "rollout-tracer: MLflow store %s: not using the bulk writer: %s; writing through "
            "MLflow's log_spans and log_assessment instead (correct, slower).",
            where,
            reason,
        )
        return None
    log.info(
        "rollout-tracer: MLflow store %s: bulk writer on (MLflow %s, schema revision %s: a "
        "version and revision it was tested with).",
        where,
        version,
        revision,
    )
    return BulkWriter(
        store,
        parts,
        int(experiment_id),
        str(experiment.artifact_location),
        trace_id_of=trace_id_of,
        reward_name=reward_name,
    )


def mlflow_version() -> str:
    """The installed MLflow's version, as the gate above sees it."""
    import mlflow

    return str(mlflow.__version__)


# Every MLflow name this writer uses (tables, and the helpers _log_spans_once and
# create_assessment use, so the rows come out the same), by module.
_MLFLOW_NAMES = {
    "mlflow.store.tracking.dbmodels.models": (
        "SqlAssessments",
        "SqlSpan",
        "SqlTraceInfo",
        "SqlTraceMetadata",
        "SqlTraceTag",
    ),
    "mlflow.store.tracking.sqlalchemy_store": (
        "SqlAlchemyStore",
        "_span_aggregation_node",
        "_try_parse_json_string",
    ),
    "mlflow.store.tracking.utils.sql_trace_rollups": (
        "RollupFamily",
        "enqueue_rollup_rebuild_partitions",
    ),
    "mlflow.store.tracking.utils.trace_analytics": (
        "COST_COLUMN_BY_KEY",
        "TOKEN_COLUMN_BY_KEY",
        "assessment_aggregate",
        "bounded_model_dimension",
        "finite_float_or_none",
        "token_count_or_none",
        "validate_session_id",
        "validate_trace_name",
    ),
    "mlflow.tracing.constant": (
        "GenAiSemconvKey",
        "SpanAttributeKey",
        "SpansLocation",
        "TraceMetadataKey",
        "TraceTagKey",
    ),
    "mlflow.tracing.otel.translation": ("translate_span_when_storing",),
    "mlflow.tracing.utils": (
        "TraceJSONEncoder",
        "aggregate_cost_from_span_nodes",
        "aggregate_usage_from_span_nodes",
    ),
    "mlflow.tracing.utils.truncation": ("_get_truncated_preview",),
    "mlflow.utils.mlflow_tags": ("MLFLOW_ARTIFACT_LOCATION",),
    "mlflow.utils.uri": ("append_to_uri_path",),
    "mlflow.utils.validation": ("_validate_trace_tag",),
}


def _mlflow_parts() -> SimpleNamespace:
    """The names in ``_MLFLOW_NAMES`` (an ImportError or AttributeError here means an MLflow
    this writer does not know: the caller falls back)."""
    parts = {}
    for module_name, names in _MLFLOW_NAMES.items():
        module = importlib.import_module(module_name)
        for name in names:
            parts[name] = getattr(module, name)
    return SimpleNamespace(**parts)


@dataclass
class _Trace:
    """The rows of one trace, built before the transaction opens."""

    trace_id: str
    info: dict[str, Any]
    tags: list[dict[str, Any]]
    spans: list[dict[str, Any]]
    metadata: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None


class _SpanDict:
    """What ``translate_span_when_storing`` reads of a span: ``to_dict()``."""

    __slots__ = ("d",)

    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d

    def to_dict(self) -> dict[str, Any]:
        return self.d


class BulkWriter:
    """Writes batches of trajectories into one MLflow experiment of a SQL store."""

    def __init__(
        self,
        store: Any,
        parts: SimpleNamespace,
        experiment_id: int,
        artifact_location: str,
        *,
        trace_id_of: Callable[[str], str],
        reward_name: str,
    ) -> None:
        self.store = store
        self.m = parts
        self.experiment_id = experiment_id
        self.artifact_location = artifact_location
        self.trace_id_of = trace_id_of
        self.reward_name = reward_name
        # Core inserts on MLflow's tables, with the dialect's ON CONFLICT DO NOTHING (every
        # insert is idempotent per primary key). Core, not the ORM: the ORM's bulk path spent
        # 3x the database's own time building one bind parameter per value. On PostgreSQL the
        # rows must go as multi-row VALUES pages (SQLAlchemy's "insertmanyvalues"; psycopg2's
        # executemany is one round trip per row), and SQLAlchemy 2.1 pages an ON CONFLICT
        # insert only when it has a RETURNING clause: hence the primary key's first column.
        # sqlite3's executemany is one C loop and needs neither.
        from sqlalchemy.dialects import postgresql, sqlite

        on_pg = store.db_type == "postgresql"
        self._inserts: dict[str, Any] = {}
        for name, model in (
            ("info", parts.SqlTraceInfo),
            ("tags", parts.SqlTraceTag),
            ("metadata", parts.SqlTraceMetadata),
            ("spans", parts.SqlSpan),
            ("assessments", parts.SqlAssessments),
        ):
            table = model.__table__
            stmt: Any  # a dialect's Insert, then its ReturningInsert on PostgreSQL
            if on_pg:
                stmt = postgresql.insert(table).on_conflict_do_nothing()
                stmt = stmt.returning(next(iter(table.primary_key.columns)))
            else:
                stmt = sqlite.insert(table).on_conflict_do_nothing()
            self._inserts[name] = stmt

    def write(self, batch: Sequence[TrajectoryRecord], *, replay: bool = False) -> None:
        """Store ``batch`` (traces, tags, spans, rewards) in one transaction; raises on failure
        (nothing of the batch is stored then). ``replay`` changes nothing: a trace already
        stored is found whatever the flag says."""
        m = self.m
        seen: set[str] = set()
        traces = []
        for record in batch:
            if record.spans and record.trace_id not in seen:
                seen.add(record.trace_id)
                traces.append(self._trace(record))
        if not traces:
            return
        now_ms = _now_ms()
        partitions: list[tuple[Any, int, list[int]]] = []
        for t in traces:
            ts = [t.info["timestamp_ms"]]
            partitions.append((m.RollupFamily.TRACE_METRIC, self.experiment_id, ts))
            partitions.append((m.RollupFamily.ASSESSMENT, self.experiment_id, ts))
            partitions.extend(
                (
                    m.RollupFamily.SPAN_COST,
                    self.experiment_id,
                    [s["start_time_unix_nano"] // 1_000_000],
                )
                for s in t.spans
            )
        with self.store.ManagedSessionMaker(read_only=False) as session:
            # MLflow's writers lock the rollup queue first; so does this one.
            m.enqueue_rollup_rebuild_partitions(session, partitions)
            stored = self._stored(session, traces)
            new = [t for t in traces if t.trace_id not in stored]
            rewarded = self._rewarded(session, [t for t in traces if t.trace_id in stored])
            assessments = [
                self._reward_row(t, now_ms)
                for t in traces
                if t.reward is not None and t.trace_id not in rewarded
            ]
            for name, rows in (
                ("info", [t.info for t in new]),
                ("tags", [row for t in new for row in t.tags]),
                ("metadata", [row for t in new for row in t.metadata]),
                ("spans", [row for t in new for row in t.spans]),
                ("assessments", assessments),
            ):
                if rows:
                    self._insert(session, name, rows)

    def _insert(self, session: Any, name: str, rows: list[dict[str, Any]]) -> None:
        session.connection().execute(self._inserts[name], rows)

    def _stored(self, session: Any, traces: list[_Trace]) -> set[str]:
        """Traces of the batch the store already holds (one indexed query per 500)."""
        model = self.m.SqlTraceInfo
        ids = [t.trace_id for t in traces]
        found: set[str] = set()
        for i in range(0, len(ids), 500):
            rows = session.query(model.request_id).filter(model.request_id.in_(ids[i : i + 500]))
            found.update(r[0] for r in rows)
        return found

    def _rewarded(self, session: Any, traces: list[_Trace]) -> set[str]:
        """Traces of the batch that already have a reward (logged by any path)."""
        model = self.m.SqlAssessments
        ids = [t.trace_id for t in traces]
        found: set[str] = set()
        for i in range(0, len(ids), 500):
            rows = session.query(model.trace_id).filter(
                model.trace_id.in_(ids[i : i + 500]), model.name == self.reward_name
            )
            found.update(r[0] for r in rows)
        return found

    def _reward_row(self, t: _Trace, now_ms: int) -> dict[str, Any]:
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

    def _trace(self, record: TrajectoryRecord) -> _Trace:
        """One trace's rows, as ``_log_spans_once`` computes them for a trace it creates."""
        m = self.m
        keys = m.SpanAttributeKey
        trace_id = self.trace_id_of(record.trace_id)
        trace_b64 = _b64(int(record.trace_id, 16), 16)
        request_id = encode_all_json(REQUEST_ID_KEY, trace_id)
        spans: list[dict[str, Any]] = []
        usage_nodes, cost_nodes = [], []
        root: dict[str, Any] | None = None
        root_status: str | None = None
        session_id = user_id = None
        for i, span in enumerate(record.spans):
            plain = span_attributes(record, span, i == 0)
            attrs = {REQUEST_ID_KEY: request_id}
            attrs.update({k: encode_all_json(k, v) for k, v in plain.items()})
            span_id = f"{int(span.span_id, 16):016x}"
            parent_id = f"{int(span.parent_id, 16):016x}" if span.parent_id else None
            status = "ERROR" if span.status == "ERROR" else "OK"
            translated = m.translate_span_when_storing(
                _SpanDict(_span_dict(record, span, trace_b64, parent_id, status, attrs))
            )
            a = translated.get("attributes", {})
            usage_nodes.append(m._span_aggregation_node(span_id, parent_id, a, keys.CHAT_USAGE))
            cost_nodes.append(m._span_aggregation_node(span_id, parent_id, a, keys.LLM_COST))
            if session_id is None and (
                sid := a.get(keys.SESSION_ID) or a.get(m.GenAiSemconvKey.CONVERSATION_ID)
            ):
                session_id = m.validate_session_id(m._try_parse_json_string(sid))
            if user_id is None and (uid := a.get("user.id")):
                user_id = m._try_parse_json_string(uid)
            cost: dict[str, Any] = {}
            if raw_cost := a.get(keys.LLM_COST):
                try:
                    cost = json.loads(raw_cost)
                except (TypeError, ValueError):
                    cost = {}
            span_type = attrs.get(keys.SPAN_TYPE)
            spans.append(
                {
                    "trace_id": trace_id,
                    "experiment_id": self.experiment_id,
                    "span_id": span_id,
                    "parent_span_id": parent_id,
                    "name": span.name,
                    "type": _json_value(span_type) if span_type is not None else None,
                    "status": status,
                    "start_time_unix_nano": span.start_ns,
                    "end_time_unix_nano": span.end_ns,
                    "content": json.dumps(translated, cls=m.TraceJSONEncoder, ensure_ascii=False),
                    "input_cost": m.finite_float_or_none(cost.get("input_cost")),
                    "output_cost": m.finite_float_or_none(cost.get("output_cost")),
                    "total_cost": m.finite_float_or_none(cost.get("total_cost")),
                    "model_name": m.bounded_model_dimension(
                        m._try_parse_json_string(a.get(keys.MODEL))
                    ),
                    "model_provider": m.bounded_model_dimension(
                        m._try_parse_json_string(a.get(keys.MODEL_PROVIDER))
                    ),
                }
            )
            if parent_id is None and root is None:
                root, root_status = a, ("ERROR" if status == "ERROR" else "OK")
        info = self._info(trace_id, record, spans, root, root_status)
        if session_id:
            info["session_id"] = session_id
        for nodes, aggregate, columns, convert in (
            (
                usage_nodes,
                m.aggregate_usage_from_span_nodes,
                m.TOKEN_COLUMN_BY_KEY,
                m.token_count_or_none,
            ),
            (
                cost_nodes,
                m.aggregate_cost_from_span_nodes,
                m.COST_COLUMN_BY_KEY,
                m.finite_float_or_none,
            ),
        ):
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
        return _Trace(trace_id, info, tags, spans, metadata, record.reward)

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
        location = m.append_to_uri_path(
            self.artifact_location,
            m.SqlAlchemyStore.TRACE_FOLDER_NAME,
            trace_id,
            m.SqlAlchemyStore.ARTIFACTS_FOLDER_NAME,
        )
        tags = {
            m.MLFLOW_ARTIFACT_LOCATION: location,
            m.TraceTagKey.SPANS_LOCATION: m.SpansLocation.TRACKING_STORE.value,
        }
        prefix = m.SpanAttributeKey.TRACE_TAG_PREFIX
        for attr_key, attr_value in (root or {}).items():
            if not attr_key.startswith(prefix):
                continue
            try:
                key, value = m._validate_trace_tag(
                    attr_key[len(prefix) :], str(m._try_parse_json_string(attr_value))
                )
            except Exception:  # MLflow skips an invalid tag, too
                continue
            if key == m.TraceTagKey.TRACE_NAME:
                info["trace_name"] = m.validate_trace_name(value)
            else:
                tags[key] = value
        return [{"request_id": trace_id, "key": k, "value": v} for k, v in tags.items()]


def _span_dict(
    record: TrajectoryRecord,
    span: Any,
    trace_b64: str,
    parent_id: str | None,
    status: str,
    attrs: dict[str, Any],
) -> dict[str, Any]:
    """``mlflow.entities.Span(to_readable_spans(record)[i]).to_dict()``, built directly."""
    events = []
    if span.error is not None:
        events.append(
            {
                "name": "exception",
                "time_unix_nano": span.end_ns,
                "attributes": {
                    "exception.type": span.error.get("type", ""),
                    "exception.message": span.error.get("message", ""),
                    "exception.stacktrace": span.error.get("traceback", ""),
                },
            }
        )
    message = (span.error or {}).get("message", "") if status == "ERROR" else ""
    return {
        "trace_id": trace_b64,
        "span_id": _b64(int(span.span_id, 16), 8),
        "parent_span_id": _b64(int(parent_id, 16), 8) if parent_id else None,
        "name": span.name,
        "start_time_unix_nano": span.start_ns,
        "end_time_unix_nano": span.end_ns,
        "events": events,
        "status": {"code": f"STATUS_CODE_{status}", "message": message or ""},
        "attributes": attrs,
        "links": [],
    }


def _b64(value: int, length: int) -> str:
    return base64.b64encode(value.to_bytes(length, "big")).decode()


def _json_value(raw: Any) -> Any:
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return raw


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
