"""The MLflow bulk writer (one transaction per batch) against MLflow's own path (log_spans +
log_assessment): both on real sqlite stores, compared through what MLflow's client reads back."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests.conftest import search_traces
from tracer.testing import InMemoryExporter

pytest.importorskip("mlflow")

from mlflow.tracking import MlflowClient

from tracer.backends import mlflow_bulk
from tracer.backends.mlflow_backend import MlflowExporter
from tracer.config import TraceConfig

EXP = "bulk-tests"
UNTESTED_VERSION = "3.17.99"  # a release the bulk writer was never run on


class ToolError(RuntimeError):
    pass


def _records() -> list[Any]:
    """Trajectories a user's rollout makes: chat turns, a tool call, a failing tool, rewards
    (one trajectory without), plus one whose spans carry token usage, a session and a user."""
    tracer.init(backend="memory", token2text=False, raise_internal_errors=True)

    @tracer.trace_op(kind="generate")
    def generate(prompt_ids: list[int], messages: list[dict[str, Any]]) -> dict[str, Any]:
        return {"response_ids": prompt_ids[:3], "content": "CALL calculator 2+3"}

    @tracer.trace_op(kind="parse")
    def parse(text: str) -> list[dict[str, Any]]:
        return [{"name": "calculator", "arguments": {"expression": "2+3"}}]

    @tracer.trace_op(kind="tool")
    def calculator(expression: str) -> str:
        if expression == "boom":
            raise ToolError("cannot parse 'boom'")
        return "5"

    @tracer.trace_op(kind="reward")
    def reward(answer: str) -> float:
        return 1.0 if answer == "5" else -0.5

    def rollout(i: int) -> None:
        with tracer.trace_attr(step=1 + i // 2, sample_index=i, rollout_n=0, validate=i == 3):
            messages = [
                {"role": "system", "content": "You are a calculator."},
                # quotes, a backslash, percent signs, a tab and a newline: the preview goes
                # into an SQL statement as a parameter on PostgreSQL (execute_values)
                {"role": "user", "content": f"Problem {i}: 2+3 ünïcode? 'it''s' \"q\" a\\b "
                                            "100% %s %(x)s\ttab\nline"},
            ]
            generate([1, 2, 3, 4], messages)
            parse("CALL calculator 2+3")
            answer = calculator("boom" if i == 2 else "2+3")  # 2: fails the trajectory
            if i != 1:
                reward(answer)

    for i in range(4):
        with contextlib.suppress(ToolError):
            rollout(i)
    assert tracer.flush(60)
    records = sorted(InMemoryExporter.latest().records, key=lambda r: r.sample_index)
    tracer.reset()
    assert len(records) == 4 and records[1].reward is None and records[2].status == "ERROR"
    usage = {"input_tokens": 11, "output_tokens": 7, "total_tokens": 18}
    gen = records[0].spans[1]
    rich = dataclasses.replace(
        gen,
        attributes={
            **gen.attributes,
            "mlflow.chat.tokenUsage": usage,
            "session.id": "session-7",
            "user.id": "user-3",
        },
    )
    records[0] = dataclasses.replace(
        records[0], spans=[records[0].spans[0], rich, *records[0].spans[2:]]
    )
    return records


def _exporter(uri: str, monkeypatch: pytest.MonkeyPatch, *, bulk: bool) -> MlflowExporter:
    with monkeypatch.context() as m:
        if not bulk:
            m.setattr(mlflow_bulk, "mlflow_version", lambda: UNTESTED_VERSION)
        exporter = MlflowExporter(TraceConfig(backend=None, tracking_uri=uri, project_name=EXP))
    assert (exporter.bulk is not None) is bulk
    return exporter


PATHS = ("mlflow-path", "bulk")  # both_paths' store names: <folder>/<name>.db


def both_paths(records: list[Any], folder: Path, monkeypatch: pytest.MonkeyPatch,
               read: Callable[[str], Any]) -> tuple[Any, Any]:  # fmt: skip
    """``records`` exported into a new sqlite store by each path: what ``read`` reads back
    from the bulk writer's store and from MLflow's own path's, in that order."""
    stored = {}
    for name, bulk in zip(PATHS, (False, True), strict=True):
        uri = f"sqlite:///{folder / name}.db"
        _exporter(uri, monkeypatch, bulk=bulk).export(records)
        stored[name] = read(uri)
    return stored["bulk"], stored["mlflow-path"]


