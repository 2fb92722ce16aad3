"""A batch the spool's disk refused (full) waits in memory only until the disk takes it again:
then it is written to the spool within ``RESPOOL_INTERVAL_S``, even while the backend is still
down, so a process that dies later loses nothing. A batch still refused at shutdown is counted
by reason, never lost silently. Real MLflow store behind the ``flaky`` exporter of
``tests/test_faults.py``; the full disk is a real tmpfs where one can be mounted."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

import tracer
import tracer.spool as spool_mod
from tests._disks import full_disk
from tests.test_faults import _faults, base_config, stored_keys, trace  # noqa: F401
from tracer.spool import batch_size
from tracer.spool_folders import spool_folders

pytest.importorskip("mlflow")
import tests.test_faults as faults


def spooled(spool: Path) -> int:
    """Trajectories in the spool's batch files (every backend folder under ``spool``)."""
    return sum(batch_size(p) for p in spool.glob("*/*.jsonl"))


def wait_for(condition, what: str, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout_s} s for {what}: {tracer.metrics()}"
        time.sleep(0.05)


def shut_down(timeout_s: float) -> dict[str, float]:
    """Shut the tracer down with the backend down (not graceful); its final metrics, which
    reconcile (submitted == exported + pending + dropped)."""
    pipeline = tracer.get_tracer().pipeline
    assert pipeline is not None
    assert tracer.shutdown(timeout_s) is False
    m = pipeline.metrics()
    p = "tracer/flaky/"
    assert m["tracer/submitted"] == m[p + "exported"] + m[p + "pending"] + m[p + "dropped"], m
    return m


def test_batches_the_full_disk_refused_are_spooled_when_space_returns(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    spool = tmp_path / "spool"
    with full_disk(spool, monkeypatch, spool_mod, "_write_new") as free_space:
        faults.FAULTS.down = True  # the backend is down and the disk is full: memory only
        tracer.init(base_config(tmp_path, mlflow_uri))
        trace(20, step=0)
        wait_for(lambda: tracer.metrics()["tracer/flaky/spool_errors"] >= 2, "two refusals")
        assert tracer.metrics()["tracer/flaky/pending"] == 20
        assert tracer.metrics()["tracer/durability_lag_s"] > 0  # only memory holds them
        assert spooled(spool) == 0
        free_space()  # the backend is still down: only the spool can take them now
        wait_for(lambda: spooled(spool) == 20, "the 20 trajectories in the spool", 5.0)
        wait_for(lambda: tracer.metrics()["tracer/durability_lag_s"] == 0, "lag 0", 5.0)
        # the folder's destination.json, refused at init, came with them: without it
        # `rollout-tracer replay` does not see the folder (issue 56's chaos soak found it)
        assert [meta["backend"] for _, meta in spool_folders(str(spool))] == ["flaky"]
        # shut down with the backend down: they stay on disk, none lost
        m = shut_down(1.0)
        assert m["tracer/flaky/dropped"] == 0, m
        assert spooled(spool) == 20
        # the backend is back: the next tracer on this spool stores each of them once
        faults.FAULTS.down = False
        tracer.init(base_config(tmp_path, mlflow_uri))
        trace(5, step=1)  # its worker starts with its first trajectory and adopts orphans
        wait_for(lambda: len(stored_keys(mlflow_uri)) >= 25, "25 traces stored", 30.0)
        assert tracer.flush(30)
        keys = stored_keys(mlflow_uri)
        assert len(keys) == 25 and len(set(keys)) == 25
        assert spooled(spool) == 0


def test_a_batch_the_disk_still_refuses_at_shutdown_is_counted_by_reason(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    with full_disk(tmp_path / "spool", monkeypatch, spool_mod, "_write_new"):
        faults.FAULTS.down = True
        tracer.init(base_config(tmp_path, mlflow_uri))
        trace(20, step=0)
        wait_for(lambda: tracer.metrics()["tracer/flaky/spool_errors"] >= 2, "two refusals")
        with caplog.at_level(logging.ERROR, logger="tracer"):
            m = shut_down(1.0)
        assert m["tracer/flaky/dropped/disk_full_at_shutdown"] == 20, m
        assert m["tracer/flaky/dropped"] == 20 and m["tracer/flaky/pending"] == 0
        lines = [r.getMessage() for r in caplog.records if "disk_full_at_shutdown" in
                 r.getMessage()]  # fmt: skip
        assert lines and "20 trajectories lost" in lines[0], lines
