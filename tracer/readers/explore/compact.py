"""The compacted copy of an export, built once per export in the explorer's cache folder, and
the lookups that read one trajectory's rows from it.

An export writes one Parquet row group per page of 500 trajectories, and DuckDB pays per row
group: over a million trajectories every query is 10-30x slower than over a few large ones.
The copy holds the same rows in layouts made for the explorer's two kinds of reads:

- ``trajectories.parquet``: the export's order, 16,384-row groups, for the list's scans (the
  step statistics still prune a step range);
- ``rows.arrow``: the same rows, less the three long texts (the prompt with its chat template,
  the responses, the messages), as an uncompressed Arrow file that is memory-mapped: a page's
  50 rows are 50 slices, wherever they lie (DuckDB or pyarrow read a whole row group, or at
  least 2,048 rows, per row: 50-350 ms for a page sorted by a column in no relation to the
  file's order);
- ``rows.parquet``: all columns in 1,024-row groups, for one trajectory's row by row number;
- ``ids.parquet``: (trace_id, step, rn) sorted by trace_id, so an id alone finds its row;
- ``turns``, ``tool_calls``, ``tokens``: sorted by (step, trace_id) in small row groups, so a
  trajectory's rows sit in one row group (rarely two) that the footer's min/max statistics
  point to;
- ``summary.json``: the row count and the reward range (the histogram's bins).

One trajectory is read with pyarrow from the row groups its key falls in: DuckDB prunes the
same row groups by statistics, but plans and schedules a scan over all of them (~40 ms for
1,465 row groups, whatever it then reads).
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import shutil
import threading
from typing import Any

VERSION = 5
# long texts left out of rows.arrow (read from rows.parquet when asked for)
LONG = ("prompt_text", "response_text", "messages")
# rows per row group: large where DuckDB scans, small where one trajectory is read
ROW_GROUPS = {"trajectories": 16_384, "rows": 1_024, "ids": 8_192, "turns": 2_048,
              "tool_calls": 2_048, "tokens": 16_384}  # fmt: skip
PER_TRAJECTORY = ("turns", "tool_calls", "tokens")


def quote(path: str) -> str:
    return "'" + path.replace("'", "''") + "'"


def build(src: str, tables: set[str], out: str, threads: int, memory_limit: str,
          stop: threading.Event | None = None,
          running: set[Any] | None = None) -> None:  # fmt: skip
    """Write the compacted copy of the export folder ``src`` into ``out`` (atomically: a
    ``.building`` folder renamed when complete), with a DuckDB connection of its own whose
    sorts spill into that folder beyond ``memory_limit``. ``stop`` ends it early (InterruptedError);
    the connection sits in ``running`` meanwhile, so a closing server can interrupt it.

    Memory stays within ``memory_limit`` whatever the export's size: the tables in the
    export's order are streamed batch by batch with pyarrow, and each sorted table is sorted
    a slice at a time (consecutive steps holding at most an eighth of the limit in text;
    a larger step is cut by trace id), the slices appended in order to one file."""
    import duckdb
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = out + ".building"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    cur = duckdb.connect(":memory:", config={"threads": threads, "memory_limit": memory_limit,
                                             "temp_directory": os.path.join(tmp, "spill"),
                                             # every copy here has its ORDER BY
                                             "preserve_insertion_order": False})  # fmt: skip
    running = running if running is not None else set()
    running.add(cur)

    def check() -> None:
        if stop is not None and stop.is_set():
            raise InterruptedError("the explorer is stopping")

    traj_file = os.path.join(src, "trajectories.parquet")
    try:
        # the export's order is the row number: pyarrow keeps it, batch by batch
        _stream(traj_file, os.path.join(tmp, "trajectories.parquet"),
                ROW_GROUPS["trajectories"], check)  # fmt: skip
        traj = f"read_parquet({quote(traj_file)}"
        cur.execute(f"COPY (SELECT trace_id, step, file_row_number AS rn FROM {traj}, "
                    f"file_row_number = true) ORDER BY trace_id) TO "
                    f"{quote(os.path.join(tmp, 'ids.parquet'))} (FORMAT parquet, COMPRESSION "
                    f"zstd, ROW_GROUP_SIZE {ROW_GROUPS['ids']})")  # fmt: skip
        budget = parse_bytes(memory_limit) // 8
        for table in PER_TRAJECTORY:
            if table in tables:
                _sorted_copy(cur, os.path.join(src, table + ".parquet"),
                             os.path.join(tmp, table + ".parquet"), ROW_GROUPS[table], budget,
                             check)  # fmt: skip
        row = cur.execute(f"SELECT count(*), min(reward), max(reward) FROM {traj})").fetchone()
        n, lo, hi = row if row is not None else (0, None, None)
    finally:
        running.discard(cur)
        cur.close()
    shutil.rmtree(os.path.join(tmp, "spill"), ignore_errors=True)
    f = pq.ParquetFile(os.path.join(tmp, "trajectories.parquet"))
    _stream(os.path.join(tmp, "trajectories.parquet"), os.path.join(tmp, "rows.parquet"),
            ROW_GROUPS["rows"], check)  # fmt: skip
    size = ROW_GROUPS["rows"]
    short = [n for n in f.schema_arrow.names if n not in LONG]
    schema = f.schema_arrow
    with pa.OSFile(os.path.join(tmp, "rows.arrow"), "wb") as sink, \
            pa.ipc.new_file(sink, pa.schema([schema.field(n) for n in short])) as ipc:  # fmt: skip
        for batch in f.iter_batches(batch_size=size, columns=short):
            check()
            ipc.write_batch(batch)
    with open(os.path.join(tmp, "summary.json"), "w", encoding="utf-8") as fh:
        json.dump({"version": VERSION, "trajectories": n, "reward_lo": lo, "reward_hi": hi}, fh)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.replace(tmp, out)


def _stream(src: str, dest: str, rows: int, check: Any) -> None:
    """Copy a Parquet file in its order into row groups of ``rows`` (one batch in memory)."""
    import pyarrow.parquet as pq

    f = pq.ParquetFile(src)
    with pq.ParquetWriter(dest, f.schema_arrow, compression="zstd") as w:
        for batch in f.iter_batches(batch_size=rows):
            check()
            w.write_batch(batch, row_group_size=rows)


def _sorted_copy(cur: Any, src: str, dest: str, rows: int, budget: int, check: Any) -> None:
    """``src`` sorted by (step NULLS LAST, trace_id) into ``dest``, a slice at a time: each
    slice is sorted by DuckDB within its memory and its batches appended to the file."""
    import pyarrow.parquet as pq

    md = pq.ParquetFile(src).metadata
    per_row = max(1, sum(md.row_group(g).total_byte_size for g in range(md.num_row_groups))
                  // max(1, md.num_rows))  # uncompressed bytes  # fmt: skip
    cap = max(rows, budget // per_row)  # rows sorted at once
    table = f"read_parquet({quote(src)})"
    writer = None
    try:
        for where, params in _slices(cur, table, cap):
            check()
            rel = cur.sql(f"SELECT * FROM {table} WHERE {where} ORDER BY step NULLS LAST, "
                          "trace_id", params=params)  # fmt: skip
            # DuckDB 2 renamed fetch_record_batch (1.x) to_arrow_reader
            stream = getattr(rel, "to_arrow_reader", None) or rel.fetch_record_batch
            reader = stream(rows)
            if writer is None:
                writer = pq.ParquetWriter(dest, reader.schema, compression="zstd")
            for batch in reader:
                check()
                writer.write_batch(batch, row_group_size=rows)
        if writer is None:  # an empty table: an empty file with its schema
            empty = cur.sql(f"SELECT * FROM {table} LIMIT 0")
            schema = (getattr(empty, "to_arrow_table", None) or empty.fetch_arrow_table)().schema
            writer = pq.ParquetWriter(dest, schema, compression="zstd")
    finally:
        if writer is not None:
            writer.close()


def _slices(cur: Any, table: str, cap: int) -> list[tuple[str, list[Any]]]:
    """WHERE clauses that cut ``table`` into slices of at most about ``cap`` rows, in the
    sorted order: runs of consecutive steps, a step larger than ``cap`` cut at trace id
    quantiles, the rows without a step last."""
    counts = cur.execute(f"SELECT step, count(*) FROM {table} GROUP BY step "
                         "ORDER BY step NULLS LAST").fetchall()  # fmt: skip
    out: list[tuple[str, list[Any]]] = []
    run: list[Any] = []  # steps of the slice being gathered, and their rows
    held = 0

    def flush() -> None:
        nonlocal held
        if run:
            out.append(("step BETWEEN ? AND ?", [run[0], run[-1]]))
            run.clear()
            held = 0

    for step, n in counts:
        if step is not None and n <= cap and held + n <= cap:
            run.append(step)
            held += n
            continue
        flush()
        if step is not None and n <= cap:
            run.append(step)
            held = n
            continue
        cond, params = ("step IS NULL", []) if step is None else ("step = ?", [step])
        parts = -(-n // cap)
        if parts <= 1:
            out.append((cond, params))
            continue
        cuts = cur.execute(f"SELECT quantile_disc(trace_id, ?) FROM {table} WHERE {cond}",
                           [[i / parts for i in range(1, parts)], *params]).fetchall()[0][0]
        edges = [None, *sorted(set(cuts)), None]
        for lo, hi in itertools.pairwise(edges):
            parts_sql = [cond] + (["trace_id >= ?"] if lo is not None else []) + \
                (["trace_id < ?"] if hi is not None else [])  # fmt: skip
            out.append((" AND ".join(parts_sql),
                        [*params, *([lo] if lo is not None else []),
                         *([hi] if hi is not None else [])]))  # fmt: skip
    flush()
    return out


def parse_bytes(size: str) -> int:
    """``"1GB"``, ``"512MiB"``, ``"64 MB"`` -> bytes (DuckDB's memory_limit syntax)."""
    import re

    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?i?B)?\s*", size, re.IGNORECASE)
    if not m:
        raise ValueError(f"memory limit {size!r}: expected a size such as 1GB or 512MB")
    unit = (m.group(2) or "B").upper()
    power = "BKMGT".index(unit[0]) if unit[0] in "KMGT" else 0
    return int(float(m.group(1)) * (1024 if "I" in unit else 1000) ** power)


