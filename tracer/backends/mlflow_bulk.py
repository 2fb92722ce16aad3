"""Bulk writer for MLflow's SQL stores (sqlite, PostgreSQL): a whole batch in ONE transaction.

MLflow's own path costs one ``log_spans`` transaction per batch plus one transaction per reward
(``create_assessment``), and builds every span through OpenTelemetry and MLflow span objects.
This writer produces, per new trace, the rows that MLflow 3.18's ``SqlAlchemyStore`` writes
(``_log_spans_once`` + ``create_assessment``; built by :mod:`tracer.backends.mlflow_bulk_rows`)
into MLflow's own tables: on PostgreSQL by one multi-row ``INSERT`` of the traces, then ``COPY``
per table (:mod:`tracer.backends.mlflow_bulk_copy`), on sqlite by one multi-row insert per
table:

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

import importlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any

from tracer.backends.mlflow_bulk_copy import copy_batch, toast_compression
from tracer.backends.mlflow_bulk_rows import RowBuilder, TraceRows
from tracer.backends.mlflow_store_init import schema_revision
from tracer.credentials import store_address
from tracer.record import TrajectoryRecord

log = logging.getLogger("tracer")

# The MLflow versions this writer was tested with (tests/test_mlflow_bulk.py), each with the
# alembic revision of the tracking schema it creates. Add a version only after those tests
# pass on it: the writer mirrors private helpers that a release may change without a migration.
TESTED_VERSIONS: dict[str, str] = {"3.18.0": "f4a9b2c7d1e6"}
DIALECTS = ("sqlite", "postgresql")


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
                revision = schema_revision(session)
            # after the session ends, not inside it: a second connection while the first is
            # in a transaction takes two of a pooler's server connections (PgBouncer in
            # transaction mode), and writers that each hold one and wait for another deadlock
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
        self.reward_name = reward_name
        self.rows = RowBuilder(
            parts,
            experiment_id,
            artifact_location,
            trace_id_of=trace_id_of,
            reward_name=reward_name,
        )
        # PostgreSQL: one INSERT ... VALUES of the traces, then COPY per table (mlflow_bulk_copy).
        # sqlite: Core inserts with ON CONFLICT DO NOTHING; sqlite3's executemany is one C loop.
        # Core, not the ORM: the ORM's bulk path spent 3x the database's own time building one
        # bind parameter per value.
        self.copy = store.db_type == "postgresql"
        self._packers: dict[tuple[str, ...], list[Any] | None] = {}  # binary COPY, by table
        self._compression: str | None = None  # toast_compression's answer, asked once
        self._compression_asked = False
        from sqlalchemy.dialects import sqlite

        self._inserts: dict[str, Any] = {
            name: sqlite.insert(model.__table__).on_conflict_do_nothing()
            for name, model in (
                ("info", parts.SqlTraceInfo),
                ("tags", parts.SqlTraceTag),
                ("metadata", parts.SqlTraceMetadata),
                ("spans", parts.SqlSpan),
                ("assessments", parts.SqlAssessments),
            )
        }

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
                traces.append(self.rows.trace(record))
        if not traces:
            return
        now_ms = _now_ms()
        with self.store.ManagedSessionMaker(read_only=False) as session:
            # MLflow's writers lock the rollup queue first; so does this one. The partitions
            # are a generator: MLflow reads them only when its rollups are on (off by default),
            # and building them was ~4 % of the export child's time
            m.enqueue_rollup_rebuild_partitions(session, self._partitions(traces))
            if self.copy:
                rows = _table_rows(traces, traces)
                rows["assessments"] = [
                    self.rows.reward_row(t, now_ms) for t in traces if t.reward is not None
                ]
                with session.connection().connection.cursor() as cursor:
                    if not self._compression_asked:
                        self._compression = toast_compression(cursor)
                        self._compression_asked = True
                    copy_batch(cursor, rows, self.reward_name, self._packers, self._compression)
                return
            stored = self._stored(session, traces)
            new = [t for t in traces if t.trace_id not in stored]
            rewarded = self._rewarded(session, [t for t in traces if t.trace_id in stored])
            rows = _table_rows(new, traces)
            rows["assessments"] = [
                self.rows.reward_row(t, now_ms)
                for t in traces
                if t.reward is not None and t.trace_id not in rewarded
            ]
            for name, table_rows in rows.items():
                if table_rows:
                    session.connection().execute(self._inserts[name], table_rows)

    def _partitions(self, traces: list[TraceRows]) -> Iterator[tuple[Any, int, list[int]]]:
        """The rollup partitions a batch touches, as MLflow's writers name them: per trace
        its trace-metric and assessment days, per span its cost day."""
        m = self.m
        for t in traces:
            ts = [t.info["timestamp_ms"]]
            yield m.RollupFamily.TRACE_METRIC, self.experiment_id, ts
            yield m.RollupFamily.ASSESSMENT, self.experiment_id, ts
            for s in t.spans:
                yield m.RollupFamily.SPAN_COST, self.experiment_id, [
                    s["start_time_unix_nano"] // 1_000_000
                ]

    def _stored(self, session: Any, traces: list[TraceRows]) -> set[str]:
        """Traces of the batch the store already holds (one indexed query per 500)."""
        model = self.m.SqlTraceInfo
        ids = [t.trace_id for t in traces]
        found: set[str] = set()
        for i in range(0, len(ids), 500):
            rows = session.query(model.request_id).filter(model.request_id.in_(ids[i : i + 500]))
            found.update(r[0] for r in rows)
        return found

    def _rewarded(self, session: Any, traces: list[TraceRows]) -> set[str]:
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


def _table_rows(new: list[TraceRows], traces: list[TraceRows]) -> dict[str, list[dict[str, Any]]]:
    """The rows of ``new`` traces by table (assessments are added by the caller)."""
    return {
        "info": [t.info for t in new],
        "tags": [row for t in new for row in t.tags],
        "metadata": [row for t in new for row in t.metadata],
        "spans": [row for t in new for row in t.spans],
    }


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
