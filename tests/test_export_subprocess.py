"""export_in_subprocess: the backend's export calls run in a child process (off the rollout's
GIL); results read back from the real MLflow store; a killed child loses nothing."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

import tracer
from tests.conftest import search_traces

pytest.importorskip("mlflow")


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
