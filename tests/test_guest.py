"""The tracer is a guest in the rollout's process: it leaves the host as it found it, and a
finished trajectory reaches the disk within a bounded time whatever the host is doing.

Each case runs the real pipeline into a real store (a JSONL file, an embedded MLflow store) and
reads back what arrived.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import tracer
from tracer.backends import register_backend
from tracer.backends.base import Exporter, ExportResult

SIGNALS = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
                       signal.SIGCHLD, signal.SIGPIPE)]  # fmt: skip


def _host_state() -> dict[str, Any]:
    """Everything process-wide the tracer must never change."""
    root = logging.getLogger()
    return {
        "switch_interval": sys.getswitchinterval(),
        "root_logger": (root.level, list(root.handlers), root.disabled),
        "warnings_filters": list(warnings.filters),
        "signals": [signal.getsignal(s) for s in SIGNALS],
        "environ": dict(os.environ),
        "excepthooks": (sys.excepthook, threading.excepthook, sys.unraisablehook),
        "random": random.getstate(),
    }


@contextmanager
def _watched() -> Iterator[list[tuple[str, Any, Any]]]:
    """Sample the host's state every millisecond from another thread; yields what changed."""
    before = _host_state()
    changes: list[tuple[str, Any, Any]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            now = _host_state()
            for key, value in now.items():
                if value != before[key] and not any(c[0] == key for c in changes):
                    changes.append((key, before[key], value))
            time.sleep(0.001)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield changes
    finally:
        stop.set()
        watcher.join(5)
        after = _host_state()  # and once more after the tracer is gone
        for key, value in after.items():
            if value != before[key] and not any(c[0] == key for c in changes):
                changes.append((key, before[key], value))


@tracer.trace_op(kind="generate")
def _generate(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"text": "The answer is 42. #### 42", "token_ids": list(range(100))}


@tracer.trace_op(kind="tool")
def _tool(expression: str) -> str:
    return str(len(expression))


@tracer.trace_op(kind="reward")
def _reward(text: str) -> float:
    return 1.0


def _rollout(i: int, step: int = 0) -> None:
    with tracer.trace_attr(step=step, sample_index=i, rollout_n=0):
        out = _generate([{"role": "user", "content": f"question {i} " * 20}])
        _tool("6*7")
        _reward(out["text"])


def test_a_traced_run_changes_nothing_process_wide(tmp_path: Path) -> None:
    """A user's own switch interval, logging, warnings, signals, environment, hooks and global
    random state stay as they were, while the tracer exports to JSONL and an embedded MLflow
    store, and after it shut down."""
    pytest.importorskip("mlflow")
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.02)  # the user's own choice
    try:
        with _watched() as changes:
            tracer.init(backend=["jsonl", "mlflow"], jsonl_path=str(tmp_path / "t.jsonl"),
                        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                        spool_dir=str(tmp_path / "spool"), flush_interval_s=0.05,
                        project_name="guest", experiment_name="run")  # fmt: skip
            for i in range(60):
                _rollout(i)
                if i % 20 == 0:
                    time.sleep(0.1)  # exports run while the rollout goes on
            assert tracer.flush(120)
            assert tracer.shutdown(60)
            tracer.reset()
        assert sys.getswitchinterval() == 0.02
    finally:
        sys.setswitchinterval(old)
    assert changes == []
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert len(lines) == 60


class _Busy:
    """A Python thread of the host that wants the GIL all the time (a reward function, a
    tokenizer pool)."""

    def __enter__(self) -> _Busy:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()
        return self

    def _spin(self) -> None:
        x = 0
        while not self.stop.is_set():
            for _ in range(10_000):
                x += 1

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def _wait_for(predicate: Any, timeout_s: float) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - start


def test_durability_lag_is_published_and_ends_without_a_flush(tmp_path: Path) -> None:
    """With a busy host thread, finished trajectories reach the spool within about the flush
    interval, without anybody calling flush(); ``tracer/durability_lag_s`` says how old the
    oldest one not yet on disk is."""
    path = tmp_path / "out.jsonl"
    tracer.init(backend="jsonl", jsonl_path=str(path), spool_dir=str(tmp_path / "spool"),
                flush_interval_s=0.5, export_batch_size=10_000)  # fmt: skip
    try:
        with _Busy():
            for i in range(300):
                _rollout(i)
            first = tracer.metrics()["tracer/durability_lag_s"]
            time.sleep(0.2)
            assert tracer.metrics()["tracer/durability_lag_s"] > first > 0  # waiting, aging
            # on disk (spool or store) well within the flush interval plus the work, which
            # the busy thread may slow to half speed: never held back for it
            _wait_for(lambda: tracer.metrics()["tracer/durability_lag_s"] == 0, 30)
            _wait_for(lambda: path.exists() and len(path.read_text().splitlines()) == 300, 30)
    finally:
        tracer.reset()


