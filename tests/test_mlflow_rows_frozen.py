"""Every row the bulk writer builds, byte for byte, against the rows it built before its CPU
was cut (issue #59), kept in tests/data/mlflow_rows_frozen.json: both ways a record reaches
the writer (the export child reads its JSON line back; the exporter in the user's process
gets the record itself), on records of many shapes.

After a deliberate change of what is stored (a new MLflow, a new attribute), or of the records
here (they include tests/test_mlflow_bulk_rows.py's), write the file again with
``python -m tests.test_mlflow_rows_frozen`` and read the diff; a change meant to store the same
bytes must pass without it."""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")

from tests.test_mlflow_bulk_rows import _records as odd_records
from tracer.record import SpanRecord, TrajectoryRecord

FROZEN = Path(__file__).parent / "data" / "mlflow_rows_frozen.json"
T0 = 1_796_608_931_106_064_536
NOW_MS = 1_796_608_999_000


class Key(str):
    pass


def _span(i: int, parent: int | None, kind: str, **fields: Any) -> SpanRecord:
    parent_id = f"{parent + 1:016x}" if parent is not None else None
    name = fields.pop("name", kind)
    return SpanRecord(f"{i + 1:016x}", parent_id, name, kind, T0 + i, T0 + 5_000_000 + i * 7,
                      **fields)  # fmt: skip


def _rollout() -> TrajectoryRecord:
    """What a rollout makes (benchmarks/ingest.py's shape, smaller): turns of generate, parse
    and tool, token ids and log-probs, chat messages with tool calls, a reward."""
    ids = list(range(50))
    long = "é" * 70 + "x" * 3000
    spans = [_span(0, None, "trajectory", inputs={"prompt_ids": ids, "turn": 0},
                   outputs={"reward": 1.0, "output": {"score": 1.0}},
                   attributes={"end_reason": "completed"})]  # fmt: skip
    for turn in range(3):
        g, p, t = 1 + 3 * turn, 2 + 3 * turn, 3 + 3 * turn
        messages = [{"role": "system", "content": "calc"}, {"role": "user", "content": long},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "c1", "function": {"name": "calculator",
                                                  "arguments": '{"expression": "1"}'}}]},
                    {"role": "tool", "tool_call_id": "c1", "content": "1"}]  # fmt: skip
        spans += [
            _span(g, 0, "generate", inputs={"prompt_ids": ids, "turn": turn, "messages": messages},
                  outputs={"response_ids": ids[:20 + turn], "finish_reason": "stop",
                           "logprobs": [-0.25 * k for k in range(18)], "content": "CALL 1"},
                  attributes={"finish_reason": "stop", "prompt_tokens": 50,
                              "response_tokens": 20 + turn, "logprob_mean": -1.5}),
            _span(p, 0, "parse", inputs={"text": "<tool_call>calculator</tool_call>"},
                  outputs={"content": "x", "tool_calls": [{"name": "calculator"}]}),
            _span(t, 0, "tool", inputs={"name": "calculator", "arguments": {"expression": "1"}},
                  outputs=84, attributes={"tool_name": "calculator"}),
        ]  # fmt: skip
    spans.append(_span(10, 0, "reward", inputs={"answer": "84"}, outputs=1.0,
                       attributes={"reward": 1.0}))  # fmt: skip
    return TrajectoryRecord("0a" * 16, "trajectory", "proj", "exp", 4, 7, 0, False, "vm:1", T0,
                            T0 + 5_000_100, reward=1.0, attributes={"end_reason": "completed"},
                            spans=spans)  # fmt: skip