def _stored(uri: str) -> dict[str, dict[str, Any]]:
    """Every trace as MLflow's client reads it back (search_traces, then get_trace)."""
    client = MlflowClient(tracking_uri=uri)
    out = {}
    for found in search_traces(uri, EXP):
        trace = client.get_trace(found.info.trace_id)
        info = trace.info
        assert found.info.tags == info.tags and found.info.trace_metadata == info.trace_metadata
        out[info.trace_id] = {
            "state": info.state,
            "request_time": info.request_time,
            "execution_duration": info.execution_duration,
            "request_preview": info.request_preview,
            "response_preview": info.response_preview,
            "client_request_id": info.client_request_id,
            "tags": info.tags,
            "metadata": info.trace_metadata,
            "token_usage": info.token_usage,
            "assessments": sorted(
                (
                    a.name,
                    a.value,
                    a.source.source_type,
                    a.source.source_id,
                    a.valid,
                    a.span_id,
                    a.rationale,
                    a.metadata,
                    a.error,
                    a.trace_id,
                    a.run_id,
                    a.overrides,
                )
                for a in info.assessments
            ),
            "spans": {
                s.span_id: {
                    "name": s.name,
                    "type": s.span_type,
                    "parent": s.parent_id,
                    "trace_id": s.trace_id,
                    "inputs": s.inputs,
                    "outputs": s.outputs,
                    "attributes": s.attributes,
                    "status": (s.status.status_code, s.status.description),
                    "start": s.start_time_ns,
                    "end": s.end_time_ns,
                    "events": [(e.name, e.timestamp, e.attributes) for e in s.events],
                }
                for s in trace.data.spans
            },
        }
    return out


def test_bulk_and_mlflow_paths_store_the_same_traces(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = _records()
    ours, theirs = both_paths(records, tmp_path, monkeypatch, _stored)
    assert sorted(ours) == sorted(theirs) == sorted(f"tr-{r.trace_id}" for r in records)
    for trace_id, want in theirs.items():
        got = ours[trace_id]
        for key in want:  # field by field, so a failure names the field
            assert got[key] == want[key], (trace_id, key)
    # What the UI and the filters rely on is really there (not just equal on both sides).
    first = ours[f"tr-{records[0].trace_id}"]
    assert first["tags"]["step"] == "1" and first["tags"]["reward"] == "1.0"
    assert first["tags"]["mlflow.traceName"] == "trajectory"
    assert first["tags"]["mlflow.artifactLocation"].endswith(
        f"/traces/tr-{records[0].trace_id}/artifacts"
    )
    assert first["metadata"]["mlflow.trace.session"] == "session-7"
    assert first["metadata"]["mlflow.trace.user"] == "user-3"
    assert first["token_usage"]["total_tokens"] == 18
    assert [a[:4] for a in first["assessments"]] == [("reward", 1.0, "CODE", "rollout-tracer")]
    assert "Problem 0" in (first["request_preview"] or "")
    gen = next(s for s in first["spans"].values() if s["name"] == "generate")
    assert gen["type"] == "CHAT_MODEL" and gen["attributes"]["mlflow.chat.messages"]
    assert ours[f"tr-{records[1].trace_id}"]["assessments"] == []
    failed = ours[f"tr-{records[2].trace_id}"]
    assert failed["state"] == "ERROR"
    [tool] = [s for s in failed["spans"].values() if s["name"] == "calculator"]
    assert tool["status"][0] == "ERROR" and tool["events"][0][0] == "exception"
    assert len(search_traces(f"sqlite:///{tmp_path / 'bulk'}.db", EXP, "tags.step = '2'")) == 2
    # The rows themselves: each span's content JSON is the text MLflow's path writes, which
    # its span-attribute filters match (`"key": "value"`, with MLflow's separators).
    texts = {name: _span_contents(f"sqlite:///{tmp_path / name}.db") for name in PATHS}
    assert texts["bulk"] == texts["mlflow-path"]
    assert len(texts["bulk"]) == sum(len(r.spans) for r in records)
    for where in ("span.attributes.`mlflow.spanType` RLIKE 'TOOL'",
                  "span.attributes.tool_name LIKE '%calc%'"):  # fmt: skip
        found = {name: search_traces(f"sqlite:///{tmp_path / name}.db", EXP, where)
                 for name in PATHS}  # fmt: skip
        assert len(found["bulk"]) == len(found["mlflow-path"]) == 4, where


def _span_contents(uri: str) -> dict[str, str]:
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri)
    with engine.connect() as conn:
        rows = conn.execute(sqlalchemy.text("SELECT span_id, content FROM spans")).all()
    engine.dispose()
    return dict(rows)  # type: ignore[arg-type]


