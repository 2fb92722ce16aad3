"""The explorer's queries: DuckDB views over one or more export folders (nothing is loaded into
memory; each request reads what its page needs from the Parquet files).

Lookups of one trajectory's turns, tool calls and tokens add its ``step`` to the ``trace_id``
condition: an export writes its row groups in step order, so the step's min/max statistics let
DuckDB skip every other row group (a random hex id alone cannot).
"""

from __future__ import annotations

import difflib
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

from rollout.explore.filters import ApiError, Where, parse_columns, parse_filters, parse_sort

TABLES = ("trajectories", "turns", "tool_calls", "tokens")
LIST_COLUMNS = ["trace_id", "step", "sample_key", "rollout_n", "validate", "reward",
                "num_turns", "num_tool_errors", "finish_reason", "response_tokens", "flags",
                "worker_id", "prompt"]  # fmt: skip
TOKEN_FIELDS = ("rollout_logprob", "train_logprob", "ref_logprob", "entropy", "mismatch_kl",
                "ref_kl")  # fmt: skip  (the report's order: tracer/readers/token_report.py)
TRANSCRIPT_METRICS = ("rollout_logprob", "mismatch_kl", "ref_kl", "entropy")
SIGN = {"rollout_logprob": -1.0}  # drawn as -log p, as in the report
HIST_BINS = 20
COMPACT_VERSION = 3
MAX_PROMPT_ROWS = 400
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


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


def _quote(path: str) -> str:
    return "'" + path.replace("'", "''") + "'"


