"""Delivery under real faults: every case injects one, reads what arrived back with MLflow's own
client, and checks that the counters reconcile (submitted == exported + pending + dropped).

Faults are injected where they happen: the global ``random`` seeded alike in two processes, a
spool on a full tmpfs (or, where no tmpfs can be mounted, ENOSPC from the spool's write call),
a spool file deleted under the tracer, a real ``mlflow server`` that goes away and comes back
(its port closed and opened again: tests/_forward.py), an exporter that raises or hangs. The
exporter faults wrap the real MLflow exporter (``FlakyMlflow``): the data still goes to a real
store.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer
import tracer.spool as spool_mod
from tests._disks import full_disk
from tests._forward import Outage
from tests._servers import MlflowServer
from tests._wait import wait_for
from tests.conftest import search_traces
from tracer.backends import register_backend
from tracer.backends.base import ExportResult
from tracer.ids import new_trace_id

pytest.importorskip("mlflow")
from tracer.backends.mlflow_backend import MlflowExporter

EXP = "faults"


# -- helpers -------------------------------------------------------------------------------
class Faults:
    """What FlakyMlflow does next; one instance per test (reset by the fixture)."""

    def __init__(self) -> None:
        self.down = False
        self.raise_after_store = 0  # store the batch, then raise this many times
        self.hang = threading.Event()  # set: export blocks until `release` is set
        self.release = threading.Event()
        self.in_export = 0
        self.overlaps = 0  # shutdown/force_flush called while an export call ran
        self.lock = threading.Lock()


FAULTS = Faults()


class FlakyMlflow(MlflowExporter):
    """The real MLflow exporter with injected faults around its export call."""

    name = "flaky"

    def export(self, batch: Any, *, replay: bool = False) -> ExportResult:
        with FAULTS.lock:
            FAULTS.in_export += 1
        try:
            if FAULTS.hang.is_set():
                FAULTS.release.wait(120)
            if FAULTS.down:
                raise ConnectionError("injected: backend unreachable")
            result = super().export(batch, replay=replay)
            if FAULTS.raise_after_store > 0:
                FAULTS.raise_after_store -= 1
                raise KeyError("injected: unexpected exception after the data was stored")
            return result
        finally:
            with FAULTS.lock:
                FAULTS.in_export -= 1

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        self._check_overlap()
        return bool(super().force_flush(timeout_s))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._check_overlap()
        super().shutdown(timeout_s)

    def _check_overlap(self) -> None:
        with FAULTS.lock:
            if FAULTS.in_export:
                FAULTS.overlaps += 1


register_backend("flaky", FlakyMlflow)


@pytest.fixture(autouse=True)
def _faults() -> Iterator[None]:
    global FAULTS
    FAULTS = Faults()
    yield
    FAULTS.release.set()


@tracer.trace_op(kind="generate")
def generate(prompt: str) -> str:
    return prompt.upper()


@tracer.trace_op(kind="reward")
def reward(i: int) -> float:
    return float(i % 2)


def trace(n: int, step: int = 0, start: int = 0, payload: str = "") -> None:
    for i in range(start, start + n):
        with tracer.trace_attr(step=step, sample_index=i):
            generate(f"question {i} {payload}")
            reward(i)


def reconciles(backend: str) -> dict[str, Any]:
    """submitted == exported + pending + dropped for this backend; returns the metrics."""
    m = tracer.metrics()
    p = f"tracer/{backend}/"
    assert m["tracer/submitted"] == m[p + "exported"] + m[p + "pending"] + m[p + "dropped"], m
    return m


def stored_keys(uri: str) -> list[tuple[str, str]]:
    traces = search_traces(uri, EXP)
    return [(t.info.tags["step"], t.info.tags["sample_index"]) for t in traces]


def base_config(tmp_path: Path, uri: str, **kw: Any) -> dict[str, Any]:
    return {
        "backend": "flaky",
        "tracking_uri": uri,
        "project_name": EXP,
        "spool_dir": str(tmp_path / "spool"),
        "flush_interval_s": 0.05,
        "export_batch_size": 10,
        "export_max_retries": 1,
        "replay_interval_s": 0.3,
        **kw,
    }


# -- ids -------------------------------------------------------------------------------------
def test_ids_do_not_follow_random_seed() -> None:
    random.seed(0)
    a = new_trace_id()
    random.seed(0)
    assert new_trace_id() != a


def test_trace_ids_begin_with_the_time_and_end_random() -> None:
    """Ids made one after another sort in the order they were made (a store's id indexes
    then grow at one end) and differ in their 80 random bits, whatever random.seed says."""
    import time

    before = time.time_ns() // 1_000_000
    ids = []
    for _ in range(2000):
        random.seed(0)
        ids.append(new_trace_id())
    after = time.time_ns() // 1_000_000
    assert all(before <= i >> 80 <= after for i in ids)
    assert [i >> 80 for i in ids] == sorted(i >> 80 for i in ids)
    assert len({i & ((1 << 80) - 1) for i in ids}) == len(ids)
    assert all(len(f"{i:032x}") == 32 for i in ids)


_SEEDED_RUN = """
import random, sys
import numpy as np
random.seed(0); np.random.seed(0)
import tracer
tracer.init(backend="mlflow", tracking_uri=sys.argv[1], project_name="faults")
@tracer.trace_op(kind="tool")
def tool(x):
    return x