@pytest.mark.slow
def test_bulk_and_mlflow_paths_store_the_same_traces_on_postgresql(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from benchmarks.postgres import postgres_available, temporary_postgres

    if why := postgres_available():
        pytest.skip(why)
    records = _records()
    with temporary_postgres("mlflow_path", "bulk") as (theirs_uri, ours_uri):
        _exporter(theirs_uri, monkeypatch, bulk=False).export(records)
        exporter = _exporter(ours_uri, monkeypatch, bulk=True)
        exporter.export(records)
        exporter.export(records, replay=True)
        theirs, ours = _stored(theirs_uri), _stored(ours_uri)
        # binary COPY: each span's text arrives as MLflow's own path writes it
        assert _span_contents(ours_uri) == _span_contents(theirs_uri)
    assert sorted(ours) == sorted(theirs) and len(ours) == 4
    for trace_id, want in theirs.items():
        for key in want:
            assert ours[trace_id][key] == want[key], (trace_id, key)


def test_the_installed_mlflow_is_a_version_the_bulk_writer_was_tested_with() -> None:
    """Fails on a dependency bump: run this file on the new MLflow, then add the version (and
    the schema revision it creates) to TESTED_VERSIONS."""
    import mlflow

    assert mlflow.__version__ in mlflow_bulk.TESTED_VERSIONS, (
        f"MLflow {mlflow.__version__} is installed; the bulk writer was tested with "
        f"{sorted(mlflow_bulk.TESTED_VERSIONS)}: re-verify it (tests/test_mlflow_bulk.py) "
        "and add the version, or pin MLflow back"
    )


def _traced_rewards(mlflow_uri: str, caplog: pytest.LogCaptureFixture) -> list[str]:
    """Three rewarded trajectories through tracer.init; the lines logged about the bulk
    writer."""
    with caplog.at_level(logging.INFO, logger="tracer"):
        # in this process: the tests patch the version seen here (by default the same writer
        # code runs in a child process, which would not see the patch)
        tracer.init(backend="mlflow", tracking_uri=mlflow_uri, project_name=EXP,
                    raise_internal_errors=True, export_in_subprocess=False)  # fmt: skip

        @tracer.trace_op(kind="reward")
        def reward(x: float) -> float:
            return x

        for step in range(3):
            with tracer.trace_attr(step=step, sample_index=0):
                reward(0.25)
        assert tracer.flush(60)
        tracer.reset()
    return [r.getMessage() for r in caplog.records if "bulk writer" in r.getMessage()]


@pytest.mark.parametrize("seen", ["version", "revision"])
def test_an_untested_version_or_revision_falls_back_with_one_log_line(
    seen: str, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import mlflow

    revision = mlflow_bulk.TESTED_VERSIONS[mlflow.__version__]  # the store's, made by MLflow
    if seen == "version":  # a new MLflow release, same schema
        monkeypatch.setattr(mlflow_bulk, "mlflow_version", lambda: UNTESTED_VERSION)
    else:  # the installed release on a store another MLflow migrated
        monkeypatch.setitem(mlflow_bulk.TESTED_VERSIONS, mlflow.__version__, "0123456789ab")
    lines = _traced_rewards(mlflow_uri, caplog)
    assert len(lines) == 1, lines
    assert "not using the bulk writer" in lines[0] and "log_spans" in lines[0]
    if seen == "version":
        assert f"MLflow {UNTESTED_VERSION} is not a version it was tested with" in lines[0]
    else:
        assert f"schema revision {revision!r} is not '0123456789ab'" in lines[0]
    client = MlflowClient(tracking_uri=mlflow_uri)
    traces = [client.get_trace(t.info.trace_id) for t in search_traces(mlflow_uri, EXP)]
    assert sorted(t.info.tags["step"] for t in traces) == ["0", "1", "2"]
    assert all([a.value for a in t.info.assessments] == [0.25] for t in traces)
    assert all([s.name for s in t.data.spans] == ["trajectory", "reward"] for t in traces)


def test_bulk_path_is_on_for_the_tested_version_with_one_log_line(
    mlflow_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    import mlflow

    with caplog.at_level(logging.INFO, logger="tracer"):
        exporter = MlflowExporter(
            TraceConfig(backend=None, tracking_uri=mlflow_uri, project_name=EXP)
        )
    assert exporter.bulk is not None
    lines = [r.getMessage() for r in caplog.records if "bulk writer" in r.getMessage()]
    revision = mlflow_bulk.TESTED_VERSIONS.get(mlflow.__version__)
    assert lines == [
        f"rollout-tracer: MLflow store {mlflow_uri}: bulk writer on (MLflow {mlflow.__version__}, "
        f"schema revision {revision}: a version and revision it was tested with)."
    ]


def _counts(uri: str) -> tuple[int, list[int], list[list[str]]]:
    traces = [
        MlflowClient(tracking_uri=uri).get_trace(t.info.trace_id) for t in search_traces(uri, EXP)
    ]
    traces.sort(key=lambda t: t.info.trace_id)
    return (
        len(traces),
        [len(t.data.spans) for t in traces],
        [sorted(a.name for a in t.info.assessments) for t in traces],
    )


def test_replayed_batches_add_nothing(mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> None:
    records = _records()
    exporter = _exporter(mlflow_uri, monkeypatch, bulk=True)
    exporter.export(records)
    first = _counts(mlflow_uri)
    assert first[0] == 4 and first[2].count(["reward"]) == 2  # 1: no reward, 2: failed first
    exporter.export(records, replay=True)
    exporter.export(records, replay=True)
    exporter.export(records)  # a retry not flagged as one: still nothing twice
    exporter.export(records[1:3], replay=True)  # part of a batch
    assert _counts(mlflow_uri) == first


def test_replay_after_mlflow_path_does_not_add_a_second_reward(
    mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch stored by MLflow's own path (random assessment ids), then replayed by a process
    that has the bulk writer: the reward is found by name, not added again."""
    records = _records()
    _exporter(mlflow_uri, monkeypatch, bulk=False).export(records)
    first = _counts(mlflow_uri)
    _exporter(mlflow_uri, monkeypatch, bulk=True).export(records, replay=True)
    assert _counts(mlflow_uri) == first


@pytest.mark.slow
def test_a_batch_of_stored_and_new_traces_adds_each_reward_once_on_postgresql(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PostgreSQL: the rewards of traces a batch creates go straight in, those of traces stored
    before (by MLflow's own path, or by an earlier batch) are looked up by name: a batch that
    mixes them stores what one plain export stores."""
    from benchmarks.postgres import postgres_available, temporary_postgres

    if why := postgres_available():
        pytest.skip(why)
    records = _records()
    with temporary_postgres("once", "mixed") as (once_uri, mixed_uri):
        _exporter(once_uri, monkeypatch, bulk=True).export(records)
        _exporter(mixed_uri, monkeypatch, bulk=False).export(records[:2])
        exporter = _exporter(mixed_uri, monkeypatch, bulk=True)
        exporter.export(records[1:3])  # one trace stored by MLflow's path, one new
        exporter.export(list(reversed(records)), replay=True)  # three stored, one new
        assert _counts(mixed_uri) == _counts(once_uri)
        assert _counts(once_uri)[2].count(["reward"]) == 2


def test_a_failed_batch_stores_nothing_of_it(mlflow_uri: str, monkeypatch: pytest.MonkeyPatch):
    """One transaction: a batch that fails half-way (here: on the assessments insert) leaves no
    trace behind, and its retry stores every trace once."""
    records = _records()
    exporter = _exporter(mlflow_uri, monkeypatch, bulk=True)
    assert exporter.bulk is not None
    good = exporter.bulk._inserts["assessments"]
    exporter.bulk._inserts["assessments"] = "INSERT INTO no_such_table VALUES (1)"
    with pytest.raises(Exception, match="no_such_table"):
        exporter.export(records)
    assert search_traces(mlflow_uri, EXP) == []
    exporter.bulk._inserts["assessments"] = good
    exporter.export(records, replay=True)
    assert _counts(mlflow_uri)[0] == 4