class Store:
    """Read-only queries over the runs' Parquet tables; one DuckDB connection, a cursor per
    request (DuckDB cursors are safe to use from one thread each)."""

    def __init__(self, runs: list[Run], threads: int = 2) -> None:
        import duckdb

        if not runs:
            raise ValueError("no export folder to explore")
        self.runs = {r.name: r for r in runs}
        # the footers of a million-trajectory export hold ~100k column chunks: parse them once,
        # not on every query
        self._db = duckdb.connect(":memory:", config={"threads": threads})
        self._db.execute("LOAD parquet")
        self._db.execute("SET parquet_metadata_cache = true")
        self._lock = threading.Lock()
        self._cache: dict[tuple[Any, ...], Any] = {}
        self._files: dict[str, tuple[Any, list[int]]] = {}
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
                                 f"SELECT * FROM read_parquet({_quote(file)}{rownum})")  # fmt: skip
            elif table != "tokens":
                raise FileNotFoundError(f"{file} is missing: is {run.path} an export folder?")
        run.tables = tables
        with self._lock:
            self._files.pop(run.name, None)
            self._cache.clear()

    def compact(self, name: str, cache_dir: str) -> str:
        """Copy run ``name``'s tables into ``cache_dir`` with large row groups (same rows, same
        order, so row numbers still match) and read them from there. An export writes one
        row group per page of 500 trajectories; DuckDB pays per row group, and a million
        trajectories in 2,000 of them make every query 10-30x slower. Done once per export."""
        from rollout.explore.search import signature

        run = self.runs[name]
        out = os.path.join(cache_dir, "compact", signature(run.path) + f"-v{COMPACT_VERSION}")
        if not os.path.exists(os.path.join(out, "done")):
            tmp = out + ".building"
            os.makedirs(tmp, exist_ok=True)
            cur = self._db.cursor()
            try:
                cur.execute(f"SET temp_directory = {_quote(tmp)}")  # a sort may spill
                for table in sorted(run.tables):
                    src = os.path.join(run.path, f"{table}.parquet")
                    # trajectories keep their order (row numbers); the per-trajectory tables
                    # are sorted by (step, trace_id) in small row groups, so one trajectory's
                    # rows are found in one row group by its min/max statistics
                    order = "" if table == "trajectories" else " ORDER BY step, trace_id"
                    cur.execute(f"COPY (SELECT * FROM read_parquet({_quote(src)}){order}) TO "
                                f"{_quote(os.path.join(tmp, table + '.parquet'))} (FORMAT "
                                "parquet, COMPRESSION zstd, ROW_GROUP_SIZE 16384)")  # fmt: skip
            finally:
                cur.execute("RESET temp_directory")
                cur.close()
            open(os.path.join(tmp, "done"), "w").close()
            if os.path.isdir(out):
                import shutil

                shutil.rmtree(out)
            os.replace(tmp, out)
        run.data = out
        self._attach(run)
        return out

    def repoint(self, name: str, path: str) -> None:
        """Serve run ``name`` from the export folder ``path`` from now on (a refresh)."""
        run = self.runs[name]
        run.path, run.data = path, None
        self._attach(run)
        with self._lock:
            self._cache.clear()

    # ---------------------------------------------------------------- plumbing
    def _rows(self, sql: str, params: list[Any] | tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        cur = self._db.cursor()
        try:
            res = cur.execute(sql, list(params))
            names = [d[0] for d in res.description]
            return [dict(zip(names, row, strict=True)) for row in res.fetchall()]
        finally:
            cur.close()

    def table(self, run: str | None, table: str) -> str:
        name = run or next(iter(self.runs))
        if name not in self._view:
            raise ApiError(f"unknown run {name!r}; runs: {', '.join(self.runs)}", 404)
        return f"{self._view[name]}_{table}"

    def _cached(self, key: tuple[Any, ...], make: Any) -> Any:
        with self._lock:
            if key in self._cache:
                return self._cache[key]
        value = make()
        with self._lock:
            self._cache[key] = value
        return value

    # ---------------------------------------------------------------- endpoints
    def run_list(self) -> list[dict[str, Any]]:
        return [{"name": r.name, "path": r.path, "compacted": r.data, "tables": sorted(r.tables),
                 "trajectories": self._count(r.name), "mlflow": r.mlflow}
                for r in self.runs.values()]  # fmt: skip

    def _count(self, run: str) -> int:
        t = self.table(run, "trajectories")
        return int(self._cached(("count", run), lambda: self._rows(
            f"SELECT count(*) n FROM {t}")[0]["n"]))  # fmt: skip

    def list_page(self, query: dict[str, list[str]], run: str | None, page: int, size: int,
             sort: str | None, columns: str | None,
             hist: bool = True) -> dict[str, Any]:  # fmt: skip
        t = self.table(run, "trajectories")
        where = parse_filters(query)
        cols = parse_columns(columns, LIST_COLUMNS)
        order = parse_sort(sort)
        # late materialization: the sort reads only the filter and sort columns; the page's
        # other columns are read for its rows alone, from their row groups, with pyarrow
        keys = self._rows(f"SELECT file_row_number AS rn FROM {t} WHERE {where.sql} ORDER "
                          f"BY {order} LIMIT ? OFFSET ?",
                          [*where.params, size, page * size])  # fmt: skip
        rows = self._by_row_numbers(run, cols, [int(k["rn"]) for k in keys])
        out: dict[str, Any] = {"page": page, "size": size, "columns": cols, "rows": rows}
        stats = self._rows(f"SELECT count(*) n, min(reward) lo, max(reward) hi, avg(reward) "
                           f"mean FROM {t} WHERE {where.sql}", where.params)[0]  # fmt: skip
        out["total"] = int(stats["n"])
        out["reward_mean"] = stats["mean"]
        if hist:
            out["histogram"] = self._histogram(t, where, stats["lo"], stats["hi"])
        return out

    def _by_row_numbers(self, run: str | None, cols: list[str], numbers: list[int]) -> Any:
        """The rows at these positions of the trajectories file, read with pyarrow from their
        row groups only (one page touches at most ``size`` row groups)."""
        import bisect

        import pyarrow as pa

        if not numbers:
            return []
        f, starts = self._file(run or next(iter(self.runs)))
        groups = sorted({bisect.bisect_right(starts, n) - 1 for n in numbers})
        table = f.read_row_groups(groups, columns=cols)
        offset, at = 0, {}
        for g in groups:
            at[g] = offset
            offset += f.metadata.row_group(g).num_rows
        take = [at[g] + n - starts[g] for n in numbers
                for g in [bisect.bisect_right(starts, n) - 1]]  # fmt: skip
        return table.take(pa.array(take)).to_pylist()

    def _file(self, run: str) -> tuple[Any, list[int]]:
        import pyarrow.parquet as pq

        with self._lock:
            if run not in self._files:
                f = pq.ParquetFile(os.path.join(self.runs[run].folder, "trajectories.parquet"))
                starts, n = [], 0
                for i in range(f.metadata.num_row_groups):
                    starts.append(n)
                    n += f.metadata.row_group(i).num_rows
                self._files[run] = (f, starts)
            return self._files[run]

    def _histogram(self, t: str, where: Where, lo: Any, hi: Any) -> list[dict[str, Any]]:
        if lo is None:
            return []
        width = (hi - lo) / HIST_BINS or 1.0
        rows = self._rows(f"SELECT least(CAST(floor((reward - ?) / ?) AS BIGINT), {HIST_BINS - 1})"
                          f" b, count(*) n FROM {t} WHERE {where.sql} AND reward IS NOT NULL "
                          "GROUP BY b ORDER BY b", [lo, width, *where.params])  # fmt: skip
        counts = {int(r["b"]): int(r["n"]) for r in rows}
        bins = HIST_BINS if hi > lo else 1
        return [{"lo": lo + i * width, "hi": lo + (i + 1) * width if hi > lo else hi,
                 "count": counts.get(i, 0)} for i in range(bins)]  # fmt: skip

    def locate(self, run: str | None, trace_id: str, step: int | None = None) -> dict[str, Any]:
        """The trajectory's row; ``step`` (when the caller knows it) limits the read to that
        step's row groups, instead of every trace id of the table."""
        t = self.table(run, "trajectories")
        if not re.fullmatch(r"[0-9a-fA-F-]{1,64}", trace_id or ""):
            raise ApiError(f"id: {trace_id[:80]!r} is not a trace id (hex)")
        rows = []
        if step is not None:
            rows = self._rows(f"SELECT * EXCLUDE (file_row_number) FROM {t} WHERE step = ? "
                              "AND trace_id = ?", [step, trace_id])  # fmt: skip
        if not rows:  # no step given, or a wrong one
            rows = self._rows(f"SELECT * EXCLUDE (file_row_number) FROM {t} WHERE trace_id = ?",
                              [trace_id])  # fmt: skip
        if not rows:
            raise ApiError(f"no trajectory {trace_id!r} in run {run or next(iter(self.runs))}",
                           404)  # fmt: skip
        return rows[0]

    def trajectory(self, run: str | None, trace_id: str, step: int | None = None) -> dict[str, Any]:
        row = self.locate(run, trace_id, step)
        step = row["step"]
        cond, params = ("step = ? AND trace_id = ?", [step, trace_id]) if step is not None \
            else ("step IS NULL AND trace_id = ?", [trace_id])  # fmt: skip
        turns = self._rows(f"SELECT * EXCLUDE (logprobs) FROM {self.table(run, 'turns')} "
                           f"WHERE {cond} ORDER BY turn_index", params)  # fmt: skip
        calls = self._rows(f"SELECT * FROM {self.table(run, 'tool_calls')} WHERE {cond} "
                           "ORDER BY call_index", params)  # fmt: skip
        out: dict[str, Any] = {"trajectory": row, "turns": turns, "tool_calls": calls, "tokens": {},
               "token_fields": list(TOKEN_FIELDS), "scales": {}}  # fmt: skip
        r = self.runs[run or next(iter(self.runs))]
        if "tokens" in r.tables:
            toks = self._rows(
                f"SELECT turn, coalesce(token, '⟨' || token_id || '⟩') AS token, "
                f"{', '.join(TOKEN_FIELDS)} FROM {self.table(run, 'tokens')} WHERE {cond} "
                "AND loss_mask = 1 ORDER BY position", params)  # fmt: skip
            for tok in toks:
                out["tokens"].setdefault(str(tok["turn"]), []).append(
                    [tok["token"], *(_round(tok[f]) for f in TOKEN_FIELDS)])
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

        return dict(self._cached(("scales", name), make))

    def groups(self, run: str | None, step: int, validate: bool, page: int, size: int,
               zero_only: bool) -> dict[str, Any]:  # fmt: skip
        t = self.table(run, "trajectories")
        having = "HAVING count(*) > 1 AND min(reward) = max(reward)" if zero_only else ""
        base = (f"SELECT sample_key, any_value(prompt) prompt, count(*) n, avg(reward) mean, "
                f"stddev_pop(reward) std, min(reward) = max(reward) AND count(*) > 1 zero_variance,"
                f" list({{'trace_id': trace_id, 'rollout_n': rollout_n, 'reward': reward, "
                f"'finish_reason': finish_reason, 'response_tokens': response_tokens, "
                f"'num_tool_errors': num_tool_errors, 'response_text': left(response_text, 300)}}"
                f" ORDER BY rollout_n) rollouts FROM {t} WHERE step = ? AND validate = ? "
                f"GROUP BY sample_key {having}")  # fmt: skip
        rows = self._rows(f"{base} ORDER BY TRY_CAST(sample_key AS BIGINT), sample_key "
                          "LIMIT ? OFFSET ?", [step, validate, size, page * size])  # fmt: skip
        total = self._rows(f"SELECT count(*) n, count(*) FILTER (zero_variance) z FROM ({base})",
                           [step, validate])[0]  # fmt: skip
        for g in rows:
            std = g["std"] or 0.0
            for r in g["rollouts"]:
                rew = r["reward"]
                r["advantage"] = None if rew is None else (rew - g["mean"]) / (std + 1e-6)
        return {"step": step, "validate": validate, "page": page, "size": size,
                "total": int(total["n"]), "zero_variance": int(total["z"]),
                "groups": rows}  # fmt: skip

    def prompt(self, run: str | None, trace_id: str | None, text: str | None,
               step: int | None = None) -> dict[str, Any]:  # fmt: skip
        """Every rollout of one prompt (the one of ``trace_id``, or ``text``), by step, with the
        word diff of each step's first response against the previous step's."""
        if trace_id:
            text = self.locate(run, trace_id, step)["prompt"]
        if not text:
            raise ApiError("prompt: give id=<trace id> or prompt=<text>")
        t = self.table(run, "trajectories")
        rows = self._rows(f"SELECT trace_id, step, validate, sample_key, rollout_n, reward, "
                          f"finish_reason, response_text FROM {t} WHERE prompt = ? "
                          "ORDER BY step NULLS LAST, validate, rollout_n LIMIT ?",
                          [text, MAX_PROMPT_ROWS])  # fmt: skip
        steps: dict[Any, dict[str, Any]] = {}
        for r in rows:
            key = (r["step"], r["validate"])
            s = steps.setdefault(key, {"step": r["step"], "validate": r["validate"],
                                       "rollouts": []})  # fmt: skip
            s["rollouts"].append(r)
        out, prev = [], None
        for s in steps.values():
            rewards = [r["reward"] for r in s["rollouts"] if r["reward"] is not None]
            s["mean_reward"] = sum(rewards) / len(rewards) if rewards else None
            first = s["rollouts"][0]["response_text"] or ""
            s["diff"] = word_diff(prev, first) if prev is not None else None
            prev = first
            out.append(s)
        return {"prompt": text, "steps": out, "truncated": len(rows) >= MAX_PROMPT_ROWS}

    def steps(self, run: str | None) -> list[dict[str, Any]]:
        t = self.table(run, "trajectories")
        return list(self._cached(("steps", run), lambda: self._rows(
            f"SELECT step, validate, count(*) n, avg(reward) reward, avg(response_tokens) length,"
            f" 1 - sum(num_tool_errors) / nullif(sum(num_tool_calls), 0) tool_success, "
            f"avg(mismatch_kl_mean) mismatch_kl, avg(ref_kl_mean) ref_kl FROM {t} "
            "WHERE step IS NOT NULL GROUP BY step, validate ORDER BY validate, step")))  # fmt: skip

    def compare(self, step: int, text: str) -> dict[str, Any]:
        """The same prompt at the same step in every run: rewards and the responses' diff
        against the first run's first rollout."""
        out: list[dict[str, Any]] = []
        base = None
        for name in self.runs:
            t = self.table(name, "trajectories")
            rows = self._rows(f"SELECT trace_id, rollout_n, reward, response_text FROM {t} "
                              "WHERE step = ? AND prompt = ? ORDER BY rollout_n LIMIT 64",
                              [step, text])  # fmt: skip
            first = rows[0]["response_text"] or "" if rows else ""
            out.append({"run": name, "rollouts": rows,
                        "diff": word_diff(base, first) if base is not None and rows else None})
            if base is None and rows:
                base = first
        return {"step": step, "prompt": text, "runs": out}


def _round(v: Any) -> Any:
    return None if v is None or v != v else float(f"{v:.6g}")


def word_diff(old: str, new: str) -> list[list[str]]:
    """``[[op, text], ...]`` with op ``=``, ``-`` or ``+``, word by word (whitespace kept)."""
    a, b = re.findall(r"\S+\s*", old), re.findall(r"\S+\s*", new)
    out: list[list[str]] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            out.append(["=", "".join(a[i1:i2])])
            continue
        if i2 > i1:
            out.append(["-", "".join(a[i1:i2])])
        if j2 > j1:
            out.append(["+", "".join(b[j1:j2])])
    return out


def valid_run_name(name: str) -> bool:
    return bool(_NAME.match(name))
