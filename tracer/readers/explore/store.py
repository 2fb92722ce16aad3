"""The explorer's queries: DuckDB views over one or more export folders (nothing is loaded into
memory; each request reads what its page needs from the Parquet files).

Once an export's compacted copy is built (compact.py), a list is two scans of its large row
groups (the page's row numbers; count, mean and histogram in one aggregate, kept
for repeated filters) and a read of the page's rows from small row groups; one trajectory is
read with pyarrow from the row groups its (step, trace_id) falls in. Before that, the same
answers come from DuckDB queries over the export's own files.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass
from typing import Any

from tracer.readers.explore import compact as compacted
from tracer.readers.explore.cache import LRU, prune_folder, touch
from tracer.readers.explore.filters import (
    ApiError,
    Where,
    parse_columns,
    parse_filters,
    parse_sort,
)

TABLES = ("trajectories", "turns", "tool_calls", "tokens")
LIST_COLUMNS = ["trace_id", "step", "sample_key", "rollout_n", "validate", "reward",
                "num_turns", "num_tool_errors", "finish_reason", "response_tokens", "flags",
                "worker_id", "prompt"]  # fmt: skip
TOKEN_FIELDS = ("rollout_logprob", "train_logprob", "ref_logprob", "entropy", "mismatch_kl",
                "ref_kl")  # fmt: skip  (the report's order: tracer/readers/token_report.py)
TRANSCRIPT_METRICS = ("rollout_logprob", "mismatch_kl", "ref_kl", "entropy")
SIGN = {"rollout_logprob": -1.0}  # drawn as -log p, as in the report
HIST_BINS = 20
# in-memory answers kept (per-filter counts and histograms, steps, scales): bounded by both
CACHE_ENTRIES = 512
CACHE_BYTES = 32 * 2**20
MEMORY_LIMIT = "1GB"  # DuckDB's, for the queries and the compacted copy's sorts
# compacted copies kept in the cache folder besides those in use (older ones are deleted)
KEEP_COMPACTED = 2


@dataclass
class Run:
    name: str
    path: str
    tables: set[str]
    mlflow: dict[str, str] | None = None  # {"ui": base URL, "experiment_id": id}
    data: str | None = None  # where the tables are read from: path, or its compacted copy

    @property
    def folder(self) -> str:
        return self.data or self.path


class Store:
    """Read-only queries over the runs' Parquet tables; one DuckDB connection, a cursor per
    request (DuckDB cursors are safe to use from one thread each)."""

    def __init__(self, runs: list[Run], threads: int = 2, cache_entries: int = CACHE_ENTRIES,
                 cache_bytes: int = CACHE_BYTES,
                 memory_limit: str = MEMORY_LIMIT) -> None:  # fmt: skip
        import duckdb

        if not runs:
            raise ValueError("no export folder to explore")
        self.runs = {r.name: r for r in runs}
        self.threads, self.memory_limit = threads, memory_limit
        # a bound on DuckDB's memory (its default is 80% of the machine's); the compacted
        # copy's sorts spill to disk (8.7 GB peak RSS for a million trajectories without it)
        self._db = duckdb.connect(":memory:", config={"threads": threads,
                                                      "memory_limit": memory_limit})  # fmt: skip
        self._db.execute("LOAD parquet")
        # the footers of a million-trajectory export hold ~100k column chunks: parse them once,
        # not on every query
        self._db.execute("SET parquet_metadata_cache = true")
        self._lock = threading.Lock()
        self.stop = threading.Event()  # set by close(): background work ends early
        self._building: set[Any] = set()  # connections of compactions under way
        self.cache = LRU(cache_entries, cache_bytes)
        # per run (a fixed set): the open Parquet files of its compacted copy or export
        self._files: dict[str, dict[str, Any]] = {}
        self._view = {run.name: f"r{i}" for i, run in enumerate(runs)}
        for run in runs:
            self._attach(run)

    def _attach(self, run: Run) -> None:
        tables = set()
        for table in TABLES:
            file = os.path.join(run.folder, f"{table}.parquet")
            if os.path.exists(file):
                tables.add(table)
                rownum = ", file_row_number = true" if table == "trajectories" else ""
                self._db.execute(f"CREATE OR REPLACE VIEW {self._view[run.name]}_{table} AS "
                                 f"SELECT * FROM read_parquet({compacted.quote(file)}"
                                 f"{rownum})")  # fmt: skip
            elif table != "tokens":
                raise FileNotFoundError(f"{file} is missing: is {run.path} an export folder?")
        run.tables = tables
        with self._lock:
            self._files.pop(run.name, None)
        self.cache.clear()

    def compact(self, name: str, cache_dir: str) -> str:
        """Build run ``name``'s compacted copy in ``cache_dir`` (once per export; see
        compact.py) and read from it; older copies beyond
        ``KEEP_COMPACTED`` are deleted."""
        from tracer.readers.explore.search import signature

        run = self.runs[name]
        folder = os.path.join(cache_dir, "compact")
        out = os.path.join(folder, signature(run.path) + f"-v{compacted.VERSION}")
        if not os.path.exists(os.path.join(out, "summary.json")):
            compacted.build(run.path, run.tables, out, self.threads, self.memory_limit,
                            self.stop, self._building)  # fmt: skip
        touch(out)
        run.data = out
        self._attach(run)
        for kind in ("rows", "mapped", "ids", *compacted.PER_TRAJECTORY):
            self._file(name, kind)  # parse the footers now, not in the first request
        if "tokens" in run.tables:
            self.scales(name)
        prune_folder(folder, {os.path.basename(r.data) for r in self.runs.values() if r.data},
                     KEEP_COMPACTED)  # fmt: skip
        return out

    def close(self) -> None:
        """Stop background work: a compaction under way is interrupted (its folder stays
        ``.building``, rebuilt next time), and so is any running query."""
        self.stop.set()
        for con in list(self._building):
            con.interrupt()
        self._db.interrupt()

    def repoint(self, name: str, path: str) -> None:
        """Serve run ``name`` from the export folder ``path`` from now on (a refresh)."""
        run = self.runs[name]
        run.path, run.data = path, None
        self._attach(run)

    # ---------------------------------------------------------------- plumbing
    def query(self, sql: str, params: list[Any] | tuple[Any, ...] = (),
              timeout: float | None = None) -> list[dict[str, Any]]:  # fmt: skip
        """The rows of ``sql``; past ``timeout`` seconds the query is interrupted and
        TimeoutError raised."""
        import duckdb

        cur = self._db.cursor()
        expired = threading.Event()

        def interrupt() -> None:
            expired.set()  # before the interrupt: the query's thread reads it after
            cur.interrupt()

        timer = None if timeout is None else threading.Timer(max(timeout, 0.0), interrupt)
        try:
            if timer is not None:
                timer.start()
            res = cur.execute(sql, list(params))
            names = [d[0] for d in res.description]
            return [dict(zip(names, row, strict=True)) for row in res.fetchall()]
        except duckdb.InterruptException:
            if expired.is_set() and not self.stop.is_set():
                raise TimeoutError(f"query interrupted after {timeout:.1f} s") from None
            raise
        finally:
            if timer is not None:
                timer.cancel()
            cur.close()

    def table(self, run: str | None, table: str) -> str:
        name = run or next(iter(self.runs))
        if name not in self._view:
            raise ApiError(f"unknown run {name!r}; runs: {', '.join(self.runs)}", 404)
        return f"{self._view[name]}_{table}"

    def has_column(self, run: str | None, column: str, table: str = "trajectories") -> bool:
        """Whether the run's ``table`` has ``column`` (an older export may not)."""
        t = self.table(run, table)
        key = ("columns", t, self.runs[run or next(iter(self.runs))].folder)
        names = self.cached(key, lambda: [r["column_name"] for r in
                                          self.query(f"DESCRIBE SELECT * FROM {t}")])  # fmt: skip
        return column in names

    def cached(self, key: tuple[Any, ...], make: Any) -> Any:
        """The in-memory answer kept under ``key``, or ``make()``'s (then kept)."""
        return self.cache.get(key, make)

    def _file(self, run: str | None, kind: str) -> Any:
        """Run ``run``'s open file ``kind``: ``rows`` (trajectories by row number), or, in a
        compacted copy only (else None), ``ids`` and the per-trajectory tables by key."""
        name = run or next(iter(self.runs))
        r = self.runs[name]
        with self._lock:
            files = self._files.setdefault(name, {})
            if kind not in files:
                if kind == "rows":
                    file = "rows" if r.data else "trajectories"
                    files[kind] = compacted.Rows(os.path.join(r.folder, f"{file}.parquet"))
                elif kind == "mapped":
                    files[kind] = compacted.Mapped(os.path.join(r.data, "rows.arrow")) \
                        if r.data else None  # fmt: skip
                elif not r.data or (kind != "ids" and kind not in r.tables):
                    files[kind] = None
                else:
                    keys = ("trace_id",) if kind == "ids" else ("step", "trace_id")
                    files[kind] = compacted.Sorted(os.path.join(r.data, f"{kind}.parquet"), keys)
            return files[kind]

    # ---------------------------------------------------------------- endpoints
    def run_list(self) -> list[dict[str, Any]]:
        return [{"name": r.name, "path": r.path, "compacted": r.data, "tables": sorted(r.tables),
                 "trajectories": self._summary(r.name)["trajectories"], "mlflow": r.mlflow}
                for r in self.runs.values()]  # fmt: skip

    def _summary(self, run: str | None) -> dict[str, Any]:
        """Row count and reward range of the run: written with its compacted copy, else one
        query (kept)."""
        name = run or next(iter(self.runs))
        r, t = self.runs[name], self.table(name, "trajectories")

        def make() -> dict[str, Any]:
            if r.data:
                return compacted.summary(r.data)
            row = self.query(f"SELECT count(*) n, min(reward) lo, max(reward) hi FROM {t}")[0]
            return {"trajectories": row["n"], "reward_lo": row["lo"], "reward_hi": row["hi"]}

        return dict(self.cached(("summary", name, r.folder), make))

    def list_page(self, query: dict[str, list[str]], run: str | None, page: int, size: int,
             sort: str | None, columns: str | None,
             hist: bool = True) -> dict[str, Any]:  # fmt: skip
        t = self.table(run, "trajectories")
        where = parse_filters(query)
        cols = parse_columns(columns, LIST_COLUMNS)
        # ties keep the export's order (the row number: unique, and an integer, where
        # trace_id made the sort read a million strings: 3-5x slower)
        order = parse_sort(sort, tiebreak="file_row_number")
        # late materialization: the sort reads only the filter and sort columns; the page's
        # other columns are read for its rows alone: slices of the compacted copy's mapped
        # Arrow file, else DuckDB by row number (its own late materialization stops at large
        # offsets)
        keys = self.query(f"SELECT file_row_number AS rn FROM {t} WHERE {where.sql} ORDER "
                          f"BY {order} LIMIT ? OFFSET ?",
                          [*where.params, size, page * size])  # fmt: skip
        numbers = [int(k["rn"]) for k in keys]
        mapped = self._file(run, "mapped")
        if mapped is not None and mapped.names.issuperset(cols):
            rows = mapped.take(numbers, cols)
        else:
            rows = self._fetch(t, cols, numbers)
        out: dict[str, Any] = {"page": page, "size": size, "columns": cols, "rows": rows}
        stats = self._selection(run, t, where)
        out["total"] = stats["total"]
        out["reward_mean"] = stats["reward_mean"]
        if hist:
            out["histogram"] = stats["histogram"]
        return out

    def _fetch(self, t: str, cols: list[str], numbers: list[int]) -> list[dict[str, Any]]:
        """Rows of the trajectories view by row number, in that order."""
        found = {r.pop("rn__"): r for r in self.query(
            f"SELECT {_names(cols)}, file_row_number AS rn__ FROM {t} WHERE file_row_number "
            f"IN ({', '.join('?' * len(numbers))})", numbers)} if numbers else {}  # fmt: skip
        return [found[n] for n in numbers]

    def _selection(self, run: str | None, t: str, where: Where) -> dict[str, Any]:
        """Count, mean reward and reward histogram of a filter, in one scan, kept for the
        filter's next page or sort. The bins divide the run's whole reward range (so
        selections compare), less the empty ones at either end."""
        info = self._summary(run)
        lo, hi = info["reward_lo"], info["reward_hi"]

        def make() -> dict[str, Any]:
            if lo is None:  # no rewards at all
                n = self.query(f"SELECT count(*) n FROM {t} WHERE {where.sql}", where.params)
                return {"total": int(n[0]["n"]), "reward_mean": None, "histogram": []}
            width = (hi - lo) / HIST_BINS or 1.0
            rows = self.query(f"SELECT least(CAST(floor((reward - ?) / ?) AS BIGINT), "
                              f"{HIST_BINS - 1}) b, count(*) n, count(reward) k, sum(reward) s "
                              f"FROM {t} WHERE {where.sql} GROUP BY b",
                              [lo, width, *where.params])  # fmt: skip
            counts = {int(r["b"]): int(r["n"]) for r in rows if r["b"] is not None}
            k = sum(int(r["k"]) for r in rows)
            bins = [{"lo": lo + i * width, "hi": lo + (i + 1) * width if hi > lo else hi,
                     "count": counts.get(i, 0)}
                    for i in range(HIST_BINS if hi > lo else 1)]  # fmt: skip
            used = [i for i, b in enumerate(bins) if b["count"]]
            return {"total": sum(int(r["n"]) for r in rows),
                    "reward_mean": sum(r["s"] for r in rows if r["s"] is not None) / k if k
                    else None, "histogram": bins[used[0]:used[-1] + 1] if used else []}  # fmt: skip

        key = ("selection", run or next(iter(self.runs)), t, where.sql, repr(where.params))
        return dict(self.cached(key, make))

    def locate(self, run: str | None, trace_id: str, step: int | None = None) -> dict[str, Any]:
        """The trajectory's row: by id in the compacted copy; else ``step`` (when the caller
        knows it) limits the read to that step's row groups, instead of every trace id."""
        t = self.table(run, "trajectories")
        if not re.fullmatch(r"[0-9a-fA-F-]{1,64}", trace_id or ""):
            raise ApiError(f"id: {trace_id[:80]!r} is not a trace id (hex)")
        rows: list[dict[str, Any]] = []
        ids = self._file(run, "ids")
        if ids is not None:
            found = ids.find(trace_id, columns=["rn"]).column("rn").to_pylist()
            rows = self._file(run, "rows").take(found[:1])
        else:
            if step is not None:
                rows = self.query(f"SELECT * EXCLUDE (file_row_number) FROM {t} WHERE step = ? "
                                  "AND trace_id = ?", [step, trace_id])  # fmt: skip
            if not rows:  # no step given, or a wrong one
                rows = self.query(f"SELECT * EXCLUDE (file_row_number) FROM {t} WHERE "
                                  "trace_id = ?", [trace_id])  # fmt: skip
        if not rows:
            raise ApiError(f"no trajectory {trace_id!r} in run {run or next(iter(self.runs))}",
                           404)  # fmt: skip
        return rows[0]

    def _per_trajectory(self, run: str | None, table: str, step: Any, trace_id: str,
                        columns: list[str], order: str) -> list[dict[str, Any]]:  # fmt: skip
        """One trajectory's rows of ``table``, ordered by ``order``: from the row groups its
        key falls in (compacted copy), else a DuckDB query pruned by the step's statistics."""
        found = self._file(run, table) if step is not None else None
        if found is not None:
            return compacted.pylist(found.find(step, trace_id, columns=columns).sort_by(order))
        cond, params = ("step = ? AND trace_id = ?", [step, trace_id]) if step is not None \
            else ("step IS NULL AND trace_id = ?", [trace_id])  # fmt: skip
        return self.query(f"SELECT {_names(columns)} FROM {self.table(run, table)} WHERE {cond} "
                          f"ORDER BY {order}", params)  # fmt: skip

    def turn_texts(self, run: str | None, step: Any, trace_id: str) -> list[str | None]:
        """One trajectory's responses, turn by turn."""
        rows = self._per_trajectory(run, "turns", step, trace_id,
                                    ["turn_index", "response_text"], "turn_index")  # fmt: skip
        return [r["response_text"] for r in rows]

    def trajectory(self, run: str | None, trace_id: str, step: int | None = None) -> dict[str, Any]:
        from tracer.readers.schema import arrow_schema

        row = self.locate(run, trace_id, step)
        step = row["step"]
        r = self.runs[run or next(iter(self.runs))]

        def columns(table: str, without: tuple[str, ...] = ()) -> list[str]:
            return [c for c in arrow_schema(table).names
                    if c not in without and self.has_column(run, c, table)]  # fmt: skip

        turns = self._per_trajectory(run, "turns", step, trace_id,
                                     columns("turns", ("logprobs",)), "turn_index")  # fmt: skip
        calls = self._per_trajectory(run, "tool_calls", step, trace_id, columns("tool_calls"),
                                     "call_index")  # fmt: skip
        out: dict[str, Any] = {"trajectory": row, "turns": turns, "tool_calls": calls, "tokens": {},
               "token_fields": list(TOKEN_FIELDS), "scales": {}, "token_text": False}  # fmt: skip
        if "tokens" in r.tables:
            toks = self._per_trajectory(run, "tokens", step, trace_id,
                                        ["turn", "position", "token", "token_id", "loss_mask",
                                         *TOKEN_FIELDS], "position")  # fmt: skip
            toks = [tok for tok in toks if tok["loss_mask"] == 1]
            # per token: its text (None when the export had no tokenizer), the values, its id
            for tok in toks:
                out["tokens"].setdefault(str(tok["turn"]), []).append(
                    [tok["token"], *(_round(tok[f]) for f in TOKEN_FIELDS), tok["token_id"]])
            out["token_text"] = bool(toks) and all(tok["token"] is not None for tok in toks)
            if toks:
                out["scales"] = self.scales(run, step)
        if r.mlflow:
            base = r.mlflow["ui"].rstrip("/")
            out["mlflow_url"] = (f"{base}/#/experiments/{r.mlflow['experiment_id']}/traces"
                                 f"?selectedEvaluationId=tr-{trace_id}")  # fmt: skip
        return out

    def scales(self, run: str | None, step: Any = None) -> dict[str, float]:
        """Per metric, the value drawn darkest: the 99th percentile of ``sign * value`` over
        model tokens, as in the report, estimated once per run from up to 16 row groups spread
        over the tokens file (the whole table can hold billions of values)."""
        name = run or next(iter(self.runs))

        def make() -> dict[str, float]:
            import pyarrow.compute as pc
            import pyarrow.parquet as pq

            f = pq.ParquetFile(os.path.join(self.runs[name].folder, "tokens.parquet"))
            n = f.metadata.num_row_groups
            picks = sorted({i * n // 16 for i in range(16)}) if n else []
            table = f.read_row_groups(picks, columns=["loss_mask", *TRANSCRIPT_METRICS])
            table = table.filter(pc.equal(table["loss_mask"], 1))
            out = {}
            for m in TRANSCRIPT_METRICS:
                col = pc.drop_null(pc.multiply(table[m], SIGN.get(m, 1.0)))
                if len(col):
                    v = pc.quantile(col, q=0.99)[0].as_py()
                    out[m] = v if v and v > 0 else 1.0
            return out

        return dict(self.cached(("scales", name), make))


def _names(columns: list[str]) -> str:
    """Column names checked against the export schema (never other input), quoted."""
    return ", ".join(f'"{c}"' for c in columns)


def _round(v: Any) -> Any:
    return None if v is None or v != v else float(f"{v:.6g}")
