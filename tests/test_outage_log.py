"""An expected outage is quiet in the rollout's log: one warning line when the backend goes
down (which backend, where it writes, that trajectories are spooling and where), one when it
is back and what waited was sent; the tracebacks only at debug level. The error is MLflow's
own: its REST client against a port where nothing listens."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests._servers import closed_port_url
from tracer.backends import register_backend
from tracer.backends.base import ExportResult
from tracer.backends.jsonl_backend import JsonlExporter

pytest.importorskip("mlflow")


class Switch:
    mode = "up"  # "up" | "down" (MLflow's REST client, refused) | "bug" (an unexpected error)


class FlakyJsonl(JsonlExporter):
    """The real JSONL exporter behind a switch."""

    name = "flaky_jsonl"

    def export(self, batch: Any, *, replay: bool = False) -> ExportResult:
        self._switch()
        return super().export(batch, replay=replay)

    def export_encoded(self, batch: Any, lines: Any, *, replay: bool = False) -> ExportResult:
        self._switch()  # the path the pipeline takes for a byte-oriented backend
        return super().export_encoded(batch, lines, replay=replay)

    def _switch(self) -> None:
        if Switch.mode == "down":
            from mlflow.utils.rest_utils import MlflowHostCreds, http_request

            url = closed_port_url().rsplit("/v1/", 1)[0]
            http_request(MlflowHostCreds(url), "/v1/traces", "POST", max_retries=0, timeout=5)
        if Switch.mode == "bug":
            raise KeyError("a bug in the exporter")


def _trace(n: int) -> None:
    for i in range(n):
        with tracer.trace_attr(step=1, sample_index=i):
            pass


def _wait(predicate: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_an_outage_logs_one_line_down_and_one_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    register_backend("flaky_jsonl", FlakyJsonl)
    caplog.set_level(logging.DEBUG, logger="tracer")
    spool = tmp_path / "spool"
    tracer.init(backend="flaky_jsonl", jsonl_path=str(tmp_path / "t.jsonl"),
                spool_dir=str(spool), flush_interval_s=0.05, export_max_retries=2,
                replay_interval_s=0.05)  # fmt: skip
    Switch.mode = "down"
    try:
        _trace(20)
        _wait(lambda: tracer.metrics()["tracer/flaky_jsonl/down"] == 1)
        _trace(10)  # while down: no new line
        time.sleep(0.3)  # a few probes fail meanwhile
        Switch.mode = "up"
        assert tracer.flush(timeout_s=30)
    finally:
        Switch.mode = "up"
    mine = [r for r in caplog.records if r.name == "tracer"]
    loud = [r for r in mine if r.levelno >= logging.WARNING]
    assert [r.getMessage().split(" is ")[1][:4] for r in loud] == ["down", "back"], loud
    down, back = (r.getMessage() for r in loud)
    assert "backend flaky_jsonl (" in down and str(tmp_path / "t.jsonl") in down
    assert "MlflowException" in down and f"spooling to {spool}" in down
    assert "the 30 trajectories that waited have been sent" in back
    assert not any(r.exc_info for r in loud)  # no traceback in the rollout's log
    quiet = [r for r in mine if r.levelno == logging.DEBUG and r.exc_info]
    assert len(quiet) >= 3  # each failed attempt, with its traceback, at debug level
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 30


def test_an_unexpected_error_keeps_its_traceback_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    register_backend("flaky_jsonl", FlakyJsonl)
    caplog.set_level(logging.WARNING, logger="tracer")
    tracer.init(backend="flaky_jsonl", jsonl_path=str(tmp_path / "t.jsonl"),
                spool_dir=str(tmp_path / "spool"), flush_interval_s=0.05,
                export_max_retries=2, replay_interval_s=0.05)  # fmt: skip
    Switch.mode = "bug"
    try:
        _trace(5)
        _wait(lambda: tracer.metrics()["tracer/flaky_jsonl/down"] == 1)
        time.sleep(0.2)
    finally:
        Switch.mode = "up"
    assert tracer.flush(timeout_s=30)
    raised = [r for r in caplog.records if "raised KeyError" in r.getMessage()]
    assert raised and raised[0].exc_info and not any(r.exc_info for r in raised[1:])
    assert len(raised) <= 2  # the 1st and the 10th at most: rate-limited


class SwitchedByFile(FlakyJsonl):
    """FlakyJsonl with its switch in a file: the export process reads it there."""

    name = "switched_jsonl"

    def _switch(self) -> None:
        Switch.mode = Path(os.environ["OUTAGE_SWITCH_FILE"]).read_text()
        super()._switch()


def test_an_outage_in_the_export_process_logs_the_same_two_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend exports from a child process (``export_in_subprocess``): its errors reach the
    parent's outage log, classified there as in process (MLflow's own REST error, raised in the
    child): one line down, one back, nothing per attempt."""
    switch = tmp_path / "switch"
    switch.write_text("up")
    monkeypatch.setenv("OUTAGE_SWITCH_FILE", str(switch))
    register_backend("switched_jsonl", f"{__name__}:SwitchedByFile")
    caplog.set_level(logging.DEBUG, logger="tracer")
    spool = tmp_path / "spool"
    tracer.init(backend="switched_jsonl", jsonl_path=str(tmp_path / "t.jsonl"),
                spool_dir=str(spool), flush_interval_s=0.05, export_max_retries=2,
                replay_interval_s=0.05, export_in_subprocess=True)  # fmt: skip
    worker = tracer.get_tracer().pipeline.workers[0]
    assert worker.exporter.pid not in (None, os.getpid())
    switch.write_text("down")
    _trace(20)
    _wait(lambda: tracer.metrics()["tracer/switched_jsonl/down"] == 1, timeout=60)
    _trace(10)
    failed = worker.errors.counts["export switched_jsonl"]
    _wait(lambda: worker.errors.counts["export switched_jsonl"] >= failed + 3)  # probes fail
    switch.write_text("up")
    assert tracer.flush(timeout_s=60)
    assert worker.exporter.starts == 1  # the child answered every time: never replaced
    loud = [r for r in caplog.records if r.name == "tracer" and r.levelno >= logging.WARNING]
    assert [r.getMessage().split(" is ")[1][:4] for r in loud] == ["down", "back"], loud
    down, back = (r.getMessage() for r in loud)
    assert "ExportProcessOutage: MlflowException" in down and f"spooling to {spool}" in down
    assert "the 30 trajectories that waited have been sent" in back
    assert not any(r.exc_info for r in loud)
    assert len((tmp_path / "t.jsonl").read_text().splitlines()) == 30
