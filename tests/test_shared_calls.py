"""Batches that share an export call (issue 59): each processing wake spools a batch within
``flush_interval_s``, but a batch of a few trajectories waits in the spool up to
``export_interval_s`` for others to go with it in one call, one store transaction: a call
costs about the same for 2 trajectories as for 200 (benchmarks/ingest_batches.py measures
it). A flush, shutdown or a whole batch's worth sends at once; a crash during a shared call
leaves every batch of it marked in doubt, and the replay stores each trajectory once.

The store here is a real MLflow sqlite store read back with MLflow's client; the process of
the crash test is real and SIGKILLed inside its call. The counting backend only counts calls.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests._wait import wait_for
from tests.conftest import search_traces
from tracer.backends import register_backend
from tracer.backends.base import Exporter, ExportResult
from tracer.batch import Batch, call_group, wait_to_share_s
from tracer.replay import replay
from tracer.spool import is_in_doubt

ROOT = Path(__file__).resolve().parents[1]


class _Calls(Exporter):
    """Counts the trajectories of each call (a backend that takes lines, as MLflow's)."""

    name = "call_sizes"
    sizes: list[int] = []
    lock = threading.Lock()

    def __init__(self, config: Any = None) -> None:
        pass

    def export(self, batch: Sequence[Any], *, replay: bool = False) -> ExportResult:
        return self.export_encoded(batch, [], replay=replay)

    def export_encoded(self, batch: Sequence[Any], lines: Sequence[bytes], *,
                       replay: bool = False) -> ExportResult:  # fmt: skip
        with self.lock:
            _Calls.sizes.append(len(batch))
        return ExportResult.SUCCESS


register_backend("call_sizes", _Calls)


def _trickle(n: int, every_s: float) -> None:
    for i in range(n):
        with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
            pass
        time.sleep(every_s)


@pytest.mark.parametrize("interval", [30.0, 0.0])
def test_a_trickle_of_trajectories_goes_out_in_one_call_on_flush(
    tmp_path: Path, interval: float
) -> None:
    """Ten trajectories a few a second, each wake its own spooled batch: with a wait they are
    one call at the flush, which does not wait for the interval; with 0, one call per batch
    as before."""
    _Calls.sizes = []
    spool = tmp_path / "spool"
    tracer.init(backend="call_sizes", spool_dir=str(spool), flush_interval_s=0.05,
                export_interval_s=interval)  # fmt: skip
    try:
        _trickle(1, 0.0)
        assert tracer.flush(20)  # one flush before: a flush that ended holds nothing back
        _Calls.sizes = []
        _trickle(10, 0.15)
        if interval:
            assert _Calls.sizes == []  # waiting to share a call ...
            assert len(list(spool.glob("*/*.jsonl"))) >= 5  # ... each batch in the spool
        t0 = time.monotonic()
        assert tracer.flush(20)
        took = time.monotonic() - t0
        m = tracer.metrics()
    finally:
        tracer.reset()
    assert m["tracer/call_sizes/exported"] == 11
    if interval:
        assert _Calls.sizes == [10] and took < 5, (_Calls.sizes, took)
    else:
        assert len(_Calls.sizes) >= 5 and sum(_Calls.sizes) == 10, _Calls.sizes


def test_a_waiting_batch_goes_once_the_interval_passes(tmp_path: Path) -> None:
    _Calls.sizes = []
    tracer.init(backend="call_sizes", spool_dir=str(tmp_path / "spool"), flush_interval_s=0.05,
                export_interval_s=0.8)  # fmt: skip
    try:
        t0 = time.monotonic()
        _trickle(3, 0.05)
        wait_for(lambda: _Calls.sizes, "the call after the interval", 10)
        took = time.monotonic() - t0
    finally:
        tracer.reset()
    assert _Calls.sizes == [3] and 0.7 < took < 5, (_Calls.sizes, took)


def _batch(n: int, *, own: bool = True, in_memory: bool = True, spooled: bool = True) -> Batch:
    b = Batch(1 if own else None, [object()] * n if in_memory else None, None, n, 100 * n)
    b.lines = [b"{}"] * n if in_memory else None
    b.path = Path(f"batch-{id(b)}.jsonl") if spooled else None
    return b


def test_only_fresh_own_batches_in_memory_share_a_call_up_to_the_batch_size() -> None:
    line = [_batch(100), _batch(100), _batch(100)]
    assert call_group(line, 256, True) == line[:2]  # a third would pass 256
    tried = _batch(10)
    tried.attempted = True  # sent before: it may be in the store, goes alone (a replay)
    assert call_group([tried, _batch(10)], 256, True) == [tried]
    head = _batch(10)
    assert call_group([head, tried, _batch(10)], 256, True) == [head]  # a run, never a gap
    orphan, spooled = _batch(5, own=False), _batch(5, in_memory=False)
    for alone in (orphan, spooled):
        assert call_group([alone, _batch(5)], 256, True) == [alone]
        assert wait_to_share_s([alone], 256, True, 5.0, time.monotonic()) == 0.0
    fresh = _batch(5)
    assert 4.0 < wait_to_share_s([fresh], 256, True, 5.0, time.monotonic()) <= 5.0
    # an eighth of a call's worth already (the call's cost spread thin), or a batch behind
    # that cannot share: no wait
    assert wait_to_share_s([_batch(20), _batch(12)], 256, True, 5.0, time.monotonic()) == 0.0
    assert wait_to_share_s([_batch(20), _batch(11)], 256, True, 5.0, time.monotonic()) > 4.0
    # only what the spool holds waits: a batch only memory holds (spool off or full) goes
    for line in ([_batch(5, spooled=False)], [_batch(5), _batch(5, spooled=False)]):
        assert wait_to_share_s(line, 256, True, 5.0, time.monotonic()) == 0.0
    assert wait_to_share_s([_batch(5), tried], 256, True, 5.0, time.monotonic()) == 0.0


CRASHING = textwrap.dedent("""
    import pathlib, sys, time
    import tracer
    from tracer.backends import register_backend
    from tracer.backends.mlflow_backend import MlflowExporter
    spool, flag, uri = sys.argv[1:4]

    class StoreThenHang(MlflowExporter):
        def export_encoded(self, batch, lines, *, replay=False):
            result = super().export_encoded(batch, lines, replay=replay)
            pathlib.Path(flag).write_text(f"{result.value} {len(batch)}")
            time.sleep(600)

    register_backend("mlflow", StoreThenHang)  # the same name: the real spool folder
    tracer.init({"backend": "mlflow", "tracking_uri": uri, "project_name": "shared",
                 "spool_dir": spool, "export_in_subprocess": False, "export_batch_size": 32,
                 "flush_interval_s": 0.05, "export_interval_s": 60})
    for i in range(4):  # four wakes, four batches: the fourth makes an eighth of a call
        with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
            pass
        time.sleep(0.3)
    time.sleep(600)
""")


@pytest.mark.slow(seconds=25)
def test_a_crash_during_a_shared_call_leaves_each_batch_in_doubt_and_replay_stores_once(
    tmp_path: Path,
) -> None:
    pytest.importorskip("mlflow")
    spool, flag = tmp_path / "spool", tmp_path / "stored"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    script = tmp_path / "crashing.py"
    script.write_text(CRASHING)
    proc = subprocess.Popen([sys.executable, str(script), str(spool), str(flag), uri],
                            env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        wait_for(lambda: (flag.exists() and flag.read_text()) or proc.poll() is not None,
                 "the shared call", 180)  # fmt: skip
        assert proc.poll() is None, "the process ended by itself"
        assert flag.read_text() == "success 4"  # one call took the four batches
    finally:
        proc.kill()  # SIGKILL, inside the call
        proc.wait()
    files = sorted(spool.glob("*/*.jsonl"))
    assert len(files) == 4 and all(is_in_doubt(f) for f in files), [f.name for f in files]
    result = replay(str(spool), {"tracking_uri": uri})
    assert result.ok, result.failed
    assert sum(result.replayed.values()) == 4
    assert not list(spool.glob("*/*.jsonl"))
    stored = [t.info.trace_id for t in search_traces(uri, "shared")]
    assert len(stored) == len(set(stored)) == 4  # stored by the killed call, replayed: once