def summary(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "summary.json"), encoding="utf-8") as fh:
        return dict(json.load(fh))



def pylist(table: Any) -> list[dict[str, Any]]:
    """Rows as dicts, a map column (``reward_parts``) as a dict, as DuckDB gives it (Arrow
    gives a list of pairs)."""
    import pyarrow as pa

    rows = table.to_pylist()
    for field in table.schema:
        if pa.types.is_map(field.type):
            for row in rows:
                if row[field.name] is not None:
                    row[field.name] = dict(row[field.name])
    return list(rows)

class Rows:
    """Rows of one Parquet file by row number (the file's own order)."""

    def __init__(self, path: str) -> None:
        import pyarrow.parquet as pq

        self.file = pq.ParquetFile(path)
        self.lock = threading.Lock()  # one reader, requests on several threads
        self.starts, n = [], 0
        for i in range(self.file.metadata.num_row_groups):
            self.starts.append(n)
            n += self.file.metadata.row_group(i).num_rows

    def take(self, numbers: list[int], columns: list[str] | None = None) -> list[dict[str, Any]]:
        """The rows at ``numbers``, in that order; reads only their row groups."""
        import pyarrow as pa

        if not numbers:
            return []
        where = [bisect.bisect_right(self.starts, n) - 1 for n in numbers]
        groups = sorted(set(where))
        with self.lock:
            table = self.file.read_row_groups(groups, columns=columns)
        offset, at = 0, {}
        for g in groups:
            at[g] = offset
            offset += self.file.metadata.row_group(g).num_rows
        take = [at[g] + n - self.starts[g] for n, g in zip(numbers, where, strict=True)]
        return pylist(table.take(pa.array(take)))


