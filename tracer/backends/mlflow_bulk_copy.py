"""A batch's rows into PostgreSQL the way PostgreSQL loads fastest: ``COPY``.

Per batch, inside the writer's transaction:

1. the batch's ``trace_info`` rows go in by one multi-row ``INSERT INTO trace_info ... VALUES
   ... ON CONFLICT DO NOTHING RETURNING request_id`` (psycopg2's ``execute_values``), which
   says which traces this batch created. A trace already stored (a replay, a retry, another
   writer first) is skipped: the first record stored wins, as on MLflow's own path. (These
   rows went through a temporary staging table before, emptied at every commit: ``COPY``
   into it, then ``INSERT ... SELECT`` out of it. Besides its statements, the table cost
   PostgreSQL CPU at every transaction: about a sixth of its CPU a trace at batches of 2
   traces, as a job's writers send them when each batch has its own call (figure
   ``ingest-staging-table``); the one ``INSERT`` is no worse at batches of 32 or 256.)
2. the tags, metadata, spans and rewards of the created traces are COPYed straight into
   MLflow's tables. They cannot conflict: a trace's rows are written only in the transaction
   that created its ``trace_info`` row (here and on MLflow's own path), and a second writer of
   the same id waits on that row's unique index, then finds it stored; an assessment from
   anywhere else needs the committed ``trace_info`` row (its foreign key), so a trace created
   here has none yet;
3. the rewards of traces stored before (a replay, a retry, another writer first) go through a
   staging table, and in unless the trace already has an assessment of that name, whichever
   path wrote it (``NOT EXISTS``, ``ON CONFLICT DO NOTHING``).

The tags, metadata and spans go in COPY's binary format: PostgreSQL then reads each value by
its length instead of scanning a span's kilobyte of JSON for backslash escapes, and the writer
packs lengths instead of escaping (measured on the benchmark's spans: about a third less for
the writer to build, a few per cent less for PostgreSQL to read). The column types come from
the table itself (``binary_columns``); a table with a type the packer does not know goes in
text.

Large values are compressed with lz4 where nobody chose otherwise: PostgreSQL tries to compress
a value when its row passes ~2 KB (a generate span's content with its token lists does), with
``default_toast_compression``, pglz unless set. pglz spent ~18 % of PostgreSQL's CPU on the
benchmark's spans, and failed on every one of them (stored uncompressed); lz4 compresses them
(2.1 KB to 1.7 KB) at a fraction of the cost, and PostgreSQL reads either transparently: MLflow
reads the same text. So each batch's transaction says ``SET LOCAL default_toast_compression =
lz4`` when the server has lz4 and the setting is PostgreSQL's built-in default; a value set in
the server's configuration, for the database or for the role is the owner's choice and stays
(:func:`toast_compression`). Nothing else changes: same rows, same durability.

Why not stage every table: the profile (docs/scale-out.md) showed PostgreSQL spending as much
on the staging copy of the spans (~1 KB of JSON each) and the ``INSERT ... SELECT`` out of it
as on the multi-row ``VALUES`` insert it replaced; spans written once cost it about half.
"""

from __future__ import annotations

import io
import math
import struct
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


