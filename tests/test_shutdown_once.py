"""Exactly once across shutdown and the next start (issue 47). After shutdown's deadline no export
call begins, not even a retry; a batch is either stored (its spool file gone) or in the spool (not
stored); a call still running at the deadline keeps its batch "in doubt", and its end settles it.

The backends are the real MLflow exporter (sqlite store) and the real OTLP exporter posting to a
real ``mlflow server``, wrapped to fail slowly or to hang: a wrapper that returns FAILURE after
0.3 s stands in for a collector answering 400 after 0.3 s. Every call is recorded with the
trace ids it carried, so "sent once" is counted where the data leaves the process, and what
was stored is read back through the backend's own client.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests._servers import MlflowServer
from tests._wait import wait_for
from tests.conftest import search_traces
from tracer.backends import register_backend
from tracer.backends.base import ExportResult
from tracer.batch_queue import BatchQueue
from tracer.spool import BackendSpool, SpoolError, batch_size, is_in_doubt

pytest.importorskip("mlflow")
from tracer.backends.mlflow_backend import MlflowExporter

EXP = "shutdown-once"


class Script:
    """What the wrapped exporters do next, and every call they saw (one per test)."""

    def __init__(self) -> None:
        self.fail_first = 0  # this many calls fail, each after `fail_s`
        self.fail_s = 0.3
        self.hang = threading.Event()  # set: the next call blocks until `release`
        self.release = threading.Event()
        self.entered = threading.Event()
        self.calls: list[tuple[float, list[str], bool]] = []  # (began, trace ids, stored)
        self.lock = threading.Lock()

    def call(self, batch: Any, real: Any) -> ExportResult:
        began = time.monotonic()
        ids = [r.trace_id for r in batch]
        with self.lock:
            failing = len(self.calls) < self.fail_first
            self.calls.append((began, ids, False))
            index = len(self.calls) - 1
        if failing:
            time.sleep(self.fail_s)
            return ExportResult.FAILURE
        if self.hang.is_set():
            self.hang.clear()
            self.entered.set()
            self.release.wait(60)
        result: ExportResult = real()
        with self.lock:
            self.calls[index] = (began, ids, result is ExportResult.SUCCESS)
        return result

    def sent(self) -> dict[str, int]:
        """How many calls stored each trace id."""
        out: dict[str, int] = {}
        for _began, ids, stored in self.calls:
            for i in ids:
                out[i] = out.get(i, 0) + stored
        return out


SCRIPT = Script()


class ScriptedMlflow(MlflowExporter):
    name = "scripted_mlflow"

    def export(self, batch: Any, *, replay: bool = False) -> ExportResult:
        return SCRIPT.call(batch, lambda: super(ScriptedMlflow, self).export(batch, replay=replay))


register_backend("scripted_mlflow", ScriptedMlflow)


def _scripted_otlp(config: Any) -> Any:
    from tracer.backends.otlp_backend import OtlpExporter

    class ScriptedOtlp(OtlpExporter):
        name = "scripted_otlp"

        def export(self, batch: Any, *, replay: bool = False) -> ExportResult:
            return SCRIPT.call(
                batch, lambda: super(ScriptedOtlp, self).export(batch, replay=replay)
            )

    return ScriptedOtlp(config)


register_backend("scripted_otlp", _scripted_otlp)


@pytest.fixture(autouse=True)
def _script() -> Iterator[None]:
    global SCRIPT
    SCRIPT = Script()
    yield
    SCRIPT.release.set()
    tracer.reset()


@tracer.trace_op(kind="generate")
def generate(prompt: str) -> str:
    return prompt.upper()


def trace(n: int, step: int = 0) -> None:
    for i in range(n):
        with tracer.trace_attr(step=step, sample_index=i):
            generate(f"question {i}")


def spooled(spool: Path) -> list[Path]:
    return sorted(spool.glob("*/*.jsonl"))


def config(tmp_path: Path, store: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {
        **store,
        "project_name": EXP,
        "spool_dir": str(tmp_path / "spool"),
        "flush_interval_s": 30,  # one batch of 5: the thread wakes when the fifth arrives
        "export_batch_size": 5,
        "replay_interval_s": 0.3,
        **kw,
    }


@pytest.fixture(params=["mlflow", "otlp"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """A backend and how to read it back: a sqlite MLflow store, or a real ``mlflow server``
    receiving OTLP/HTTP (a new experiment per test)."""
    if request.param == "mlflow":
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        return {"backend": "scripted_mlflow", "tracking_uri": uri, "_read": (uri, EXP)}
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    server: MlflowServer = request.getfixturevalue("mlflow_server")
    exp = f"{EXP}-{tmp_path.name}"
    exp_id = server.experiment_id(exp)
    return {
        "backend": "scripted_otlp",
        "otlp_endpoint": f"{server.url}/v1/traces",
        "otlp_headers": {"x-mlflow-experiment-id": exp_id},
        "_read": (server.url, exp),
    }


def stored(store: dict[str, Any]) -> list[str]:
    uri, exp = store["_read"]
    return [t.info.trace_id for t in search_traces(uri, exp)]


@pytest.mark.slow(seconds=8)
@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_a_slowly_failing_backend_gets_no_call_after_the_deadline_and_each_trajectory_once(
    tmp_path: Path, store: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 47: the first 3 calls fail after 0.3 s, 5 retries, a 1 s shutdown. The retry loop
    ignored the deadline: call 4 began after shutdown had said the batch waits in the spool,
    and a second init on the same spool stored the batch again."""
    SCRIPT.fail_first = 3
    read = store.pop("_read")
    tracer.init(config(tmp_path, store, export_max_retries=5, shutdown_timeout_s=1))
    trace(5)
    wait_for(lambda: SCRIPT.calls, "the first export call")
    pipeline = tracer.get_tracer().pipeline
    worker = pipeline.workers[0]
    tracer.reset()
    close_at = worker.window.close_at
    late = [round(t - close_at, 2) for t, _, _ in SCRIPT.calls if t > close_at]
    assert not late, f"export calls began {late} s after shutdown's deadline"
    [batch] = spooled(tmp_path / "spool")  # in the spool once, and not stored
    assert batch_size(batch) == 5 and not any(SCRIPT.sent().values())
    assert "stuck in an export call" not in caplog.text
    assert " is down (" not in caplog.text  # shutdown ended the retries, not the backend
    assert "stopped at shutdown" in caplog.text
    assert pipeline.metrics()[f"tracer/{worker.name}/in_doubt"] == 0
    # at once, a second init on the same spool: it replays the batch, each trajectory once
    tracer.init(config(tmp_path, store, flush_interval_s=0.05))
    trace(1, step=1)
    assert tracer.flush(60)
    if worker.thread is not None:  # the first tracer's worker is done: no late call
        worker.thread.join(10)
    store["_read"] = read
    wait_for(lambda: len(stored(store)) == 6, "6 traces stored")
    assert sorted(SCRIPT.sent().values()) == [1] * 6, SCRIPT.sent()
    assert len(set(stored(store))) == len(stored(store)) == 6


