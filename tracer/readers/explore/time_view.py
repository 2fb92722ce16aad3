"""The Time tab's data (``GET /api/timing?step=&validate=&top=``): across steps, each step's
tail ratio and tool share (curves); for one step, its summary and its slowest trajectories
with their turns and tool calls on one time axis (a Gantt chart), each with the span that made
it slow. Read from the export's timing columns (tracer/readers/timing.py) and its ``steps``
table when it has one; one query over the step's rows, one over their turns and tool calls."""

from __future__ import annotations

import os
from typing import Any

from tracer.readers.explore.compact import quote
from tracer.readers.explore.filters import ApiError, parse_int
from tracer.readers.explore.store import Store

DEFAULT_TOP = 100
MAX_TOP = 500
_TRAJ = ("trace_id, sample_key, rollout_n, epoch_us(start_time) AS start_us, latency_ms, "
         "generate_ms, tool_ms, reward_ms, other_ms, gap_ms, slow_span_id, slow_span_kind, "
         "slow_span_name, slow_span_detail, slow_span_ms")  # fmt: skip


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
    t = store.table(run, "trajectories")
    span = store.query(f"SELECT count(*) n, min(epoch_us(start_time)) t0, max(epoch_us("
                       f"start_time) + latency_ms * 1000) t1 FROM {t} WHERE step = ? AND "
                       "validate = ?", [step, validate])[0]  # fmt: skip
    trajs = store.query(f"SELECT {_TRAJ} FROM {t} WHERE step = ? AND validate = ? ORDER BY "
                        "latency_ms DESC, trace_id LIMIT ?", [step, validate, top])  # fmt: skip
    ids = [r["trace_id"] for r in trajs]
    spans: list[dict[str, Any]] = []
    if ids:
        marks = ", ".join("?" * len(ids))
        turns, calls = store.table(run, "turns"), store.table(run, "tool_calls")
        spans = store.query(
            f"SELECT trace_id, 'generate' kind, turn_index idx, name, span_id, "
            f"epoch_us(start_time) start_us, latency_ms FROM {turns} WHERE step = ? AND "
            f"trace_id IN ({marks}) UNION ALL SELECT trace_id, 'tool' kind, call_index idx, "
            f"name, span_id, epoch_us(start_time) start_us, latency_ms FROM {calls} WHERE "
            f"step = ? AND trace_id IN ({marks}) ORDER BY trace_id, start_us",
            [step, *ids, step, *ids])  # fmt: skip
    return {"step": step, "validate": validate, "curves": all_curves, "summary": summary,
            "count": int(span["n"]), "t0_us": span["t0"], "t1_us": span["t1"],
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