def copy_batch(
    cursor: Any,
    rows: dict[str, list[dict[str, Any]]],
    reward_name: str,
    packers: dict[tuple[str, ...], list[Any] | None],
    compression: str | None = None,
) -> set[str]:
    """Store ``rows`` (by table: info, tags, metadata, spans, assessments) with ``cursor``, a
    psycopg2 cursor in the writer's open transaction. Returns the trace ids it created.
    ``packers``: the writer's cache of :func:`binary_columns`, by table and columns;
    ``compression``: :func:`toast_compression`'s answer (None: the server's setting)."""
    created: set[str] = set()
    if compression is not None:  # this transaction only
        cursor.execute(f"SET LOCAL default_toast_compression = {compression}")
    if rows.get("info"):
        created = _insert_info(cursor, rows["info"])
    if created:
        for name in ("tags", "metadata", "spans", "assessments"):
            id_column = TABLES[name][1]
            mine = [row for row in rows.get(name, ()) if row[id_column] in created]
            if mine:
                _copy(cursor, TABLES[name][0], mine, packers)
    # a reward for a trace stored before this batch: in unless the trace has one of that name
    later = [row for row in rows.get("assessments", ()) if row["trace_id"] not in created]
    if later:
        table = TABLES["assessments"][0]
        _stage(cursor, "assessments", later)
        cursor.execute(
            _insert_select(
                "assessments",
                list(later[0]),
                where=f"NOT EXISTS (SELECT 1 FROM {table} a WHERE a.trace_id = s.trace_id "
                "AND a.name = %(name)s) AND s.name = %(name)s",
            ),
            {"name": reward_name},
        )
    return created


def _insert_info(cursor: Any, rows: list[dict[str, Any]]) -> set[str]:
    """``rows`` into ``trace_info`` by one statement, those whose id is stored already
    skipped; returns the ids inserted."""
    from psycopg2.extras import execute_values

    table, id_column = TABLES["info"]
    columns = list(rows[0])
    inserted = execute_values(
        cursor,
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES %s "
        f"ON CONFLICT DO NOTHING RETURNING {id_column}",
        [[row[c] for c in columns] for row in rows],
        page_size=len(rows),  # one statement (its default, 100 rows, would make several)
        fetch=True,
    )
    return {row[0] for row in inserted}


def _copy(
    cursor: Any,
    table: str,
    rows: list[dict[str, Any]],
    packers: dict[tuple[str, ...], list[Any] | None],
) -> None:
    """``rows`` straight into ``table`` by one COPY: binary when the packer knows every
    column's type, else text."""
    columns = list(rows[0])
    key = (table, *columns)
    if key not in packers:
        packers[key] = binary_columns(cursor, table, columns)
    into = f"COPY {table} ({', '.join(columns)}) FROM STDIN"
    if (packs := packers[key]) is not None:
        data = copy_binary(rows, columns, packs, _codec(cursor))
        cursor.copy_expert(f"{into} (FORMAT binary)", io.BytesIO(data), _CHUNK)
    else:
        cursor.copy_expert(into, io.StringIO(copy_text(rows, columns)))


def toast_compression(cursor: Any) -> str | None:
    """``"lz4"`` when the batches' large values should be compressed with lz4: the server
    knows it and ``default_toast_compression`` is PostgreSQL's built-in default (pglz, set
    nowhere); else None, and the server's setting stands."""
    cursor.execute(
        "SELECT setting, source, enumvals FROM pg_settings "
        "WHERE name = 'default_toast_compression'"
    )
    row = cursor.fetchone()  # None before PostgreSQL 14: no such setting, pglz only
    if row is None:
        return None
    setting, source, choices = row
    return "lz4" if setting == "pglz" and source == "default" and "lz4" in (choices or ()) else None


def _stage(cursor: Any, name: str, rows: list[dict[str, Any]]) -> None:
    """``rows`` into this session's staging table for ``name`` (no index, no constraint): only
    rewards of traces stored before a batch go this way (a replay's, a retry's)."""
    table, columns = TABLES[name][0], list(rows[0])
    cursor.execute(
        f"CREATE TEMP TABLE IF NOT EXISTS rt_stage_{table} ON COMMIT DELETE ROWS "
        f"AS SELECT {', '.join(columns)} FROM {table} WITH NO DATA"
    )
    cursor.copy_expert(
        f"COPY rt_stage_{table} ({', '.join(columns)}) FROM STDIN",
        io.StringIO(copy_text(rows, columns)),
    )