for i in range(40):
    random.seed(0)  # RL scripts seed everywhere, even per sample
    with tracer.trace_attr(step=0, sample_index=i, run=sys.argv[2]):
        tool(i)
sys.exit(0 if tracer.flush(120) else 3)
"""


def test_two_processes_seeded_alike_keep_every_trajectory(tmp_path: Path, mlflow_uri: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd() + os.pathsep + str(Path(__file__).parents[1])}
    procs = [
        subprocess.Popen([sys.executable, "-c", _SEEDED_RUN, mlflow_uri, run], cwd=tmp_path,
                         env=env)
        for run in ("a", "b")
    ]  # fmt: skip
    assert [p.wait(300) for p in procs] == [0, 0]
    traces = search_traces(mlflow_uri, EXP)
    assert len(traces) == 80
    assert len({t.info.trace_id for t in traces}) == 80


# -- the spool's disk ------------------------------------------------------------------------
def test_full_spool_disk_exports_from_memory_and_recovers(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with full_disk(tmp_path / "spool", monkeypatch, spool_mod, "_write_new") as free_space:
        tracer.init(base_config(tmp_path, mlflow_uri))
        trace(20, step=0)  # the spool cannot take a byte: export goes on from memory
        assert tracer.flush(60)
        m = reconciles("flaky")
        assert m["tracer/flaky/spool_errors"] >= 1 and m["tracer/flaky/dropped"] == 0
        FAULTS.down = True  # disk full *and* the backend down: memory holds the batches
        trace(20, step=1)
        wait_for(lambda: tracer.metrics()["tracer/flaky/down"], "the export to fail (down)")
        m = reconciles("flaky")
        assert m["tracer/flaky/pending"] == 20 and m["tracer/flaky/dropped"] == 0
        FAULTS.down = False
        free_space()  # space is back: the spool works again
        trace(20, step=2)
        assert tracer.flush(60)
        m = reconciles("flaky")
        assert m["tracer/flaky/exported"] == 60 and m["tracer/flaky/worker_alive"] == 1
        assert m["tracer/processor_alive"] == 1
    keys = stored_keys(mlflow_uri)
    assert len(keys) == 60 and len(set(keys)) == 60


def test_deleted_spool_file_is_counted_and_the_rest_exported(tmp_path: Path, mlflow_uri: str):
    # a small memory bound: the batches live only in their spool files
    tracer.init(base_config(tmp_path, mlflow_uri, max_buffer_trajectories=10))
    FAULTS.down = True
    trace(50)
    wait_for(lambda: tracer.metrics()["tracer/flaky/down"], "the export to fail (down)")
    wait_for(lambda: _spooled_lines(tmp_path) == 50, "the 50 trajectories in the spool")
    files = sorted((tmp_path / "spool").glob("flaky-*/*.jsonl"))
    victim = files[len(files) // 2]
    lost = len(victim.read_text().splitlines())
    victim.unlink()  # someone cleans the folder while the backend is down
    FAULTS.down = False
    assert tracer.flush(60) is False  # not everything arrived, and flush says so
    m = reconciles("flaky")
    assert m["tracer/flaky/worker_alive"] == 1
    assert m["tracer/flaky/dropped/spool_lost"] == lost
    assert m["tracer/flaky/exported"] == 50 - lost
    assert len(set(stored_keys(mlflow_uri))) == 50 - lost


def test_exporter_raising_unexpected_exceptions_stores_each_trajectory_once(
    tmp_path: Path, mlflow_uri: str
) -> None:
    tracer.init(base_config(tmp_path, mlflow_uri))
    FAULTS.raise_after_store = 3  # stored, then KeyError: retried, must not duplicate
    trace(40)
    assert tracer.flush(60)
    m = reconciles("flaky")
    assert m["tracer/flaky/exported"] == 40 and m["tracer/flaky/retries"] >= 1
    traces = search_traces(mlflow_uri, EXP)
    assert len(traces) == 40
    rewards = [a for t in traces for a in t.info.assessments if a.name == "reward"]
    assert len(rewards) == 40


def test_hung_exporter_flush_honours_timeout_and_shutdown_never_overlaps(
    tmp_path: Path, mlflow_uri: str
) -> None:
    tracer.init(base_config(tmp_path, mlflow_uri))
    FAULTS.hang.set()
    trace(10)
    t0 = time.monotonic()
    assert tracer.flush(1.0) is False
    assert time.monotonic() - t0 < 3.0
    m = reconciles("flaky")
    assert m["tracer/flaky/export_inflight_s"] > 0
    t0 = time.monotonic()
    assert tracer.shutdown(1.0) is False
    assert time.monotonic() - t0 < 5.0
    assert FAULTS.overlaps == 0  # never shut down while an export call ran
    FAULTS.release.set()
    # the batch stays in the spool for the next tracer or `rollout-tracer replay`
    assert sum(1 for _ in (tmp_path / "spool").glob("flaky-*/*.jsonl")) == 1


def _spooled_lines(tmp_path: Path) -> int:
    n = 0
    for p in (tmp_path / "spool").glob("flaky-*/*.jsonl"):
        try:  # the next tracer may claim (rename) a file between the listing and the read
            n += len(p.read_text().splitlines())
        except FileNotFoundError:
            return -1  # a count from a moving listing: the caller's wait asks again
    return n


def test_init_twice_while_backend_down_overwrites_nothing(tmp_path: Path, mlflow_uri: str):
    tracer.init(base_config(tmp_path, mlflow_uri, shutdown_timeout_s=0.5))
    FAULTS.down = True
    trace(20, step=0)
    wait_for(lambda: tracer.metrics()["tracer/flaky/down"], "the export to fail (down)")
    wait_for(lambda: _spooled_lines(tmp_path) == 20, "the first tracer's 20 in the spool")
    tracer.init(base_config(tmp_path, mlflow_uri))  # the old one leaves its batches behind
    trace(20, step=1)
    # none overwritten: the second tracer's 20 are added to the first's
    wait_for(lambda: _spooled_lines(tmp_path) == 40, "both tracers' 40 in the spool", 30)
    FAULTS.down = False
    assert tracer.flush(60)
    m = reconciles("flaky")
    assert m["tracer/flaky/orphans_replayed"] == 20  # the first tracer's, adopted
    keys = stored_keys(mlflow_uri)
    assert len(keys) == 40 and len(set(keys)) == 40


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_sampler_lock_is_held_child_traces(tmp_path: Path, mlflow_uri: str):
    tracer.init(base_config(tmp_path, mlflow_uri, max_samples_per_step_per_worker=4))
    trace(1, step=0)
    assert tracer.flush(60)
    lock = tracer.get_tracer().sampler._lock
    lock.acquire()  # as if another thread were inside the sampler at the fork
    try:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                trace(1, step=1, start=7)
                code = 0 if tracer.flush(60) else 2
            finally:
                os._exit(code)
    finally:
        lock.release()
    trace(1, step=1, start=8)  # the parent goes on too, with ids of its own
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            pytest.fail("the forked child hung (sampler lock inherited locked?)")
        time.sleep(0.1)
    assert os.waitstatus_to_exitcode(status) == 0
    assert tracer.flush(60)
    traces = search_traces(mlflow_uri, EXP)
    assert sorted(stored_keys(mlflow_uri)) == [("0", "0"), ("1", "7"), ("1", "8")]
    assert len({t.info.trace_id for t in traces}) == 3


@pytest.mark.parametrize("raise_internal_errors", [False, True])
def test_unexpected_error_in_each_background_loop_is_counted_and_the_loop_goes_on(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch, raise_internal_errors: bool
) -> None:
    from tracer.export_worker import ExportWorker
    from tracer.pipeline import Pipeline

    def once(cls: type, method: str) -> None:
        """``cls.method`` raises once, on the first call on an object made from now on: the
        patch is class-wide, and a worker or processor an earlier test left in this process,
        even one of the same backend name, must not take the one injected bug (CI: an OTLP
        worker inside its retries, 2026-12-03; an earlier "flaky" worker, 2026-12-04)."""
        real_init, real = cls.__init__, getattr(cls, method)  # type: ignore[misc]
        ours: list[Any] = []
        calls: list[int] = []

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            ours.append(self)
            real_init(self, *args, **kwargs)

        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if any(self is o for o in ours):
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("injected bug")
            return real(self, *args, **kwargs)

        monkeypatch.setattr(cls, "__init__", init)
        monkeypatch.setattr(cls, method, wrapper)

    once(Pipeline, "_process")
    once(ExportWorker, "_step")
    tracer.init(base_config(tmp_path, mlflow_uri, raise_internal_errors=raise_internal_errors))
    trace(5, step=0)  # the first batch meets the processor's bug: lost, and counted
    wait_for(lambda: tracer.metrics().get("tracer/dropped/internal_error") == 5,
             "the first batch to be dropped by the injected bug")  # fmt: skip
    trace(5, step=1)
    if raise_internal_errors:  # the project's own tests see the bug...
        with pytest.raises(RuntimeError, match="injected bug"):
            tracer.flush(60)
    # the lost batch makes the first flush False; after a raise it was reported already
    assert tracer.flush(60) is raise_internal_errors
    m = reconciles("flaky")  # ... and in production the loops go on
    assert m["tracer/processor_alive"] == 1 and m["tracer/flaky/worker_alive"] == 1
    assert m["tracer/flaky/loop_errors"] == 1 and m["tracer/internal_errors"] >= 2
    assert m["tracer/dropped/internal_error"] == 5 and m["tracer/flaky/exported"] == 5
    assert sorted({k[0] for k in stored_keys(mlflow_uri)}) == ["1"]


# -- a stalled backend, big payloads, a tiny spool --------------------------------------------
class _Stalled:
    name = "stalled20k"
    release = threading.Event()

    def __init__(self, config: Any = None) -> None:
        pass

    def export(self, batch: Any) -> ExportResult:
        _Stalled.release.wait(300)
        return ExportResult.SUCCESS

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        return None


register_backend("stalled20k", _Stalled)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_stalled_backend_20000_trajectories_none_dropped(tmp_path: Path) -> None:
    _Stalled.release.clear()
    tracer.init(backend="stalled20k", spool_dir=str(tmp_path / "spool"),
                max_buffer_trajectories=500, flush_interval_s=0.1)  # fmt: skip
    trace(20_000)

    def on_disk() -> int:
        files = (tmp_path / "spool").glob("stalled20k-*/*.jsonl")
        return sum(len(p.read_bytes().splitlines()) for p in files)

    wait_for(lambda: on_disk() == 20_000, "all 20,000 in the spool", 120)
    m = reconciles("stalled20k")
    assert m["tracer/stalled20k/dropped"] == 0 and m["tracer/dropped_buffer_full"] == 0
    assert m["tracer/overflowed_to_spool"] > 0  # the hot buffer was full: spool, not drop
    _Stalled.release.set()
    assert tracer.flush(120)
    assert reconciles("stalled20k")["tracer/stalled20k/exported"] == 20_000


def test_tiny_spool_drops_are_counted_by_reason_and_memory_stays_bounded(tmp_path: Path):
    _Stalled.release.clear()
    tracer.init(backend="stalled20k", spool_dir=str(tmp_path / "spool"),
                max_spool_bytes=4 * 1024**2, max_buffer_bytes=16 * 1024**2,
                max_buffer_trajectories=1000, flush_interval_s=0.05)  # fmt: skip
    before = _rss()
    peak = before
    big = "y" * 1_000_000  # 1 MB per trajectory; 300 MB if nothing were bounded
    for i in range(300):
        with tracer.trace_attr(step=0, sample_index=i):
            generate(big + str(i))
        if i % 20 == 0:
            peak = max(peak, _rss())
            time.sleep(0.01)
    def settled() -> bool:  # the counters reconcile only once nothing moves (the export is
        m = tracer.metrics()  # stalled): a batch being handed over is read on both sides
        p = "tracer/stalled20k/"
        return m["tracer/queue_depth"] == 0 and (
            m["tracer/submitted"] == m[p + "exported"] + m[p + "pending"] + m[p + "dropped"])

    wait_for(settled, "all 300 handed to the stalled backend (kept, spooled or dropped)")
    peak = max(peak, _rss())
    m = reconciles("stalled20k")
    dropped = {k.rsplit("/", 1)[1]: v for k, v in m.items()
               if k.startswith("tracer/stalled20k/dropped/")}  # fmt: skip
    assert m["tracer/stalled20k/dropped"] > 0 and set(dropped) <= {"spool_full", "buffer_full"}
    assert sum(dropped.values()) == m["tracer/stalled20k/dropped"]
    growth = peak - before
    assert growth < 150 * 1024**2, f"RSS grew {growth / 2**20:.0f} MiB for 300 MB of payload"
    _Stalled.release.set()
    assert tracer.flush(60) is False  # something was lost, and flush says so
    reconciles("stalled20k")


# -- a real tracking server that goes away ---------------------------------------------------
@pytest.fixture
def no_mlflow_http_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLflow's client retries each request for minutes by default; the tracer does its own
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


# ~15 s by nature: the flush waits for the server, which is back 4 s after it went away
@pytest.mark.slow(seconds=15)
@pytest.mark.usefixtures("no_mlflow_http_retries")
def test_server_back_after_last_step_within_flush_timeout(
    tmp_path: Path, mlflow_server: MlflowServer
) -> None:
    server = Outage(mlflow_server.url)
    project = f"{EXP}-{uuid.uuid4().hex[:8]}"  # the server is shared: a project of its own
    try:
        # a down backend is probed every 200 s on its own, longer than the flush waits: the
        # flush succeeds only through its own frequent probes (checked by removing them)
        tracer.init(base_config(tmp_path, server.url, backend="mlflow", replay_interval_s=200,
                                project_name=project))  # fmt: skip
        trace(50, step=0)
        assert tracer.flush(60)
        server.down()
        trace(100, step=1)  # the last step, traced while the server is down
        t = threading.Thread(target=lambda: (time.sleep(4), server.up()))
        t.start()
        t0 = time.monotonic()
        assert tracer.flush(120), tracer.metrics()  # waits for the server, not 14 ms
        assert time.monotonic() - t0 > 3
        t.join()
        reconciles("mlflow")
        keys = [(t.info.tags["step"], t.info.tags["sample_index"])
                for t in search_traces(server.url, project)]  # fmt: skip
        assert len(keys) == 150 and len(set(keys)) == 150
    finally:
        tracer.reset()
        server.down()


# ~20 s by nature: two runs of the replay command (each imports MLflow)
@pytest.mark.slow(seconds=20)
@pytest.mark.usefixtures("no_mlflow_http_retries")
def test_server_down_at_shutdown_prints_replay_command_that_stores_everything_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mlflow_server: MlflowServer
) -> None:
    server = Outage(mlflow_server.url)
    project = f"{EXP}-{uuid.uuid4().hex[:8]}"  # the server is shared: a project of its own
    try:
        tracer.init(base_config(tmp_path, server.url, backend="mlflow", project_name=project))
        trace(30, step=0)
        assert tracer.flush(60)
        server.down()
        trace(30, step=1)
        assert tracer.shutdown(2.0) is False
        [line] = [r.getMessage() for r in caplog.records if "rollout-tracer replay" in
                  r.getMessage()]  # fmt: skip
        assert "30 trajectories for mlflow" in line
        command = line.split("Export them with: ", 1)[1].split()
        assert command[:2] == ["rollout-tracer", "replay"]
        server.up()
        exe = Path(sys.executable).with_name("rollout-tracer")
        for _ in range(2):  # the second run finds nothing left: nothing stored twice
            out = subprocess.run([str(exe), *command[1:]], capture_output=True, text=True,
                                 timeout=300, cwd=tmp_path)  # fmt: skip
            assert out.returncode == 0, out.stdout + out.stderr
        traces = search_traces(server.url, project)
        keys = [(t.info.tags["step"], t.info.tags["sample_index"]) for t in traces]
        assert len(keys) == 60 and len(set(keys)) == 60
        rewards = [a for t in traces for a in t.info.assessments if a.name == "reward"]
        assert len(rewards) == 60  # one reward each, none added twice by the second replay
    finally:
        tracer.reset()
        server.down()


class _SlowlyDown(FlakyMlflow):
    """Down, and each failing call takes 3 s (a connect timeout, OTel's backoff inside one
    call): longer than the shutdown's whole flush below."""

    name = "slowdown"

    def export(self, batch: Any, *, replay: bool = False) -> ExportResult:
        time.sleep(3.0)
        return ExportResult.FAILURE


