"""Every column of every row the bulk writer stores, against MLflow's own path (log_spans), on
records of many shapes: token lists of ints and floats, errors, tool spans, unicode and
control characters, attribute values JSON cannot hold, a missing parent, a user's session."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

import pytest

pytest.importorskip("mlflow")

from tests.test_mlflow_bulk import both_paths
from tracer.record import SpanRecord, TrajectoryRecord

T0 = 1_796_608_931_106_064_536  # ns since the epoch
TABLES = {
    "trace_info": "request_id",
    "trace_tags": "request_id, key",
    "trace_request_metadata": "request_id, key",
    "spans": "trace_id, span_id",
}


def _span(i: int, parent: int | None, kind: str, **fields: Any) -> SpanRecord:
    parent_id = f"{parent + 1:016x}" if parent is not None else None
    name = fields.pop("name", kind)
    return SpanRecord(f"{i + 1:016x}", parent_id, name, kind, T0 + i, T0 + 9_000_000 + i, **fields)


def _records() -> list[TrajectoryRecord]:
    ids = list(range(40))
    text = "ünïcode 中文 😀 \"quoted\" \\ \x00\x1f\t\n \u2028 {\"a\": 1}"
    spans = [
        _span(0, None, "trajectory", inputs={"prompt_ids": ids, "turn": 0}, outputs={"r": 1.5}),
        _span(1, 0, "generate", inputs={"prompt_ids": ids, "messages": [
            {"role": "user", "content": text}]},
              outputs={"response_ids": ids[:20], "logprobs": [-0.5, math.nan, 1e-7] * 6,
                       "content": text}, attributes={"finish_reason": "stop"}),
        _span(2, 0, "parse", inputs={"text": text}, outputs=[{"name": "calc", "arguments": {}}]),
        _span(3, 0, "tool", status="ERROR", inputs={"expression": "boom"},
              error={"type": "ToolError", "message": f"bad {text}", "traceback": "tb\nline"},
              attributes={"tool_name": "calc", "when": dt.date(2026, 12, 7), "tags": {3, 1},
                          "session.id": "user-session"}),
        _span(4, 41, "tool", name="orphan", inputs="[1, 2]", outputs='{"x": [1, 2]}',
              attributes={"cut": '"{\\"a\\": 1}"', "rollout_tracer.note": [1, "a", None]}),
        _span(5, 0, "reward", inputs={"answer": "84"}, outputs=2**70),
    ]  # fmt: skip
    base = dict(name="trajectory", project_name="p", experiment_name="exp ü", step=3,
                sample_index=1, rollout_n=0, validate=False, worker_id="w0", start_ns=T0,
                end_ns=T0 + 9_000_005)  # fmt: skip
    return [
        TrajectoryRecord(trace_id="ab" * 16, reward=0.25, spans=spans, **base),  # type: ignore[arg-type]
        TrajectoryRecord(trace_id="cd" * 16, status="ERROR", spans=spans[:4],  # type: ignore[arg-type]
                         attributes={"end_reason": "error", "k": dt.date(2026, 1, 2)}, **base),
    ]  # fmt: skip


def _rows(uri: str) -> dict[str, list[tuple[Any, ...]]]:
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri)
    with engine.connect() as conn:
        out = {}
        for table, order in TABLES.items():
            query = sqlalchemy.text(f"SELECT * FROM {table} ORDER BY {order}")
            out[table] = [tuple(row) for row in conn.execute(query)]
    engine.dispose()
    return out


def test_every_column_is_what_mlflows_path_stores(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours, theirs = both_paths(_records(), tmp_path, monkeypatch, _rows)
    assert len(ours["spans"]) == 6 + 4 and ours["trace_request_metadata"] == []
    for table in TABLES:
        assert len(ours[table]) == len(theirs[table]), table
        for got, want in zip(ours[table], theirs[table], strict=True):
            assert got == want, (table, [(g, w) for g, w in zip(got, want, strict=True) if g != w])