class Mapped:
    """Rows of a memory-mapped Arrow file by row number (nothing is read until a row is)."""

    def __init__(self, path: str) -> None:
        import pyarrow as pa

        reader = pa.ipc.open_file(pa.memory_map(path))
        self.names = set(reader.schema.names)
        # views into the mapped file (immutable, so safe to share between threads)
        self.batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        self.starts, n = [], 0
        for b in self.batches:
            self.starts.append(n)
            n += b.num_rows

    def take(self, numbers: list[int], columns: list[str]) -> list[dict[str, Any]]:
        import pyarrow as pa

        if not numbers:
            return []
        pieces = []
        for n in numbers:
            g = bisect.bisect_right(self.starts, n) - 1
            pieces.append(self.batches[g].select(columns).slice(n - self.starts[g], 1))
        return pylist(pa.Table.from_batches(pieces))


class Sorted:
    """A Parquet file sorted by ``keys`` (``step, trace_id`` or ``trace_id``): the rows of one
    key, read from the row groups whose min/max statistics can hold it: its own (two where
    its rows cross an edge), plus those holding the end of one step and the start of the next,
    whose trace id range is the union of both."""

    def __init__(self, path: str, keys: tuple[str, ...]) -> None:
        import pyarrow.parquet as pq

        self.file = pq.ParquetFile(path)
        self.lock = threading.Lock()
        self.keys = keys
        md = self.file.metadata
        index = {md.schema.column(i).name: i for i in range(md.num_columns)}
        # per row group, per key: (min, max) of its non-null values, or None (no statistics:
        # the group may hold anything)
        self.bounds: list[list[tuple[Any, Any] | None]] = []
        for g in range(md.num_row_groups):
            rg, row = md.row_group(g), []
            for k in keys:
                st = rg.column(index[k]).statistics
                row.append((_text(st.min), _text(st.max)) if st is not None and st.has_min_max
                           else None)  # fmt: skip
            self.bounds.append(row)
        # the leading key is sorted, so are its maxima: bisect to the first candidate
        lead = [b[0] for b in self.bounds]
        self.maxima = None if None in lead else [b[1] for b in lead if b is not None]

    def groups(self, *key: Any) -> list[int]:
        start = bisect.bisect_left(self.maxima, key[0]) if self.maxima is not None else 0
        out = []
        for g in range(start, len(self.bounds)):
            b = self.bounds[g]
            lead = b[0]
            if lead is not None and lead[0] > key[0]:
                break  # sorted: no later row group holds the key
            if all(r is None or r[0] <= v <= r[1] for r, v in zip(b, key, strict=True)):
                out.append(g)
        return out

    def find(self, *key: Any, columns: list[str] | None = None) -> Any:
        """A pyarrow Table of the rows whose keys equal ``key`` (``columns``, or all)."""
        import pyarrow.compute as pc

        names = columns or self.file.schema_arrow.names
        groups = self.groups(*key)
        if not groups:
            return self.file.schema_arrow.empty_table().select(names)
        wanted = list(dict.fromkeys([*self.keys, *names]))
        with self.lock:
            table = self.file.read_row_groups(groups, columns=wanted)
        mask = None
        for k, v in zip(self.keys, key, strict=True):
            m = pc.equal(table[k], v)
            mask = m if mask is None else pc.and_(mask, m)
        return table.filter(mask).select(names)


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v
