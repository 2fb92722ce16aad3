"""The trackio backend through trackio's public API only (``init``, ``log``, ``finish``,
``Trace``, ``context_vars``): against a real trackio server made slow (SIGSTOP) or killed and
restarted, read back with trackio's own storage API; and against a stand-in module that has
nothing but those public names, so any other access fails.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import secrets
import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests._servers import free_port

pytest.importorskip("trackio")

PROJECT = "flush-tests"
RUN = "run-1"

_SERVER = """\
import sys, time, trackio
app, url, share, full = trackio.show(open_browser=False, block_thread=False,
                                     server_port=int(sys.argv[1]))
print("URL", full, flush=True)
while True:
    time.sleep(60)
"""


class TrackioServer:
    """A real trackio server (``trackio.show``) in its own process group, storing under its own
    TRACKIO_DIR, on a fixed port and write token so that it can be restarted."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.env = {**os.environ, "TRACKIO_DIR": str(folder),
                    "TRACKIO_WRITE_TOKEN": secrets.token_urlsafe(16)}  # fmt: skip
        self.env.pop("TRACKIO_SERVER_URL", None)
        self.url = ""
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(self.port)],
                                     env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode()
            if not line:
                pytest.fail("the trackio server exited before it was up")
            if line.startswith("URL "):
                self.url = line.split()[1]
                return
        pytest.fail("the trackio server did not start within 60 s")

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        if sig == signal.SIGKILL:
            self.proc.wait(10)


@pytest.fixture
def trackio_server(tmp_path: Path) -> Iterator[TrackioServer]:
    server = TrackioServer(tmp_path / "server")
    server.start()
    try:
        yield server
    finally:
        server.signal(signal.SIGCONT)
        server.signal(signal.SIGKILL)


