"""A trackio export counts only once trackio has stored it: against a real trackio server made
slow (SIGSTOP), and a local store whose writes trackio drops; read back with trackio's own
storage API."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
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


def _trajectory(i: int) -> None:
    @tracer.trace_op(kind="tool")
    def tool(x: int) -> int:
        return x

    with tracer.trace_attr(step=i, sample_index=i):
        tool(i)


def _spooled(spool: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in spool.glob("trackio-*/*.jsonl"))


@pytest.mark.parametrize("outage", ["stopped", "restarted"])
def test_a_slow_trackio_server_keeps_batches_pending_until_it_has_them(
    outage: str, trackio_dir: Path, trackio_server: TrackioServer, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """``stopped``: the server stops answering (SIGSTOP), requests hang in trackio's sender.
    ``restarted``: the server dies (requests fail, trackio keeps them in its local buffer) and
    comes back on the same port; trackio sends its buffer then."""
    server = trackio_server
    monkeypatch.setenv("TRACKIO_SERVER_URL", server.url)
    spool = tmp_path / "spool"
    tracer.init(backend="trackio", project_name=PROJECT, experiment_name=RUN,
                spool_dir=str(spool), export_timeout_s=1, export_max_retries=0,
                flush_interval_s=0.05, replay_interval_s=0.2)  # fmt: skip
    _trajectory(0)
    assert tracer.flush(60)  # the server answers: stored
    assert len(_stored_traces(server.folder, monkeypatch)) == 1
    server.signal(signal.SIGSTOP if outage == "stopped" else signal.SIGKILL)
    try:
        for i in range(1, 4):
            _trajectory(i)
        assert tracer.flush(3) is False  # in trackio's send queue or buffer is not stored
        assert _spooled(spool) == 3  # pending: the batch file is kept
        assert tracer.metrics()["tracer/trackio/exported"] == 1
    finally:
        if outage == "stopped":
            server.signal(signal.SIGCONT)
        else:
            server.start()
    assert tracer.flush(90)
    assert _spooled(spool) == 0
    assert tracer.metrics()["tracer/trackio/exported"] == 4
    stored = _stored_traces(server.folder, monkeypatch)
    assert sorted(t["metadata"]["step"] for t in stored) == [0, 1, 2, 3]  # each once


@pytest.mark.slow
def test_rows_trackio_drops_locally_are_logged_again(
    trackio_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds trackio's project lock past trackio's 10 s wait: trackio drops
    the write with a warning. The batch stays pending and is stored once the lock is free."""
    spool = tmp_path / "spool"
    tracer.init(backend="trackio", project_name=PROJECT, experiment_name=RUN,
                spool_dir=str(spool), export_timeout_s=1, export_max_retries=0,
                flush_interval_s=0.05, replay_interval_s=0.2)  # fmt: skip
    _trajectory(0)
    assert tracer.flush(30)
    lock_path = trackio_dir / f"{PROJECT}.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time\n"
         "f = open(sys.argv[1], 'w'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True)\n"
         "time.sleep(11)", str(lock_path)],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        _trajectory(1)
        assert tracer.flush(3) is False
        assert _spooled(spool) == 1
    finally:
        holder.wait(30)  # the lock is free again
    assert tracer.flush(60)
    assert _spooled(spool) == 0
    stored = _stored_traces(trackio_dir, monkeypatch)
    assert sorted(t["metadata"]["step"] for t in stored) == [0, 1]
