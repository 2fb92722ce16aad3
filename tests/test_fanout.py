"""Several backends at once: mlflow + jsonl + otlp with the OTLP collector down. The other two
get every trajectory; the OTLP failures are counted and logged, and do not take minutes."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests._servers import closed_port_url
from tests.conftest import search_traces
from tracer.backends.jsonl_backend import read_jsonl

pytest.importorskip("mlflow")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

EXP = "fanout-tests"


@tracer.trace_op(kind="generate")
def generate(messages: list[dict[str, Any]]) -> str:
    return "the answer is 4"


@tracer.trace_op(kind="tool")
def call_tool(name: str, arguments: dict[str, Any]) -> str:
    return "4"


@tracer.trace_op(kind="reward")
def compute_reward(answer: str) -> float:
    return 1.0 if answer == "4" else 0.0


@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_otlp_down_others_get_everything(
    tmp_path: Path, mlflow_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    jsonl_path = tmp_path / "traces.jsonl"
    extra: dict[str, Any] = {}
    if "spool_dir" in {f.name for f in dataclasses.fields(tracer.TraceConfig)}:
        extra["spool_dir"] = str(tmp_path / "spool")  # failed OTLP batches wait there
    tracer.init(
        {
            **extra,
            "backend": ["mlflow", "jsonl", "otlp"],
            "project_name": EXP,
            "tracking_uri": mlflow_uri,
            "jsonl_path": str(jsonl_path),
            "otlp_endpoint": closed_port_url(),
            "export_timeout_s": 1.0,
            "export_max_retries": 1,
            "flush_interval_s": 0.1,
            # nothing listens at the end either: the teardown's shutdown gives up on OTLP after
            # 1 s instead of probing it for the default 10
            "shutdown_timeout_s": 1.0,
            "raise_internal_errors": True,
        }
    )
    caplog.set_level(logging.WARNING, logger="tracer")
    started = time.monotonic()
    for step in (1, 2):
        for i in range(5):
            with tracer.trace_attr(step=step, sample_index=i, rollout_n=0):
                generate([{"role": "user", "content": "2+2?"}])
                compute_reward(call_tool("calc", {"expr": "2+2"}))
        # False while OTLP batches are still waiting (spooled) for the collector: flush probes
        # the dead collector until its timeout, then says so
        assert tracer.flush(timeout_s=3) is False
    elapsed = time.monotonic() - started
    assert elapsed < 30, f"fan-out with a dead OTLP endpoint took {elapsed:.1f}s"

    m = tracer.metrics()
    assert m["tracer/submitted"] == 10
    assert m["tracer/mlflow/exported"] == 10 and m["tracer/mlflow/failed"] == 0
    assert m["tracer/jsonl/exported"] == 10 and m["tracer/jsonl/failed"] == 0
    assert m.get("tracer/mlflow/spooled_batches", 0) == 0
    assert m["tracer/otlp/exported"] == 0
    # not exported: either given up on (failed) or waiting in the spool for a replay
    assert m["tracer/otlp/failed"] + m.get("tracer/otlp/spooled_batches", 0) >= 1
    assert m["tracer/otlp/retries"] >= 1
    # one warning line says it is down and where its trajectories wait (an expected outage)
    down = [r for r in caplog.records if r.name == "tracer" and r.levelno >= logging.WARNING
            and "backend otlp (" in r.getMessage() and " is down " in r.getMessage()]
    assert len(down) == 1 and "spooling to" in down[0].getMessage()

    records = list(read_jsonl(jsonl_path))
    assert len(records) == 10
    assert {(r.step, r.sample_index) for r in records} == {(s, i) for s in (1, 2) for i in range(5)}
    assert all(r.reward == 1.0 for r in records)
    assert all(
        [s.kind for s in r.spans] == ["trajectory", "generate", "tool", "reward"] for r in records
    )

    traces = search_traces(mlflow_uri, EXP)
    assert len(traces) == 10
    assert {t.info.trace_id.removeprefix("tr-") for t in traces} == {r.trace_id for r in records}
    assert len(search_traces(mlflow_uri, EXP, "tags.step = '2'")) == 5


def _traced(n: int) -> list[tracer.TrajectoryRecord]:
    """``n`` trajectories of a tool call and a reward, as the pipeline hands them to backends."""
    from tracer.testing import InMemoryExporter

    tracer.init({"backend": "memory", "raise_internal_errors": True})
    for i in range(n):
        with tracer.trace_attr(step=1, sample_index=i):
            compute_reward(call_tool("calc", {"expr": "2+2"}))
    assert tracer.flush(timeout_s=30)
    return list(InMemoryExporter.latest().records)


def test_jsonl_appends_once_and_reader_skips_partial_line(tmp_path: Path) -> None:
    from tracer.backends.jsonl_backend import JsonlExporter

    records = _traced(3)
    path = tmp_path / "t.jsonl"
    exporter = JsonlExporter(tracer.TraceConfig(backend=None, jsonl_path=str(path)))
    exporter.export(records[:2])
    exporter.export(records[:2])  # a retried batch: not written twice
    with path.open("ab") as f:
        f.write(b'{"schema_version": 1, "trace_id": "cut mid-li')  # a crashed writer
    assert [r.trace_id for r in read_jsonl(path)] == [r.trace_id for r in records[:2]]
    exporter.export(records)  # appends on a fresh line after the fragment
    back = list(read_jsonl(path))
    assert [r.trace_id for r in back] == [r.trace_id for r in records]
    assert back[0] == records[0]
    with pytest.raises(ValueError, match="not a JSON trajectory record"):
        list(read_jsonl(path, strict=True))


def test_backends_remember_a_bounded_number_of_ids(tmp_path: Path) -> None:
    """A long run exports millions of trajectories: what a backend keeps to skip a batch sent
    again is the most recent ids only (the JSONL file, not memory, holds the rest)."""
    from tracer.backends.base import RecentIds
    from tracer.backends.jsonl_backend import JsonlExporter

    records = _traced(5)
    path = tmp_path / "t.jsonl"
    exporter = JsonlExporter(tracer.TraceConfig(backend=None, jsonl_path=str(path)))
    exporter._written = RecentIds(limit=3)
    for r in records:
        exporter.export([r])
    assert len(exporter._written) == 3
    exporter.export(records[-3:])  # the recent ones are still skipped
    assert [r.trace_id for r in read_jsonl(path)] == [r.trace_id for r in records]
    ids = RecentIds[None](limit=2)
    for key in "abca":
        ids.add(key, None)
    assert "a" in ids and "c" in ids and "b" not in ids  # re-adding "a" made it recent
