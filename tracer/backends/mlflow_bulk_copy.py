"""A batch's rows into PostgreSQL the way PostgreSQL loads fastest: ``COPY``.

Per batch, inside the writer's transaction:

1. the batch's ``trace_info`` rows go into a temporary staging table of the session (created
   once per connection, emptied at commit) by one ``COPY ... FROM STDIN`` in text format
   (psycopg2's ``copy_expert``); ``INSERT INTO trace_info ... SELECT ... ON CONFLICT DO NOTHING
   RETURNING request_id`` then says which traces this batch created. A trace already stored
   (a replay, a retry, another writer first) is skipped: the first record stored wins, as on
   MLflow's own path;
2. the tags, metadata and spans of the created traces are COPYed straight into MLflow's
   tables. They cannot conflict: a trace's rows are written only in the transaction that
   created its ``trace_info`` row (here and on MLflow's own path), and a second writer of the
   same id waits on that row's unique index, then finds it stored;
3. the rewards go through a staging table too, and in unless the trace already has an
   assessment of that name, whichever path wrote it (``NOT EXISTS``, ``ON CONFLICT DO
   NOTHING``).

Why not stage every table: the profile (docs/scale-out.md) showed PostgreSQL spending as much
on the staging copy of the spans (~1 KB of JSON each) and the ``INSERT ... SELECT`` out of it
as on the multi-row ``VALUES`` insert it replaced; spans written once cost it about half.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

# MLflow's tables, by the names the bulk writer gives them, and each one's trace-id column.
TABLES = {
    "info": ("trace_info", "request_id"),
    "tags": ("trace_tags", "request_id"),
    "metadata": ("trace_request_metadata", "request_id"),
    "spans": ("spans", "trace_id"),
    "assessments": ("assessments", "trace_id"),
}


def copy_batch(cursor: Any, rows: dict[str, list[dict[str, Any]]], reward_name: str) -> set[str]:
    """Store ``rows`` (by table: info, tags, metadata, spans, assessments) with ``cursor``, a
    psycopg2 cursor in the writer's open transaction. Returns the trace ids it created."""
    created: set[str] = set()
    if rows.get("info"):
        _stage(cursor, "info", rows["info"])
        cursor.execute(_insert_select("info", list(rows["info"][0]), "RETURNING request_id"))
        created = {row[0] for row in cursor.fetchall()}
    if created:
        for name in ("tags", "metadata", "spans"):
            id_column = TABLES[name][1]
            mine = [row for row in rows.get(name, ()) if row[id_column] in created]
            if mine:
                columns = list(mine[0])
                cursor.copy_expert(
                    f"COPY {TABLES[name][0]} ({', '.join(columns)}) FROM STDIN",
                    io.StringIO(copy_text(mine, columns)),
                )
    if rows.get("assessments"):
        table = TABLES["assessments"][0]
        _stage(cursor, "assessments", rows["assessments"])
        cursor.execute(
            _insert_select(
                "assessments",
                list(rows["assessments"][0]),
                where=f"NOT EXISTS (SELECT 1 FROM {table} a WHERE a.trace_id = s.trace_id "
                "AND a.name = %(name)s) AND s.name = %(name)s",
            ),
            {"name": reward_name},
        )
    return created


def _stage(cursor: Any, name: str, rows: list[dict[str, Any]]) -> None:
    """``rows`` into this session's staging table for ``name`` (no index, no constraint)."""
    table, columns = TABLES[name][0], list(rows[0])
    cursor.execute(
        f"CREATE TEMP TABLE IF NOT EXISTS rt_stage_{table} ON COMMIT DELETE ROWS "
        f"AS SELECT {', '.join(columns)} FROM {table} WITH NO DATA"
    )
    cursor.copy_expert(
        f"COPY rt_stage_{table} ({', '.join(columns)}) FROM STDIN",
        io.StringIO(copy_text(rows, columns)),
    )


def _insert_select(name: str, columns: Sequence[str], returning: str = "", where: str = "") -> str:
    table = TABLES[name][0]
    cols = ", ".join(columns)
    condition = f" WHERE {where}" if where else ""
    return (
        f"INSERT INTO {table} ({cols}) SELECT {cols} FROM rt_stage_{table} s{condition} "
        f"ON CONFLICT DO NOTHING {returning}"
    )


def copy_text(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """``rows`` in COPY's text format: tab-separated columns, ``\\N`` for NULL, backslash
    escapes for backslash, tab, newline and carriage return."""
    return "".join("\t".join([_text(row[c]) for c in columns]) + "\n" for row in rows)


def _text(value: Any) -> str:
    if value is None:
        return "\\N"
    if isinstance(value, str):
        # str.replace is a C scan: far cheaper than str.translate on kilobytes of JSON
        return (
            value.replace("\\", "\\\\")
            .replace("\t", "\\t")
            .replace("\n", "\\n")
            .replace("\r", "\\r")
        )
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return str(value)
