"""The Time tab's data (``GET /api/timing?step=&validate=&top=``): across steps, each step's
tail ratio and tool share (curves); for one step, its summary and its slowest trajectories
with their turns and tool calls on one time axis (a Gantt chart), each with the span that made
it slow. Read from the export's timing columns (readers/timing/breakdown.py) and its ``steps``
table when it has one; one query over the step's rows, one over their turns and tool calls."""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from tracer.readers.explore.compact import quote
from tracer.readers.explore.filters import ApiError, parse_int
from tracer.readers.explore.store import Store

DEFAULT_TOP = 100
MAX_TOP = 500
_TRAJ = ["trace_id", "sample_key", "rollout_n", "validate", "start_time", "latency_ms",
         "generate_ms", "tool_ms", "reward_ms", "other_ms", "gap_ms", "slow_span_id",
         "slow_span_kind", "slow_span_name", "slow_span_detail", "slow_span_ms"]  # fmt: skip
_SPAN = ["trace_id", "span_id", "name", "start_time", "latency_ms"]


class StepFile:
    """A Parquet table read one step at a time: the row groups whose ``step`` statistics can
    hold it (an export and the compacted copy are both in step order, so a step is a few row
    groups), with pyarrow; DuckDB would plan a scan over every row group first."""

    def __init__(self, path: str) -> None:
        import pyarrow.parquet as pq

        self.file = pq.ParquetFile(path)
        self.lock = threading.Lock()
        md = self.file.metadata
        col = self.file.schema_arrow.get_field_index("step")
        self.bounds: list[tuple[Any, Any] | None] = []
        for g in range(md.num_row_groups):
            st = md.row_group(g).column(col).statistics
            self.bounds.append((st.min, st.max) if st is not None and st.has_min_max else None)

    def read(self, step: int, columns: list[str]) -> Any:
        import pyarrow.compute as pc

        groups = [g for g, b in enumerate(self.bounds) if b is None or b[0] <= step <= b[1]]
        with self.lock:
            table = self.file.read_row_groups(groups, columns=list({*columns, "step"}))
        return table.filter(pc.equal(table["step"], step)).select(columns)


@functools.lru_cache(maxsize=32)
def _step_file(path: str, mtime_ns: int) -> StepFile:
    return StepFile(path)


def step_file(folder: str, table: str) -> StepFile:
    path = os.path.join(folder, f"{table}.parquet")
    return _step_file(path, os.stat(path).st_mtime_ns)


def curves(store: Store, run: str | None) -> list[dict[str, Any]]:
    """Per step (and validate): wall p50/p99, tail ratio, tool and gap shares, stragglers."""
    t = store.table(run, "trajectories")
    path = os.path.join(store.runs[run or next(iter(store.runs))].path, "steps.parquet")

    def make() -> list[dict[str, Any]]:
        if os.path.exists(path):  # written by the export: a few rows
            return store.query(
                "SELECT step, validate, trajectories, wall_p50_ms, wall_p99_ms, tail_ratio, "
                "tail_wait_ms, generate_share, tool_share, gap_share, stragglers, "
                f"top_straggler_cause FROM read_parquet({quote(path)}) ORDER BY validate, step"
            )
        return store.query(  # an export without the table: the same from the trajectories
            "SELECT step, validate, count(*) trajectories, quantile_cont(latency_ms, 0.5) "
            "wall_p50_ms, quantile_cont(latency_ms, 0.99) wall_p99_ms, quantile_cont(latency_ms,"
            " 0.99) / nullif(quantile_cont(latency_ms, 0.5), 0) tail_ratio, NULL tail_wait_ms, "
            "sum(generate_ms) / nullif(sum(latency_ms), 0) generate_share, sum(tool_ms) / "
            "nullif(sum(latency_ms), 0) tool_share, sum(gap_ms) / nullif(sum(latency_ms), 0) "
            f"gap_share, NULL stragglers, NULL top_straggler_cause FROM {t} WHERE step IS NOT "
            "NULL GROUP BY step, validate ORDER BY validate, step")  # fmt: skip

    return list(store.cached(("timing-curves", run, path), make))


def timing(store: Store, run: str | None, step: int | None, validate: bool,
           top: int) -> dict[str, Any]:  # fmt: skip
    """The tab's answer: ``curves``, and for ``step`` (default: the last) its ``summary``,
    ``trajectories`` (slowest first, at most ``top``), their ``spans`` and the axis start."""
    if not store.has_column(run, "gap_ms"):
        raise ApiError("this export has no timing columns: export it again with this version",
                       404)  # fmt: skip
    all_curves = curves(store, run)
    mine = [c for c in all_curves if bool(c["validate"]) == validate]
    if step is None:
        if not mine:
            raise ApiError("no steps in this run", 404)
        step = int(mine[-1]["step"])
    summary = next((c for c in mine if c["step"] == step), None)
    if summary is None:
        raise ApiError(f"no step {step} (validate={str(validate).lower()}) in this run", 404)
    import pyarrow as pa
    import pyarrow.compute as pc

    folder = store.runs[run or next(iter(store.runs))].folder
    rows = step_file(folder, "trajectories").read(step, _TRAJ)
    rows = rows.filter(pc.equal(rows["validate"], validate))
    start_us = pc.cast(rows["start_time"], "int64")
    end_us = pc.add(start_us, pc.multiply(rows["latency_ms"], 1000.0))
    order = pc.sort_indices(rows, [("latency_ms", "descending"), ("trace_id", "ascending")])
    top_rows = rows.take(order[:top]).append_column("start_us", start_us.take(order[:top]))
    trajs = top_rows.drop_columns(["start_time", "validate"]).to_pylist()
    ids = pa.array([r["trace_id"] for r in trajs], pa.string())
    spans: list[dict[str, Any]] = []
    for kind, table, index in (("generate", "turns", "turn_index"),
                               ("tool", "tool_calls", "call_index")):  # fmt: skip
        if table not in store.runs[run or next(iter(store.runs))].tables:
            continue
        part = step_file(folder, table).read(step, [*_SPAN, index])
        part = part.filter(pc.is_in(part["trace_id"], value_set=ids))
        part = part.append_column("start_us", pc.cast(part["start_time"], "int64"))
        for r in part.drop_columns(["start_time"]).to_pylist():
            spans.append({**r, "kind": kind, "idx": r.pop(index)})
    spans.sort(key=lambda r: (r["trace_id"], r["start_us"] or 0))
    count = len(rows)
    return {"step": step, "validate": validate, "curves": all_curves, "summary": summary,
            "count": count, "t0_us": pc.min(start_us).as_py() if count else None,
            "t1_us": pc.max(end_us).as_py() if count else None,
            "trajectories": trajs, "spans": spans}  # fmt: skip


def api(store: Store, q: dict[str, list[str]]) -> dict[str, Any]:
    """``GET /api/timing``'s parameters -> :func:`timing`."""
    run = q.get("run", [None])[-1]
    step = parse_int(q, "step", 0, -(2**62), 2**62) if q.get("step", [""])[-1] else None
    validate = q.get("validate", ["false"])[-1].lower()
    if validate not in ("true", "false", "1", "0", ""):
        raise ApiError(f"validate: {validate[:50]!r} is not true or false")
    top = parse_int(q, "top", DEFAULT_TOP, 1, MAX_TOP)
    return timing(store, run, step, validate in ("true", "1"), top)
