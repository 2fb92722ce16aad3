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


def test_the_rollup_partitions_are_what_mlflows_path_names(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MLflow's rollups (off by default) read the partitions a batch touches; the bulk writer
    hands them over as a generator, read only then. Read, they name the days and families
    MLflow's own path names for the same records."""
    from mlflow.store.tracking import sqlalchemy_store
    from mlflow.store.tracking.utils import sql_trace_rollups

    named: list[tuple[Any, ...]] = []

    def enqueue(session: Any, partitions: Any) -> None:
        named.extend((family, experiment, ts // 86_400_000)
                     for family, experiment, days in partitions for ts in days)  # fmt: skip

    for module in (sql_trace_rollups, sqlalchemy_store):
        monkeypatch.setattr(module, "enqueue_rollup_rebuild_partitions", enqueue)
    monkeypatch.setenv("MLFLOW_SQL_TRACE_ROLLUPS_ENABLED", "true")  # MLflow's path asks first

    def read(uri: str) -> set[tuple[Any, ...]]:
        out = set(named)
        named.clear()
        return out

    ours, theirs = both_paths(_records(), tmp_path, monkeypatch, read)
    seen = {family.value for family, _, _ in ours}
    assert ours == theirs and seen == {"trace_metric", "assessment", "span_cost"}


def _builder(location: str) -> Any:
    from tracer.backends.mlflow_bulk import _mlflow_parts
    from tracer.backends.mlflow_bulk_rows import RowBuilder

    return RowBuilder(_mlflow_parts(), 1, location, trace_id_of=lambda t: f"tr-{t}",
                      reward_name="reward")  # fmt: skip


@pytest.mark.parametrize("location", [
    "/tmp/mlruns/1", "file:///tmp/ml runs/1", "s3://bucket/a/b?x=1#f",
    "http://host:5000/api/2.0/mlflow-artifacts/artifacts/1", "mlflow-artifacts:/1", "",
])  # fmt: skip
def test_the_artifact_location_is_mlflows_for_every_id(location: str) -> None:
    """The location made from a probe's (head, id, tail) is what MLflow's append_to_uri_path
    gives, for ids of every shape (the odd ones are asked of MLflow)."""
    b = _builder(location)
    m = b.m
    folder, artifacts = m.SqlAlchemyStore.TRACE_FOLDER_NAME, m.SqlAlchemyStore.ARTIFACTS_FOLDER_NAME
    for tid in ("tr-" + "ab" * 16, "tr-0", "TR-x9", "a/../b", "ü", "a b", "a?b", "%41", ""):
        assert b._location(tid) == m.append_to_uri_path(location, folder, tid, artifacts), tid


def test_a_trace_tag_is_mlflows_answer_asked_once() -> None:
    """A tag's stored (key, value) is what MLflow's validation gives (None: MLflow skips it),
    the same when it is asked again (from the memo), and the memo stays bounded."""
    from tracer.backends.mlflow_bulk_rows import TAG_MEMO

    b = _builder("/tmp/mlruns/1")
    m = b.m

    def mlflows(key: str, value: Any) -> tuple[str, str] | None:
        try:
            return m._validate_trace_tag(key, str(m._try_parse_json_string(value)))  # type: ignore[no-any-return]
        except Exception:
            return None

    cases = [("step", "0"), ("step", '"0"'), ("worker_id", '"vm:1"'), ("k", "v" * 10_000),
             ("mlflow.traceName", '"name"'), ("", "x"), ("a" * 300, "x"), ("../k", "x"),
             ("k", "[1, 2]"), ("k", None), ("k", 5)]  # fmt: skip
    for key, value in cases:
        assert b._tag(key, value) == mlflows(key, value), key
        assert b._tag(key, value) == mlflows(key, value), key  # asked again
    assert any(mlflows(k, v) is None for k, v in cases)  # the cases include skipped tags
    for i in range(TAG_MEMO + 10):
        b._tag("sample_index", str(i))
    assert 0 < len(b._tag_memo) <= TAG_MEMO


def test_a_span_id_reads_as_it_did_read_as_a_number() -> None:
    """The column's hex and the content's base64 of a span id, by bytes.fromhex for 16 hex
    digits and as a number otherwise, are what reading it as a number gives."""
    import base64

    from tracer.backends.mlflow_bulk_span import id_forms

    def as_number(hex_id: str) -> tuple[str, str]:
        value = int(hex_id, 16)
        return f"{value:016x}", base64.b64encode(value.to_bytes(8, "big")).decode()

    for hex_id in ("0123456789abcdef", "0123456789ABCDEF", "ffffffffffffffff", "1", "0x1f",
                   "00ab_cdef", "0000000000000001", " 123456789abcde"):  # fmt: skip
        assert id_forms(hex_id) == as_number(hex_id), hex_id
    # not a number, or past 8 bytes: an error, as before
    for bad in ("xyz", "", "1" * 17, "12 34 56 78 9a"):
        with pytest.raises((ValueError, OverflowError)):
            as_number(bad)
        with pytest.raises((ValueError, OverflowError)):
            id_forms(bad)