def _stored_traces(folder: Path, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The traces a trackio store holds, read with trackio's own storage API."""
    import trackio.sqlite_storage
    from trackio.sqlite_storage import SQLiteStorage

    monkeypatch.setattr(trackio.sqlite_storage, "TRACKIO_DIR", folder)
    return list(SQLiteStorage.get_traces(PROJECT, run=RUN))


def _wait_stored(server: TrackioServer, monkeypatch: pytest.MonkeyPatch,
                 n: int) -> list[dict[str, Any]]:  # fmt: skip
    deadline = time.monotonic() + 60
    while len(stored := _stored_traces(server.folder, monkeypatch)) < n:
        assert time.monotonic() < deadline, stored
        time.sleep(0.1)
    return stored


def _trajectory(i: int) -> None:
    @tracer.trace_op(kind="tool")
    def tool(x: int) -> int:
        return x

    with tracer.trace_attr(step=i, sample_index=i):
        tool(i)


def _records(n: int) -> list[Any]:
    """``n`` traced trajectories' records, made with the memory backend."""
    from tracer.testing import InMemoryExporter

    tracer.init(backend="memory")
    for i in range(n):
        _trajectory(i)
    assert tracer.flush(30)
    records = InMemoryExporter.latest().records
    tracer.reset()
    return list(records)


def _spooled(spool: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in spool.glob("trackio-*/*.jsonl"))


@pytest.mark.parametrize("outage", ["stopped", "restarted"])
def test_a_slow_trackio_server_gets_each_trace_once_from_trackios_own_sender(
    outage: str, trackio_dir: Path, trackio_server: TrackioServer, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """``stopped``: the server stops answering (SIGSTOP), requests hang in trackio's sender.
    ``restarted``: the server dies (requests fail, trackio keeps them in its local buffer) and
    comes back on the same port. trackio has no public flush: a batch is exported once
    trackio.log took it, so flush does not wait for the server; trackio's own sender and
    finish() (at the tracer's shutdown) deliver it, each trace once."""
    server = trackio_server
    monkeypatch.setenv("TRACKIO_SERVER_URL", server.url)
    spool = tmp_path / "spool"
    tracer.init(backend="trackio", project_name=PROJECT, experiment_name=RUN,
                spool_dir=str(spool), export_timeout_s=1, export_max_retries=0,
                flush_interval_s=0.05, replay_interval_s=0.2)  # fmt: skip
    _trajectory(0)
    assert tracer.flush(60)
    # the outage comes mid-run: trackio's client has connected and delivered the first trace
    # (if the server is down before the client ever connects, finish() waits 5 s, keeps the rest
    # locally, and trackio 0.43 re-sends it to a server only after a later failed send; see
    # docs/backends.md)
    _wait_stored(server, monkeypatch, 1)
    server.signal(signal.SIGSTOP if outage == "stopped" else signal.SIGKILL)
    try:
        for i in range(1, 4):
            _trajectory(i)
        t0 = time.monotonic()
        assert tracer.flush(30)  # handed to trackio: not held up by its server
        assert time.monotonic() - t0 < 5
        assert _spooled(spool) == 0
        assert tracer.metrics()["tracer/trackio/exported"] == 4
    finally:
        if outage == "stopped":
            server.signal(signal.SIGCONT)
        else:
            server.start()
    tracer.shutdown(60)  # trackio.finish(): trackio sends what it holds, the server being up
    _wait_stored(server, monkeypatch, 4)
    time.sleep(1)  # a second copy would come right after the first
    stored = _stored_traces(server.folder, monkeypatch)
    assert sorted(t["metadata"]["step"] for t in stored) == [0, 1, 2, 3]  # each once


class PublicTrackio:
    """trackio's public surface and nothing more: a module with ``init``, ``log``, ``finish``,
    ``Trace`` and ``context_vars.current_run`` (a real ContextVar, as in trackio), whose runs
    have only ``project``, ``name`` and ``id``. A stand-in, not trackio: the point is which
    names the backend touches; any other attribute raises AttributeError. It records calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.current: contextvars.ContextVar[Any] = contextvars.ContextVar("run", default=None)
        module = types.ModuleType("trackio")
        module.init = self.init  # type: ignore[attr-defined]
        module.log = self.log  # type: ignore[attr-defined]
        module.finish = self.finish  # type: ignore[attr-defined]
        module.Trace = lambda messages, metadata=None: {"messages": messages,  # type: ignore[attr-defined]
                                                         "metadata": metadata}  # fmt: skip
        module.context_vars = types.SimpleNamespace(current_run=self.current)  # type: ignore[attr-defined]
        self.module = module

    def init(self, project: str, name: str | None = None, config: Any = None,
             resume: str = "never") -> Any:  # fmt: skip
        previous = self.current.get()
        if previous is not None:  # as trackio.init does
            self.calls.append(("finish", previous.name))
        run = types.SimpleNamespace(project=project, name=name, id=f"id-{name}")
        self.current.set(run)
        self.calls.append(("init", project, name, config, resume))
        return run

    def log(self, metrics: dict[str, Any], step: int | None = None) -> None:
        run = self.current.get()
        if run is None:
            raise RuntimeError("Call trackio.init() before trackio.log().")  # as trackio
        for key, trace in metrics.items():
            self.calls.append(("log", run.name, key, trace["metadata"]["trace_id"], step))

    def finish(self) -> None:
        run = self.current.get()
        if run is None:
            raise RuntimeError("Call trackio.init() before trackio.finish().")
        self.calls.append(("finish", run.name))
        self.current.set(None)


@pytest.fixture
def public_trackio(monkeypatch: pytest.MonkeyPatch) -> PublicTrackio:
    stand_in = PublicTrackio()
    monkeypatch.setitem(sys.modules, "trackio", stand_in.module)
    return stand_in


def test_only_trackios_public_api_is_used(public_trackio: PublicTrackio, tmp_path: Path) -> None:
    tracer.init(backend="trackio", project_name=PROJECT, experiment_name=RUN,
                spool_dir=str(tmp_path / "spool"), flush_interval_s=0.05)  # fmt: skip
    _trajectory(0)
    _trajectory(1)
    assert tracer.flush(30)
    assert public_trackio.current.get() is None  # the caller's context has no run of ours
    tracer.shutdown(30)
    ids = [c[3] for c in public_trackio.calls if c[0] == "log"]
    assert public_trackio.calls == [
        ("init", PROJECT, RUN, {"framework": "verl"}, "never"),
        ("log", RUN, "rollout_trace/tool", ids[0], 0),
        ("log", RUN, "rollout_trace/tool", ids[1], 1),
        ("finish", RUN),
    ]


def test_a_batch_sent_again_is_logged_once(public_trackio: PublicTrackio) -> None:
    """trackio has no upsert: a replayed batch (after a failure, or an export retried) must
    not log a trajectory this process has handed over already. Exported on the caller's
    thread, whose current run (the trainer's, another project) stays current and running."""
    from tracer.backends.trackio_backend import TrackioExporter
    from tracer.config import TraceConfig
    records = _records(3)
    train = public_trackio.init(project="metrics", name="train")
    exporter = TrackioExporter(TraceConfig(project_name=PROJECT, experiment_name=RUN))
    exporter.export(records[:2])
    exporter.export(records, replay=True)
    logged = [c[3] for c in public_trackio.calls if c[0] == "log"]
    assert logged == [r.trace_id for r in records]
    exporter.shutdown()
    assert public_trackio.current.get() is train
    assert ("finish", "train") not in public_trackio.calls


def test_two_exporters_of_a_process_share_one_run_finished_by_the_last(
    public_trackio: PublicTrackio,
) -> None:
    """The traces' exporter and the annotator's log into one run (trackio finds a run by name
    only once its sender has stored it): started once, finished once, by the last to stop."""
    from tracer.backends.trackio_backend import TrackioExporter
    from tracer.config import TraceConfig
    records = _records(2)
    config = TraceConfig(project_name=PROJECT, experiment_name=RUN)
    traces, annotations = TrackioExporter(config), TrackioExporter(config)
    traces.export(records[:1])
    annotations.export(records[1:])
    annotations.shutdown()  # the annotator stops first (tracer.shutdown's order)
    assert [c[0] for c in public_trackio.calls] == ["init", "log", "log"]
    traces.shutdown()
    assert [c[0] for c in public_trackio.calls] == ["init", "log", "log", "finish"]