register_backend("slowdown", _SlowlyDown)


@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_shutdown_with_the_backend_down_leaves_no_export_call_running(
    tmp_path: Path, mlflow_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A shutdown's flush probes a down backend until its deadline. A probe begun inside it
    outlived shutdown(), which had said the batches wait in the spool: the worker went on and
    exported them behind the user's back (a replay then found nothing: test_credentials under
    load; CI: another test's class-wide patch met the thread). The flush now starts no probe
    it cannot finish (the last failed call's length): the worker is idle and stops at once."""
    spool = tmp_path / "spool"
    tracer.init(backend="slowdown", tracking_uri=mlflow_uri, project_name=EXP,
                spool_dir=str(spool), export_max_retries=0, shutdown_timeout_s=2,
                flush_interval_s=0.05)  # fmt: skip
    trace(3, step=0)
    wait_for(lambda: tracer.metrics().get("tracer/slowdown/down") == 1, "the backend to be down")
    tracer.reset()  # shutdown: a 2 s flush; each probe would take 3 s
    left = [t.name for t in threading.enumerate() if t.name == "rollout-tracer-slowdown"]
    assert not left, "an export worker still runs after shutdown"
    assert "stuck in an export call" not in caplog.text
    assert len(list(spool.rglob("*.jsonl"))) >= 1  # the batches wait in the spool


PROBES: list[float] = []  # when each call of the "slowdown_seen" backend began (monotonic)


class _SlowlyDownSeen(_SlowlyDown):
    name = "slowdown_seen"

    def export(self, batch: Any, *, replay: bool = False) -> ExportResult:
        PROBES.append(time.monotonic())
        return super().export(batch, replay=replay)


class _SlowToShutDown(MlflowExporter):
    """The real MLflow exporter whose shutdown takes 1.5 s (an OTel exporter flushing its own
    queue does): the next backend's worker is stopped that much later."""

    name = "slowshut"

    def shutdown(self, timeout_s: float = 30.0) -> None:
        time.sleep(1.5)
        super().shutdown(timeout_s)


register_backend("slowdown_seen", _SlowlyDownSeen)
register_backend("slowshut", _SlowToShutDown)


CALLS: list[float] = []  # when each call of the "slowok" backend began (monotonic)


class _SlowButUp(MlflowExporter):
    """The real MLflow exporter, each call 1 s slower (a loaded server): batches queue."""

    name = "slowok"

    def export(self, batch: Any, *, replay: bool = False) -> ExportResult:
        CALLS.append(time.monotonic())
        time.sleep(1.0)
        return super().export(batch, replay=replay)


register_backend("slowok", _SlowButUp)


@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_no_probe_starts_between_the_shutdown_flush_and_the_worker_stop(
    tmp_path: Path, mlflow_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    """CI, 2026-12-04: the flush started no probe it could not finish, but it ended at its
    deadline and the workers were stopped after it; a probe due in that gap began, outlived
    shutdown() and exported behind the spool's back. Here another backend's 1.5 s shutdown
    widens the gap (replays due every 1.5 s, checked every 0.5 s): shutdown's deadline binds
    until the worker stops."""
    PROBES.clear()
    spool = tmp_path / "spool"
    tracer.init(backend="slowshut,slowdown_seen", tracking_uri=mlflow_uri, project_name=EXP,
                spool_dir=str(spool), export_max_retries=0, shutdown_timeout_s=2,
                flush_interval_s=0.05, replay_interval_s=1.5)  # fmt: skip
    trace(3, step=0)
    wait_for(lambda: tracer.metrics().get("tracer/slowdown_seen/down") == 1,
             "the backend to be down")  # fmt: skip
    began = time.monotonic()
    tracer.reset()
    late = [round(t - began, 2) for t in PROBES if t >= began]
    assert not late, f"probes began {late} s into shutdown (each takes 3 s, the budget is 2 s)"
    left = [t.name for t in threading.enumerate() if t.name == "rollout-tracer-slowdown_seen"]
    assert not left, "an export worker still runs after shutdown"
    assert "stuck in an export call" not in caplog.text
    assert len(list(spool.rglob("*.jsonl"))) >= 1


@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_no_export_call_starts_after_the_shutdown_deadline(
    tmp_path: Path, mlflow_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A backend that is up but slow has batches queued when shutdown's 2 s pass; shutdown
    then says they wait in the spool. A call begun after that (here while another backend
    shuts down for 1.5 s) stored them behind its back, or was left running. None begins."""
    CALLS.clear()
    spool = tmp_path / "spool"
    tracer.init(backend="slowshut,slowok", tracking_uri=mlflow_uri, project_name=EXP,
                spool_dir=str(spool), export_batch_size=1, shutdown_timeout_s=2,
                flush_interval_s=0.05)  # fmt: skip
    trace(8, step=0)
    wait_for(lambda: CALLS, "the first export call")
    slow = tracer.get_tracer().pipeline.workers[1]
    began = time.monotonic()
    tracer.reset()
    # 0.1 s: a call whose last check came just before the deadline records its start after it
    late = [round(t - began, 2) for t in CALLS if t > slow.window.close_at + 0.1]
    assert not late, f"export calls began {late} s into a shutdown of 2 s"
    assert "stuck in an export call" not in caplog.text
    assert "were not exported before shutdown; they are kept in" in caplog.text
    spooled = sum(len(f.read_text().splitlines()) for f in spool.rglob("*.jsonl"))
    assert spooled >= 8 - len(CALLS)  # nothing lost: the rest waits in the spool


def test_trajectories_still_being_processed_at_shutdown_are_said_then_spooled(
    tmp_path: Path, mlflow_uri: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A user's redact callback (or a hung disk under the spool) holds the processing thread
    past shutdown's deadline. The trajectories it holds were in neither the buffer nor a
    backend: shutdown said nothing of them, and when the thread let go they went to a worker
    that had stopped (lost at exit, counted nowhere). Now shutdown says how many, and when
    the thread lets go they go to the spool with a line that says how to replay them."""
    entered, release = threading.Event(), threading.Event()

    def slow_redact(text: str) -> str:
        entered.set()
        release.wait(60)
        return text

    # one batch of 5: the thread wakes when the fifth arrives, not before (flush_interval_s)
    tracer.init(base_config(tmp_path, mlflow_uri, shutdown_timeout_s=1, export_batch_size=5,
                            flush_interval_s=30, redact_callback=slow_redact))  # fmt: skip
    pipeline = tracer.get_tracer().pipeline
    trace(5, step=0)
    wait_for(entered.is_set, "the processing thread to enter the redact callback")
    tracer.reset()
    said = [r.getMessage() for r in caplog.records if "still being processed" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("rollout-tracer: 5 trajectories"), said
    release.set()
    assert pipeline.processor is not None
    pipeline.processor.join(30)
    assert not pipeline.processor.is_alive()
    m = pipeline.metrics()
    assert m["tracer/flaky/pending"] == 5 and m["tracer/flaky/dropped"] == 0, m
    [line] = [r.getMessage() for r in caplog.records if "after shutdown" in r.getMessage()]
    assert line.startswith("rollout-tracer: 5 trajectories for flaky were processed"), line
    command = line.split("Export them with: ", 1)[1].split()
    assert stored_keys(mlflow_uri) == []
    assert command[2:] == ["--spool-dir", str(tmp_path / "spool")], command
    tracer.init(base_config(tmp_path, mlflow_uri))  # a later run finds them (or the command)
    try:
        trace(1, step=1)
        assert tracer.flush(60)
        wait_for(lambda: len(stored_keys(mlflow_uri)) == 6, "the 5 to be replayed, and 1 new")
    finally:
        tracer.reset()
