"""End to end: a real ``rollout-tracer run`` (scripted engine) traces into a real MLflow store;
``rollout-tracer explore --from mlflow`` exports it into its cache and serves it; the run's
trajectories, as MLflow's own ``search_traces`` lists them, are all found through the API, and
its behaviour patterns are there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("duckdb")
pytest.importorskip("tantivy")

from rollout.cli import main
from tests._explore import get
from tests.conftest import search_traces

PROJECT = "explore-e2e"
STEPS, BATCH, N = 2, 2, 2


def _start_explore(args: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "rollout.cli", "explore", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    seen = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if "http://" in line:
            return proc, line.split("http://", 1)[1].split("/", 1)[0]
    proc.kill()
    raise AssertionError("explore did not start:\n" + "".join(seen))


@pytest.mark.slow(seconds=9)
def test_run_into_mlflow_then_explore(tmp_path: Path, mlflow_uri: str) -> None:
    env = dict(os.environ, MLFLOW_TRACKING_URI=mlflow_uri)
    code = main(["run", "--no-progress", "actor_rollout_ref.rollout.name=scripted",
                 f"trainer.total_steps={STEPS}", f"data.train_batch_size={BATCH}",
                 f"actor_rollout_ref.rollout.n={N}", "trainer.logger=[console]",
                 f"trainer.project_name={PROJECT}", "trainer.val_before_train=false",
                 "actor_rollout_ref.rollout.trace.backend=mlflow",
                 f"actor_rollout_ref.rollout.trace.tracking_uri={mlflow_uri}"])  # fmt: skip
    assert code == 0
    traces = search_traces(mlflow_uri, PROJECT)
    assert len(traces) >= STEPS * BATCH * N
    ids = {t.info.trace_id.removeprefix("tr-") for t in traces}

    proc, host = _start_explore(["--from", "mlflow", "--tracking-uri", mlflow_uri,
                                 "--experiment", PROJECT, "--port", "0", "--no-progress",
                                 "--cache-dir", str(tmp_path / "cache")], env)  # fmt: skip
    try:
        assert host.startswith("127.0.0.1:")  # local only unless --host says otherwise
        base = f"http://{host}/"
        status, body = get(base, "api/list", size=500, cols="step,reward,prompt")
        assert status == 200, body
        assert {r["trace_id"] for r in body["rows"]} == ids
        assert body["total"] == len(ids)
        for step in range(1, STEPS + 1):
            n = get(base, "api/list", step=f"{step}:{step}", validate="false", size=1)[1]["total"]
            assert n == BATCH * N
        one = body["rows"][0]
        status, traj = get(base, "api/trajectory", id=one["trace_id"])
        assert status == 200, traj
        assert traj["turns"] and traj["trajectory"]["prompt"] == one["prompt"]
        assert f"tr-{one['trace_id']}" in traj["mlflow_url"]
        word = next(w for w in (traj["turns"][0]["response_text"] or "").split() if w.isalpha())
        for _ in range(120):  # the search index is built in the background
            status, found = get(base, "api/search", q=word, size=200)
            if status != 503:
                break
            time.sleep(0.5)
        assert status == 200, found
        assert one["trace_id"] in {h["trace_id"] for h in found["hits"]} or found["total"] > 200
        for _ in range(120):  # the patterns: computed after the compacted copy
            status, habits = get(base, "api/patterns", step=1)
            if status != 503:
                break
            time.sleep(0.5)
        assert status == 200, habits
        assert habits["steps"] == list(range(1, STEPS + 1))
        assert sum(p["n"] for p in habits["patterns"]) == BATCH * N  # all of step 1's, ranked
        assert habits["patterns"][0]["example"] in ids
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the command returns
        assert proc.wait(timeout=30) == 0


def test_refresh_picks_up_new_trajectories(tmp_path: Path) -> None:
    """``--from jsonl --refresh 1``: trajectories written while the explorer runs show up."""
    import tracer
    from tests.test_export import _records
    from tracer.backends.jsonl_backend import JsonlExporter

    path = tmp_path / "t.jsonl"
    writer = JsonlExporter(tracer.TraceConfig(backend="jsonl", jsonl_path=str(path)))
    records = _records(60)
    writer.export(records[:40])
    proc, host = _start_explore(["--from", "jsonl", "--path", str(path), "--port", "0",
                                 "--no-progress", "--no-search", "--refresh", "1",
                                 "--cache-dir", str(tmp_path / "cache")],
                                dict(os.environ))  # fmt: skip
    try:
        base = f"http://{host}/"
        assert get(base, "api/list", size=1)[1]["total"] == 40
        writer.export(records[40:])
        for _ in range(240):
            total = get(base, "api/list", size=1)[1]["total"]
            if total == 60:
                break
            time.sleep(0.5)
        assert total == 60
        assert get(base, "api/trajectory", id=records[59].trace_id)[0] == 200
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 0