def _others() -> list[TrajectoryRecord]:
    """Shapes off the usual road: nested token lists, a span MLflow's translators read (a
    model, token usage, cost, a user), no inputs or outputs at all, verl's style, a root of
    its own session, long and odd text, no step or sample."""
    ids = list(range(20))
    odd = "ünïcode 中文 😀 \"q\" \\ \x00\x1f\t\n \u2028 " + "y" * 100
    nested = {"choices": [{"token_ids": ids, "text": odd}, {"mask": [1] * 17}],
              "deep": {"a": {"b": [{"log_probs": [0.5] * 16, "ids": ids}]}},
              "short_ids": [1, 2], "flags_mask": [True] * 20, "ids": [1.5] * 16}  # fmt: skip
    spans = [
        _span(0, None, "trajectory", attributes={"session.id": "mine", "user.id": "u-1",
                                                  "rollout_tracer.style": "verl"}),
        _span(1, 0, "generate", inputs={"model": "qwen", "prompt_ids": ids}, outputs=nested,
              attributes={"mlflow.chat.tokenUsage": {"input_tokens": 3, "output_tokens": 4,
                                                     "total_tokens": 7},
                          "mlflow.llm.cost": {"input_cost": 0.5, "output_cost": 0.25,
                                              "total_cost": 0.75}}),
        _span(2, 0, "tool", status="ERROR", inputs=None, outputs=None,
              error={"type": "ValueError", "message": odd, "traceback": "tb"}),
        _span(3, 2, "other", inputs=[ids, {"response_ids": ids}], outputs=odd * 3,
              attributes={"gen_ai.request.model": "m", "nested": {"k": [1, {"x": None}]}}),
        _span(4, 0, "retrieve", inputs={"q": 1}, outputs={"docs": []},
              attributes={"session.id": 5}),
        # an error status without an error, a key of a str subclass (the record itself only)
        _span(5, 4, "parse", status="ERROR", inputs={"text": "x"}, outputs={"ok": False},
              attributes={Key("rollout_tracer.note"): Key("v")}),
    ]  # fmt: skip
    first = TrajectoryRecord("1b" * 16, "verl run", "p", "", None, None, None, True, "w", T0,
                             T0 + 9, status="ERROR", policy_version=3, attempt=1,
                             attributes={"rollout_tracer.style": "verl", "k": "v"},
                             spans=spans)  # fmt: skip
    root = _span(0, None, "trajectory", inputs=odd, outputs=[1, 2])
    bare = TrajectoryRecord("2c" * 16, "t", "p", "e", 1, "s", 2, False, "w", T0, T0 + 1,
                            reward=-math.inf, spans=[root])  # fmt: skip
    big = {"prompt_ids": [2**40] * 16, "when": dt.date(2026, 1, 2)}
    lone = TrajectoryRecord("3d" * 16, "t", "p", "e", 2, 0, 1, False, "w", T0, T0 + 1,
                            reward=0.5, spans=[_span(0, None, "generate", inputs=big)])  # fmt: skip
    return [first, bare, lone]


def all_records() -> list[TrajectoryRecord]:
    return [_rollout(), *_others(), *odd_records()]


def _builder() -> Any:
    from tracer.backends.mlflow_bulk import _mlflow_parts
    from tracer.backends.mlflow_bulk_rows import RowBuilder

    return RowBuilder(_mlflow_parts(), 1, "/tmp/mlruns/1", trace_id_of=lambda t: f"tr-{t}",
                      reward_name="reward")  # fmt: skip


def _plain(rows: Any, builder: Any) -> dict[str, Any]:
    out = dict(vars(rows))
    out["assessment"] = builder.reward_row(rows, NOW_MS) if rows.reward is not None else None
    return out


def built_rows() -> str:
    """The rows of every record, both ways, as one JSON text (key order kept: it is the
    order of the COPY columns)."""
    from tracer.backends.export_process import _record
    from tracer.backends.mlflow_backend import mlflow_view
    from tracer.encode import encode_record

    builder = _builder()
    out = []
    for record in all_records():
        line = encode_record(record)
        read = builder.trace(mlflow_view(_record(line)))
        given = builder.trace(mlflow_view(record))
        out.append({"line": _plain(read, builder), "record": _plain(given, builder)})
    return json.dumps(out, indent=1) + "\n"


def test_the_rows_are_those_frozen() -> None:
    built, frozen = built_rows(), FROZEN.read_text()
    if built != frozen:  # say which trace and which row differ, not a 300 kB diff
        for i, (b, f) in enumerate(zip(json.loads(built), json.loads(frozen), strict=True)):
            for way in ("line", "record"):
                for table, rows in b[way].items():
                    assert rows == f[way][table], (i, way, table)
    assert built == frozen


if __name__ == "__main__":
    FROZEN.write_text(built_rows())