def _insert_select(name: str, columns: Sequence[str], where: str) -> str:
    table = TABLES[name][0]
    cols = ", ".join(columns)
    return (
        f"INSERT INTO {table} ({cols}) SELECT {cols} FROM rt_stage_{table} s WHERE {where} "
        "ON CONFLICT DO NOTHING"
    )


def copy_text(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """``rows`` in COPY's text format: tab-separated columns, ``\\N`` for NULL, backslash
    escapes for backslash, tab, newline and carriage return."""
    return "".join("\t".join([_text(row[c]) for c in columns]) + "\n" for row in rows)


def _plain_text(value: Any) -> str:
    """A number or flag as PostgreSQL's text input reads it (the text format's spelling)."""
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return str(value)


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
    return _plain_text(value)


# PostgreSQL type oid -> how a value of it is packed in COPY's binary format (length, value)
_PACKERS: dict[int, struct.Struct | None] = {
    16: struct.Struct("!i?"),  # boolean
    20: struct.Struct("!iq"),  # bigint
    23: struct.Struct("!ii"),  # integer
    701: struct.Struct("!id"),  # double precision
    25: None,  # text: its UTF-8 bytes
    1043: None,  # character varying
}
_HEADER = b"PGCOPY\n\xff\r\n\x00" + struct.pack("!ii", 0, 0)  # signature, flags, extension
_NULL = struct.pack("!i", -1)
_LENGTH = struct.Struct("!i")
# bytes of COPY data psycopg2 reads and hands to libpq at a time: its default, 8 KiB, made ~100
# calls and sends a batch of 32 traces (~8 us a trace of the writer's CPU, most of it in the
# kernel); at most this much is copied once more
_CHUNK = 1 << 20
_SHORT_TEXT = 64  # a text this long or shorter is packed once a call (copy_binary)


def binary_columns(cursor: Any, table: str, columns: Sequence[str]) -> list[Any] | None:
    """How each of ``columns`` is packed, from the types the table has (an empty query's
    description), or None when one is a type :data:`_PACKERS` does not know (then: text)."""
    cursor.execute(f"SELECT {', '.join(columns)} FROM {table} WHERE false")
    oids = [d.type_code for d in cursor.description]
    if not all(oid in _PACKERS for oid in oids):
        return None
    return [_PACKERS[oid] for oid in oids]


def _codec(cursor: Any) -> str:
    """The connection's client encoding as Python names it: PostgreSQL reads binary text in
    it, as psycopg2 writes the text format in it."""
    from psycopg2.extensions import encodings

    return str(encodings[cursor.connection.encoding])


def copy_binary(
    rows: Sequence[dict[str, Any]],
    columns: Sequence[str],
    packers: Sequence[Any],
    codec: str = "utf-8",
) -> bytes:
    """``rows`` in COPY's binary format: per row the field count, then per field its length
    (-1: NULL) and its bytes (text in ``codec``, numbers big-endian). A short text repeats
    (a trace's id in each of its spans' rows, a span's name, type and status, a tag's key):
    its packed field is made once a call and used again (~a fifth of this function's time)."""
    out = [_HEADER]
    append = out.append
    count = struct.pack("!h", len(columns))
    pairs = list(zip(columns, packers, strict=True))
    packed: dict[str, bytes] = {}  # short text -> its length and bytes, this call only
    for row in rows:
        append(count)
        for column, packer in pairs:
            value = row[column]
            if value is None:
                append(_NULL)
            elif packer is None:
                if type(value) is str and len(value) <= _SHORT_TEXT:
                    field = packed.get(value)
                    if field is None:
                        data = value.encode(codec)
                        field = packed[value] = _LENGTH.pack(len(data)) + data
                    append(field)
                    continue
                data = (value if isinstance(value, str) else _plain_text(value)).encode(codec)
                append(_LENGTH.pack(len(data)))
                append(data)
            else:
                append(packer.pack(packer.size - 4, value))
    append(b"\xff\xff")  # the trailer: field count -1
    return b"".join(out)
