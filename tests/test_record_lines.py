"""A record's JSON line reads back as the record: built by position when a span's keys come
in the dataclass's order (as the encoder writes them), by name otherwise."""

from __future__ import annotations

import dataclasses

from tracer.encode import decode, encode_record
from tracer.record import SpanRecord, TrajectoryRecord


def _record() -> TrajectoryRecord:
    error = {"type": "E", "message": "m", "traceback": "t"}
    spans = [
        SpanRecord("a" * 16, None, "trajectory", "trajectory", 1, 9, inputs={"ids": [1, 2]}),
        SpanRecord("b" * 16, "a" * 16, "tool", "tool", 2, 3, "ERROR", error, "i", ["o"], {"k": 1}),
    ]
    return TrajectoryRecord("c" * 32, "trajectory", "p", "e", 3, 1, 0, False, "w", 1, 9,
                            reward=0.5, attempt=2, attributes={"x": "y"}, spans=spans)  # fmt: skip


def test_a_line_reads_back_as_its_record() -> None:
    record = _record()
    assert TrajectoryRecord.from_dict(decode(encode_record(record))) == record


def test_span_keys_in_another_order_or_missing_read_by_name() -> None:
    record = _record()
    data = decode(encode_record(record))
    data["spans"][0] = dict(reversed(list(data["spans"][0].items())))  # another order
    for key in ("status", "error", "inputs", "outputs", "attributes"):  # defaults
        del data["spans"][1][key]
    data.pop("attempt")  # a version-1 line: attempt 0
    data["schema_version"] = 1
    back = TrajectoryRecord.from_dict(data)
    assert back.spans[0] == record.spans[0]
    assert back.spans[1] == dataclasses.replace(
        record.spans[1], status="OK", error=None, inputs=None, outputs=None, attributes={}
    )
    assert back.attempt == 0 and back.schema_version == record.schema_version
