"""The export's ``steps`` table: :func:`tracer.readers.timing.breakdown.step_summaries` over the
trajectories table just written, one step at a time (a step's rows are in memory, never the
whole table's)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from tracer.readers.schema import STEPS
from tracer.readers.timing.breakdown import step_summaries

# the trajectories columns the summaries read
TIMING_COLUMNS = ("trace_id", "step", "validate", "start_time", "latency_ms", "generate_ms",
                  "tool_ms", "reward_ms", "other_ms", "gap_ms", "tool_ms_by_name",
                  "slow_span_id", "slow_span_kind", "slow_span_name", "slow_span_detail",
                  "slow_span_ms", "status", "end_reason", "response_tokens", "sample_key",
                  "rollout_n")  # fmt: skip


def _parquet_steps(path: str) -> Iterator[list[dict[str, Any]]]:
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    names = set(pq.read_schema(path).names)  # an older export has no end_reason
    table = pq.read_table(path, columns=[c for c in TIMING_COLUMNS if c in names])
    table = table.filter(pc.is_valid(table["step"]))
    for step in sorted(pc.unique(table["step"]).to_pylist()):
        yield table.filter(pc.equal(table["step"], step)).to_pylist()


def _jsonl_steps(path: str) -> Iterator[list[dict[str, Any]]]:
    import datetime as dt

    by_step: dict[int, list[dict[str, Any]]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.get("step") is None:
                continue
            if isinstance(row.get("start_time"), str):
                row["start_time"] = dt.datetime.fromisoformat(row["start_time"])
            by_step.setdefault(int(row["step"]), []).append({k: row.get(k) for k in TIMING_COLUMNS})
    for step in sorted(by_step):
        yield by_step[step]


def step_rows(trajectories_path: str) -> list[dict[str, Any]]:
    """The ``steps`` rows of a written trajectories file (``.parquet`` or ``.jsonl``)."""
    chunks = (_parquet_steps if trajectories_path.endswith(".parquet")
              else _jsonl_steps)(trajectories_path)  # fmt: skip
    names = [c[0] for c in STEPS]
    return [{k: s[k] for k in names} for rows in chunks for s in step_summaries(rows)]


def write_steps(trajectories_path: str, out_dir: str, fmt: str) -> tuple[str, int]:
    """Write ``out_dir/steps.<fmt>``; returns its path and row count."""
    rows = step_rows(trajectories_path)
    path = os.path.join(out_dir, f"steps.{fmt}")
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        from tracer.readers.schema import arrow_schema

        pq.write_table(pa.Table.from_pylist(rows, schema=arrow_schema("steps")), path,
                       compression="zstd")  # fmt: skip
    else:
        with open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path, len(rows)
