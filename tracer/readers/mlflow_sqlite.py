"""Trajectories straight from an MLflow sqlite store's own tables, without importing MLflow.

MLflow's client costs seconds to import and reads trace by trace; this reads the tables the
tracking store keeps (``experiments``, ``trace_info``, ``trace_tags``, ``spans``,
``assessments``) a page at a time, read-only, and builds the same objects
:func:`tracer.readers.mlflow_source.mlflow_to_record` takes from MLflow's client. It is used only
on a schema revision (``alembic_version``) it was tested with, and only when every selected
trace keeps its spans in the ``spans`` table; otherwise :func:`open_store` returns None and the
reader uses MLflow's client. tests/test_mlflow_sqlite_reader.py compares the two row by row.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

from tracer.readers.selection import PAGE_SIZE, Selection

# The tracking schema of MLflow 3.18 (f4a9b2c7d1e6; the bulk writer, tracer/backends/
# mlflow_bulk.py, writes it too) and of 3.17 (dc11669786a5): the three migrations between them
# add skill-registry tables and change the issues and MCP-server tables, none this reader reads
TESTED_SCHEMA_REVISIONS = frozenset({"dc11669786a5", "f4a9b2c7d1e6"})


class SqliteStore:
    """A read-only connection to one store whose schema this reader knows."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def experiments(self) -> dict[str, str]:
        """Active experiments: name -> id."""
        rows = self.conn.execute("SELECT name, experiment_id FROM experiments "
                                 "WHERE lifecycle_stage = 'active' ORDER BY experiment_id")
        return {str(name): str(eid) for name, eid in rows}

    def selected(self, experiment_id: str, selection: Selection) -> tuple[list[str], set[Any]]:
        """Trace ids of the selection (newest first, as MLflow's search) and every step there."""
        rows = self.conn.execute(
            "SELECT t.request_id, s.value, v.value FROM trace_info t "
            "LEFT JOIN trace_tags s ON s.request_id = t.request_id AND s.key = 'step' "
            "LEFT JOIN trace_tags v ON v.request_id = t.request_id AND v.key = 'validate' "
            "WHERE t.experiment_id = ? ORDER BY t.timestamp_ms DESC, t.request_id",
            (experiment_id,),
        ).fetchall()
        wanted = None if selection.steps is None else {str(s) for s in selection.steps}
        ids, steps = [], set()
        for request_id, step, validate in rows:
            steps.add(int(step) if step is not None and step.lstrip("-").isdigit() else step)
            if wanted is not None and step not in wanted:
                continue
            if selection.validate is not None and (
                validate is None or validate.lower() != str(selection.validate).lower()
            ):
                continue
            ids.append(request_id)
        return ids, steps

    def all_spans_here(self, ids: list[str]) -> bool:
        """True when every trace keeps its spans in the ``spans`` table (not as artifacts)."""
        for chunk in _chunks(ids, 500):
            marks = ",".join("?" * len(chunk))
            have = self.conn.execute(
                f"SELECT COUNT(DISTINCT trace_id) FROM spans WHERE trace_id IN ({marks})", chunk
            ).fetchone()[0]
            if have != len(chunk):
                return False
        return True

    def traces(self, ids: list[str]) -> list[Any]:
        """The traces ``ids`` (in that order) as objects shaped like MLflow's ``Trace``."""
        marks = ",".join("?" * len(ids))
        info = {r[0]: r for r in self.conn.execute(
            f"SELECT request_id, timestamp_ms FROM trace_info WHERE request_id IN ({marks})", ids)}
        tags: dict[str, dict[str, str]] = {i: {} for i in ids}
        for request_id, key, value in self.conn.execute(
            f"SELECT request_id, key, value FROM trace_tags WHERE request_id IN ({marks})", ids
        ):
            tags[request_id][key] = value
        spans: dict[str, list[Any]] = {i: [] for i in ids}
        for row in self.conn.execute(
            "SELECT trace_id, span_id, parent_span_id, name, status, start_time_unix_nano, "
            f"end_time_unix_nano, content FROM spans WHERE trace_id IN ({marks}) "
            "ORDER BY trace_id, start_time_unix_nano, span_id", ids
        ):  # fmt: skip
            spans[row[0]].append(_span(row))
        assessments: dict[str, list[Any]] = {i: [] for i in ids}
        for trace_id, name, value in self.conn.execute(
            "SELECT trace_id, name, value FROM assessments WHERE trace_id IN "
            f"({marks}) AND assessment_type = 'feedback' AND valid "
            "ORDER BY created_timestamp", ids
        ):  # fmt: skip
            feedback = SimpleNamespace(value=_json(value))
            assessments[trace_id].append(SimpleNamespace(name=name, feedback=feedback))
        out = []
        for i in ids:
            meta = SimpleNamespace(trace_id=i, tags=tags[i], request_time=info[i][1],
                                   assessments=assessments[i])  # fmt: skip
            out.append(SimpleNamespace(info=meta, data=SimpleNamespace(spans=spans[i])))
        return out

    def pages(self, ids: list[str], page_size: int = PAGE_SIZE) -> Iterator[list[Any]]:
        for chunk in _chunks(ids, min(page_size, 500)):  # sqlite's bound parameters
            yield self.traces(chunk)


def open_store(path: str) -> SqliteStore | None:
    """A read-only reader of the sqlite store at ``path``, or None when its schema is not one
    this reader was tested with (the caller then uses MLflow's client)."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)
        revision = conn.execute("SELECT version_num FROM alembic_version").fetchone()
    except sqlite3.Error:
        return None
    if revision is None or revision[0] not in TESTED_SCHEMA_REVISIONS:
        conn.close()
        return None
    return SqliteStore(conn)


def _chunks(items: list[str], n: int) -> Iterator[list[str]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


def _json(value: Any) -> Any:
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return value


_STATUS = {"STATUS_CODE_OK": "OK", "STATUS_CODE_ERROR": "ERROR", "STATUS_CODE_UNSET": "UNSET"}


def _span(row: tuple[Any, ...]) -> Any:
    """A ``spans`` row as an object with what MLflow's ``Span`` gives the reader: attribute
    values are stored JSON-encoded, as MLflow's span decodes them."""
    _, span_id, parent_id, name, status, start, end, content = row
    data = json.loads(content)
    attrs = {k: _json(v) for k, v in (data.get("attributes") or {}).items()}
    state = data.get("status") or {}
    code = _STATUS.get(str(state.get("code")), str(status or "UNSET"))
    events = [SimpleNamespace(name=e.get("name"), attributes=e.get("attributes") or {})
              for e in data.get("events") or []]  # fmt: skip
    return SimpleNamespace(
        span_id=span_id,
        parent_id=parent_id or None,
        name=name,
        span_type=attrs.get("mlflow.spanType"),
        status=SimpleNamespace(status_code=code, description=state.get("message") or ""),
        events=events,
        inputs=attrs.get("mlflow.spanInputs"),
        outputs=attrs.get("mlflow.spanOutputs"),
        attributes=attrs,
        start_time_ns=start,
        end_time_ns=end,
    )
