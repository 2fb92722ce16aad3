"""A batch's rows into PostgreSQL the way PostgreSQL loads fastest: ``COPY``, then one
``INSERT ... SELECT`` per table.

Per batch, inside the writer's transaction:

1. the rows of each table go into a temporary staging table of the session (created once per
   connection with only the columns written, emptied at commit) by one ``COPY ... FROM STDIN``
   in text format (psycopg2's ``copy_expert``), one round trip per table;
2. ``INSERT INTO trace_info ... SELECT ... ON CONFLICT DO NOTHING RETURNING request_id`` says which
   traces this batch created. Only those get their tags, metadata and spans (the first record
   stored wins, as on MLflow's own path, even when two writers race on one id);
3. the reward goes in unless its trace already has an assessment of that name, whichever path
   wrote it (looked up by name, ``NOT EXISTS``); ``ON CONFLICT DO NOTHING`` on every insert.

The staging tables have no index and no constraint, so COPY costs PostgreSQL little more than the
parse; the indexes of MLflow's tables are maintained once, by the INSERT ... SELECT.
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
    present = {name: r for name, r in rows.items() if r}
    if not present:
        return set()
    columns = {name: list(r[0]) for name, r in present.items()}
    cursor.execute(
        ";".join(
            f"CREATE TEMP TABLE IF NOT EXISTS rt_stage_{TABLES[name][0]} ON COMMIT DELETE ROWS "
            f"AS SELECT {', '.join(cols)} FROM {TABLES[name][0]} WITH NO DATA"
            for name, cols in columns.items()
        )
    )
    for name, table_rows in present.items():
        table = TABLES[name][0]
        cursor.copy_expert(
            f"COPY rt_stage_{table} ({', '.join(columns[name])}) FROM STDIN",
            io.StringIO(copy_text(table_rows, columns[name])),
        )
    created: set[str] = set()
    if "info" in present:
        cursor.execute(_insert_select("info", columns["info"], "RETURNING request_id"))
        created = {row[0] for row in cursor.fetchall()}
    if created:
        for name in ("tags", "metadata", "spans"):
            if name in present:
                id_column = TABLES[name][1]
                cursor.execute(
                    _insert_select(name, columns[name], where=f"{id_column} = ANY(%(ids)s)"),
                    {"ids": sorted(created)},
                )
    if "assessments" in present:
        table = TABLES["assessments"][0]
        cursor.execute(
            _insert_select(
                "assessments",
                columns["assessments"],
                where=f"NOT EXISTS (SELECT 1 FROM {table} a WHERE a.trace_id = s.trace_id "
                "AND a.name = %(name)s) AND s.name = %(name)s",
            ),
            {"name": reward_name},
        )
    return created


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