class _Stuck(Exporter):
    """A backend that is not spooled and never answers: its batches stay in memory only."""

    name = "stuck_memory"
    spoolable = False
    release = threading.Event()

    def __init__(self, config: Any = None) -> None:
        pass

    def export(self, batch: Any, *, replay: bool = False) -> ExportResult:
        _Stuck.release.wait(60)
        return ExportResult.SUCCESS


def test_durability_lag_grows_while_only_memory_holds_a_trajectory(tmp_path: Path) -> None:
    register_backend("stuck_memory", _Stuck)
    _Stuck.release.clear()
    tracer.init(backend="stuck_memory", flush_interval_s=0.05)
    try:
        _rollout(0)
        _rollout(1)
        _wait_for(lambda: tracer.metrics()["tracer/durability_lag_s"] > 0.5, 10)
        _Stuck.release.set()
        _wait_for(lambda: tracer.metrics()["tracer/durability_lag_s"] == 0, 10)
    finally:
        _Stuck.release.set()
        tracer.reset()


CHILD = textwrap.dedent(
    """
    import sys, threading, time
    import tracer

    out, spool = sys.argv[1], sys.argv[2]

    def busy():  # a host thread that wants the GIL all the time
        x = 0
        while True:
            x += 1

    threading.Thread(target=busy, daemon=True).start()
    tracer.init(backend="jsonl", jsonl_path=out, spool_dir=spool)  # the defaults otherwise

    # the benchmarks' workload: 3 generate calls (300 prompt ids, 100 response ids, 4
    # messages), 3 tool calls and a reward per trajectory
    @tracer.trace_op(kind="generate")
    def generate(messages, prompt_ids):
        return {"text": "Let me compute. <tool_call>6*7</tool_call>",
                "response_ids": list(range(1000, 1100))}

    @tracer.trace_op(kind="tool")
    def tool(expression):
        return {"result": str(len(expression)) * 20}

    @tracer.trace_op(kind="reward")
    def reward(text):
        return 1.0

    for i in range(1000):  # a step's trajectories all finish at once
        with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
            messages = [{"role": "system", "content": "You solve math. " * 10},
                        {"role": "user", "content": "question %d: what is 6*7? " % i * 5}]
            for turn in range(3):
                out = generate(messages + [{"role": "assistant", "content": "x" * 200}] * 2,
                               list(range(300)))
                tool("6*7")
            reward(out["text"])
    print("finished", flush=True)
    done = time.monotonic()
    # the documented bound is not a fixed number of seconds: a finished trajectory is on disk
    # once tracer/durability_lag_s reads 0 (flush_interval_s plus the backlog before it)
    while tracer.metrics()["tracer/durability_lag_s"] > 0:
        if time.monotonic() - done > 120:
            print("still in memory after 120 s", flush=True)
            break
        time.sleep(0.05)
    else:
        print("durable %.2f" % (time.monotonic() - done), flush=True)
    time.sleep(120)
    """
)


def test_a_busy_process_sigkilled_once_its_durability_lag_is_0_loses_nothing_after_replay(
    tmp_path: Path,
) -> None:
    # the kill comes as soon as the child's own tracer/durability_lag_s reads 0 (a fixed 3 s
    # was a timing claim: at a load of 7 a third of the step was still in memory then)
    from tracer.replay import replay

    out, spool = tmp_path / "out.jsonl", tmp_path / "spool"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.Popen([sys.executable, str(script), str(out), str(spool)],
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "finished"
        durable = child.stdout.readline().strip()  # "durable SECONDS" after the step finished
        assert durable.startswith("durable "), durable
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    before = len(out.read_text().splitlines()) if out.exists() else 0
    result = replay(str(spool))
    assert result.ok, result.failed
    ids = {json.loads(line)["trace_id"] for line in out.read_text().splitlines()}
    lost = 1000 - len(ids)
    assert lost == 0, f"{lost} lost ({before} exported before the kill, {durable})"
