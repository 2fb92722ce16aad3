"""export_in_subprocess: the backend's export calls run in a child process (off the rollout's
GIL); results read back from the real MLflow store; a killed child loses nothing."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import tracer
from tests.conftest import search_traces

pytestmark = pytest.mark.export_child  # the export child is what these test

pytest.importorskip("mlflow")


@pytest.mark.slow(seconds=7)
def test_mlflow_export_in_a_child_process_survives_its_death(tmp_path: Path, mlflow_uri: str):
    tracer.init(backend="mlflow", tracking_uri=mlflow_uri, project_name="sub",
                export_in_subprocess=True, spool_dir=str(tmp_path / "spool"),
                export_max_retries=2, replay_interval_s=0.5, raise_internal_errors=True)

    @tracer.trace_op(kind="generate")
    def generate(prompt: str) -> str:
        return prompt.upper()

    @tracer.trace_op(kind="reward")
    def reward(i: int) -> float:
        return float(i % 2)

    def trace(first: int, n: int) -> None:
        for i in range(first, first + n):
            with tracer.trace_attr(step=i // 50, sample_index=i % 50):
                generate(f"q{i}")
                reward(i)

    trace(0, 100)
    assert tracer.flush(120)
    worker = tracer.get_tracer().pipeline.workers[0]
    pid = worker.exporter.pid
    assert pid is not None and pid != os.getpid()  # the export really ran elsewhere
    os.kill(pid, signal.SIGKILL)  # the export process crashes
    trace(100, 100)
    assert tracer.flush(120), tracer.metrics()
    assert worker.exporter.pid not in (None, pid)  # restarted
    traces = search_traces(mlflow_uri, "sub")
    keys = {(t.info.tags["step"], t.info.tags["sample_index"]) for t in traces}
    assert len(traces) == 200 and len(keys) == 200
    assert sum(1 for t in traces for a in t.info.assessments if a.name == "reward") == 200
    tracer.shutdown()
    assert worker.exporter.pid is None


def test_the_child_stores_from_the_spools_bytes_what_the_parent_would(
    tmp_path: Path, mlflow_uri: str
) -> None:
    """The parent sends each batch's JSON lines, never decoding its records; the child reads
    them back: what it stores is what the in-process export stores."""

    @tracer.trace_op(kind="generate")
    def generate(messages: list[dict[str, str]], prompt_ids: list[int]) -> dict[str, object]:
        return {"text": "42", "response_ids": [7, 8, 9], "finish_reason": "stop",
                "scores": {"a": 1.5, "b": [1, 2]}}  # fmt: skip

    @tracer.trace_op(kind="tool")
    def tool(name: str, args: dict[str, str]) -> str:
        return "42"

    def run(project: str, in_subprocess: bool) -> list[object]:
        tracer.init(backend="mlflow", tracking_uri=mlflow_uri, project_name=project,
                    export_in_subprocess=in_subprocess, spool_dir=str(tmp_path / project),
                    raise_internal_errors=True)  # fmt: skip
        try:
            for i in range(5):
                with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
                    generate([{"role": "user", "content": f"q{i} ünïcode"}], [1, 2, i])
                    tool("calculator", {"expression": "6*7"})
            worker = tracer.get_tracer().pipeline.workers[0]
            assert worker.wants_lines == in_subprocess
            assert tracer.flush(120)
        finally:
            tracer.reset()
        traces = sorted(search_traces(mlflow_uri, project),
                        key=lambda t: int(t.info.tags["sample_index"]))  # fmt: skip
        assert len(traces) == 5
        return [
            [(s.name, s.span_type, s.inputs, s.outputs, s.attributes.get("finish_reason"))
             for s in sorted(t.data.spans, key=lambda s: s.start_time_ns)]
            for t in traces
        ]

    here, there = run("inproc", False), run("child", True)
    assert there == here
    assert there[3][1][2] == {"messages": [{"role": "user", "content": "q3 ünïcode"}],
                              "prompt_ids": [1, 2, 3]}  # fmt: skip
    assert there[3][1][3]["scores"] == {"a": 1.5, "b": [1, 2]}


def test_by_default_only_the_builtin_mlflow_backend_exports_from_a_child(
    tmp_path: Path, mlflow_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    from tracer.backends import register_backend
    from tracer.backends.mlflow_backend import MlflowExporter
    from tracer.backends.subprocess_proxy import SubprocessExporter

    def trace_two(project: str, **kw: object) -> object:
        tracer.init(backend=["mlflow", "jsonl"], tracking_uri=mlflow_uri, project_name=project,
                    jsonl_path=str(tmp_path / f"{project}.jsonl"),
                    spool_dir=str(tmp_path / "spool"), **kw)  # fmt: skip
        try:
            for i in range(2):
                with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
                    pass
            assert tracer.flush(120)
            return {w.name: w.exporter for w in tracer.get_tracer().pipeline.workers}
        finally:
            tracer.reset()

    exporters = trace_two("auto")  # the default: MLflow's Python off the rollout's process
    assert isinstance(exporters["mlflow"], SubprocessExporter)
    assert type(exporters["jsonl"]).__name__ == "JsonlExporter"  # cheap, and writes ahead
    assert len(search_traces(mlflow_uri, "auto")) == 2
    assert isinstance(trace_two("off", export_in_subprocess=False)["mlflow"], MlflowExporter)

    class Subclass(MlflowExporter):  # a child could not make it from its name: stays here
        name = "mlflow_here"

    register_backend("mlflow_here", Subclass)
    with caplog.at_level("WARNING", logger="tracer"):
        tracer.init(backend="mlflow_here", tracking_uri=mlflow_uri, project_name="sub2",
                    spool_dir=str(tmp_path / "spool"))  # fmt: skip
    try:
        assert type(tracer.get_tracer().pipeline.workers[0].exporter) is Subclass
    finally:
        tracer.reset()
    # not even tried: a child that cannot make it would fail, and the fall back say so
    assert "export process" not in caplog.text


def test_asked_for_a_child_with_no_python_to_start_it_init_fails(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``export_in_subprocess=True`` is strict: no child, an init error like any backend's (the
    default falls back to this process: tests/test_export_child.py)."""
    from tracer.backends import subprocess_proxy

    monkeypatch.setattr(subprocess_proxy.sys, "executable", str(tmp_path / "uwsgi"))
    monkeypatch.setattr("multiprocessing.spawn.get_executable", lambda: str(tmp_path / "uwsgi"))
    with pytest.raises(RuntimeError, match="is not a Python interpreter"):
        tracer.init(backend="mlflow", tracking_uri=mlflow_uri, project_name="strict",
                    export_in_subprocess=True, spool_dir=str(tmp_path / "spool"))  # fmt: skip