def shut_down_with_a_call_in_flight(tmp_path: Path, store: dict[str, Any]) -> tuple[Any, str, Any]:
    """Five trajectories in one export call that hangs past a 1 s shutdown: their batch is in
    doubt. Returns the old pipeline, its worker's name and how to read the store back."""
    SCRIPT.hang.set()
    read = store.pop("_read")
    tracer.init(config(tmp_path, store, shutdown_timeout_s=1))
    trace(5)
    assert SCRIPT.entered.wait(60)
    pipeline = tracer.get_tracer().pipeline
    name = pipeline.workers[0].name
    tracer.reset()
    return pipeline, name, read


def end_the_held_call(pipeline: Any, store: dict[str, Any], read: Any) -> None:
    """The old call ends now, and stores too; its thread is gone after."""
    SCRIPT.release.set()
    thread = pipeline.workers[0].thread
    assert thread is not None
    thread.join(30)
    assert not thread.is_alive()
    store["_read"] = read


@pytest.mark.slow(seconds=8)
def test_a_call_in_flight_at_the_deadline_leaves_its_batch_in_doubt(
    tmp_path: Path, store: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A call still running when shutdown's time is up may store its batch or not: the batch
    stays in the spool marked in doubt, the line says so (and, for a sink that does not
    deduplicate, that a replay may store it twice). Replayed by the next init while the old
    call still hangs, then that call stores too: an idempotent store holds each once."""
    pipeline, name, read = shut_down_with_a_call_in_flight(tmp_path, store)
    m = pipeline.metrics()
    assert m[f"tracer/{name}/in_doubt"] == 5 and m[f"tracer/{name}/pending"] == 5, m
    [line] = [r.getMessage() for r in caplog.records if "in doubt" in r.getMessage()]
    assert line.startswith(f"rollout-tracer: 5 trajectories for {name} were in an export call")
    assert ("may store them twice" in line) is (name == "scripted_otlp"), line
    [batch] = spooled(tmp_path / "spool")
    assert is_in_doubt(batch)  # the mark is part of its name (tracer/spool.py)
    tracer.init(config(tmp_path, store, flush_interval_s=0.05))
    trace(1, step=1)
    assert tracer.flush(60)
    replayed = tracer.metrics()
    assert replayed[f"tracer/{name}/orphans_replayed"] == 5
    assert replayed[f"tracer/{name}/in_doubt_replayed"] == (5 if name == "scripted_otlp" else 0)
    end_the_held_call(pipeline, store, read)
    wait_for(lambda: len(stored(store)) == 6, "6 traces stored")
    assert len(set(stored(store))) == 6
    m = pipeline.metrics()  # the old call's end settled its batch: stored, not lost
    assert m[f"tracer/{name}/exported"] == 5 and m[f"tracer/{name}/pending"] == 0, m
    assert m[f"tracer/{name}/loop_errors"] == 0, m


def test_abandon_leaves_a_memory_only_batch_to_the_call_that_holds_it(
    tmp_path: Path, mlflow_uri: str
) -> None:
    """No spool: the batch is only in memory. Shutdown's abandon() used to count it lost and
    take it off the line while a hung call held it; when the call then stored it, _settle's
    todo.remove raised (a loop error) and a stored batch stayed counted as lost."""
    SCRIPT.hang.set()
    tracer.init({"backend": "scripted_mlflow", "tracking_uri": mlflow_uri, "project_name": EXP,
                 "spool": False, "flush_interval_s": 30, "export_batch_size": 5,
                 "shutdown_timeout_s": 1})  # fmt: skip
    trace(5)
    assert SCRIPT.entered.wait(60)
    pipeline = tracer.get_tracer().pipeline
    tracer.reset()
    at_shutdown = pipeline.metrics()
    SCRIPT.release.set()
    thread = pipeline.workers[0].thread
    assert thread is not None
    thread.join(30)
    m = pipeline.metrics()
    assert m["tracer/scripted_mlflow/loop_errors"] == 0, m
    assert m["tracer/scripted_mlflow/exported"] == 5 and m["tracer/scripted_mlflow/dropped"] == 0
    assert m["tracer/submitted"] == 5 and m["tracer/scripted_mlflow/pending"] == 0, m
    assert len(search_traces(mlflow_uri, EXP)) == 5
    # at shutdown it was neither lost nor on disk: in doubt, until the call ended
    assert at_shutdown["tracer/scripted_mlflow/dropped"] == 0, at_shutdown
    assert at_shutdown["tracer/scripted_mlflow/in_doubt"] == 5, at_shutdown


def test_two_offers_to_the_spool_never_write_one_batch_twice(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch the full disk refused waits in memory. The worker's regular offer to the spool
    writes it (slowly: a loaded disk) while shutdown's final offer, which skipped the rate
    limit and wrote outside the lock, wrote it too: two files, one replayed as a duplicate."""
    real_write, real_respool = BackendSpool.write, BatchQueue._respool
    state = {"full": True}
    entered, release, slow_pass_done = threading.Event(), threading.Event(), threading.Event()

    def write(self: BackendSpool, lines: list[bytes], in_doubt: bool = False) -> Path | None:
        if state["full"]:
            raise SpoolError(errno.ENOSPC, "injected: no space left on device")
        if not entered.is_set():  # the first offer after the disk came back is slow
            entered.set()
            release.wait(60)
        return real_write(self, lines, in_doubt)

    def respool(self: BatchQueue, final: bool) -> int:
        slow = not final and not entered.is_set()
        try:
            return real_respool(self, final)
        finally:
            if slow and entered.is_set():  # the slow offer is over, its batch placed
                slow_pass_done.set()

    monkeypatch.setattr(BackendSpool, "write", write)
    monkeypatch.setattr(BatchQueue, "_respool", respool)
    SCRIPT.fail_first = 10**6  # the backend is down: the batch waits
    SCRIPT.fail_s = 0.0
    tracer.init(config(tmp_path, {"backend": "scripted_mlflow", "tracking_uri": mlflow_uri},
                       export_max_retries=0, shutdown_timeout_s=1))  # fmt: skip
    trace(5)
    worker = tracer.get_tracer().pipeline.workers[0]
    wait_for(lambda: worker.spool_errors >= 1 and SCRIPT.calls, "a refusal and a failed call")
    state["full"] = False  # the worker's next offer (every 0.5 s) enters the slow write
    assert entered.wait(30)
    final = threading.Thread(target=worker.respool, kwargs={"final": True})
    final.start()  # shutdown's last offer, as abandon() makes it
    final.join(1.0)  # it waits for the offer in progress (or, before the fix, wrote a copy)
    release.set()
    final.join(30)
    assert slow_pass_done.wait(30)
    assert worker.oldest_in_memory_ns() is None  # on disk
    files = spooled(tmp_path / "spool")
    assert [batch_size(f) for f in files] == [5], files


@pytest.mark.slow(seconds=8)
@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_replay_names_in_doubt_trajectories_a_sink_may_store_twice(
    tmp_path: Path, store: dict[str, Any]
) -> None:
    """`rollout-tracer replay` of a batch left in doubt: stored (once, in an idempotent store),
    and counted as possibly stored twice where the sink does not deduplicate (OTLP)."""
    from tracer.replay import replay
    from tracer.spool import is_in_doubt

    pipeline, name, read = shut_down_with_a_call_in_flight(tmp_path, store)
    [batch] = spooled(tmp_path / "spool")
    assert is_in_doubt(batch)
    # the address of the store and its headers are not kept in the spool: given again
    where = {k: v for k, v in store.items() if k in ("tracking_uri", "otlp_endpoint",
                                                     "otlp_headers")}  # fmt: skip
    result = replay(str(tmp_path / "spool"), where)
    assert result.ok, result.failed
    assert result.replayed == {batch.parent.name: 5}
    assert result.in_doubt == ({batch.parent.name: 5} if name == "scripted_otlp" else {})
    end_the_held_call(pipeline, store, read)
    wait_for(lambda: len(set(stored(store))) == 5, "5 traces stored")
