"""The switch-interval courtesy (tracer/gil.py): lowered only while the tracer's background
stages work, the user's own value back when they are idle, after a fork, or if the user set
one meanwhile."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

import tracer
from tracer import gil
from tracer.backends import register_backend
from tracer.backends.base import Exporter, ExportResult
from tracer.config import ConfigError
from tracer.record import TrajectoryRecord


@pytest.fixture(autouse=True)
def _user_interval() -> Iterator[float]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)  # the "user's" value, not the default, so a reset shows
    yield 0.004
    sys.setswitchinterval(before)


def test_lowered_inside_and_restored_after() -> None:
    with gil.courtesy(0.0005):
        assert sys.getswitchinterval() == pytest.approx(0.0005, rel=0.01)
        with gil.courtesy(0.0005):  # a second stage at the same time
            assert gil.active() == 2
        assert sys.getswitchinterval() == pytest.approx(0.0005, rel=0.01)  # the first works on
    assert gil.active() == 0
    assert sys.getswitchinterval() == pytest.approx(0.004)


def test_none_leaves_it_alone_and_a_lower_user_value_is_kept() -> None:
    with gil.courtesy(None):
        assert sys.getswitchinterval() == pytest.approx(0.004)
    sys.setswitchinterval(0.0001)
    with gil.courtesy(0.0005):
        assert sys.getswitchinterval() == pytest.approx(0.0001)
    assert sys.getswitchinterval() == pytest.approx(0.0001)


def test_a_value_the_user_sets_meanwhile_wins() -> None:
    with gil.courtesy(0.0005):
        sys.setswitchinterval(0.002)
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_a_value_the_user_sets_meanwhile_wins_when_another_stage_begins() -> None:
    with gil.courtesy(0.0005):
        sys.setswitchinterval(0.002)  # the user's, while one stage works
        with gil.courtesy(0.0005):  # a second stage lowers it again...
            assert sys.getswitchinterval() == pytest.approx(0.0005, rel=0.01)
    assert sys.getswitchinterval() == pytest.approx(0.002)  # ...and gives the user's back


def test_an_exception_inside_still_restores() -> None:
    with pytest.raises(RuntimeError), gil.courtesy(0.0005):
        raise RuntimeError("boom")
    assert gil.active() == 0
    assert sys.getswitchinterval() == pytest.approx(0.004)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_lowered_gets_the_old_value() -> None:
    read, write = os.pipe()
    with gil.courtesy(0.0005):
        pid = os.fork()
        if pid == 0:  # the child: the stage that lowered it does not exist here
            os.write(write, f"{sys.getswitchinterval()} {gil.active()}".encode())
            os._exit(0)
        os.waitpid(pid, 0)
    interval, active = os.read(read, 100).decode().split()
    os.close(read)
    os.close(write)
    assert float(interval) == pytest.approx(0.004)
    assert active == "0"


class _Watching(Exporter):
    """Records the switch interval each export call runs under; can be held mid-export."""

    seen: list[float] = []  # shared by the instances a tracer makes
    gate = threading.Event()
    entered = threading.Event()

    def __init__(self, config: Any) -> None:
        self.name = "watching"
        self.destination = "memory"

    def export(self, batch: Sequence[TrajectoryRecord], *, replay: bool = False) -> ExportResult:
        _Watching.seen.append(sys.getswitchinterval())
        _Watching.entered.set()
        _Watching.gate.wait(30)
        return ExportResult.SUCCESS


register_backend("watching", _Watching)


def test_tracer_lowers_it_only_while_exporting() -> None:
    _Watching.seen.clear()
    _Watching.gate.clear()
    _Watching.entered.clear()
    tracer.init(backend="watching", spool=False, flush_interval_s=0.05)
    try:
        with tracer.trace_attr(step=0, sample_index=0, rollout_n=0):
            pass
        assert _Watching.entered.wait(30)
        # the export call is in flight on the worker's thread: the rollout's wait is bounded
        assert sys.getswitchinterval() == pytest.approx(0.0005, rel=0.01)
        _Watching.gate.set()
        assert tracer.flush(timeout_s=30)
    finally:
        _Watching.gate.set()
        tracer.reset()
    assert _Watching.seen and _Watching.seen[0] == pytest.approx(0.0005, rel=0.01)
    assert sys.getswitchinterval() == pytest.approx(0.004)  # idle: the user's value again


def test_config_checks_the_interval() -> None:
    with pytest.raises(ConfigError, match="background_switch_interval_s"):
        tracer.TraceConfig(backend=None, background_switch_interval_s=0)
    with pytest.raises(ConfigError, match="background_switch_interval_s"):
        tracer.TraceConfig(backend=None, background_switch_interval_s="fast")
    assert tracer.TraceConfig(backend=None, background_switch_interval_s=None)


# ------------------------------------------------------------------- step_aside
class _Hog:
    """A thread that runs Python without pause: a CPU-bound rollout wanting the GIL."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            sum(range(2000))

    def __enter__(self) -> _Hog:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(10)


def _probe(yield_s: float | None, urgent: bool = False, n: int = 8) -> list[bool]:
    """step_aside after a slice of the stage's own work, n times: whether each waited."""
    waits = []
    for _ in range(n):
        gil._slices.t = time.perf_counter_ns() - 2 * gil.SLICE_NS  # a slice of work is done
        waits.append(gil.step_aside(yield_s, urgent))
    return waits


def test_step_aside_waits_only_while_another_thread_wants_the_gil() -> None:
    assert not all(_probe(0.002))  # alone: the hand-back is immediate (noise may cost one)
    before = gil.stepped_aside_ns()
    with _Hog():
        waits = _probe(0.002)
        assert any(waits), waits  # the hog held the GIL: the stage kept off it
        assert not any(_probe(0.002, urgent=True))  # a filling buffer: never waits
        assert not any(_probe(None))  # turned off
        with gil.hurry():  # a flush waits for the stages: they never step aside meanwhile
            assert not any(_probe(0.002))
        assert any(_probe(0.002))  # and do again after it
    assert gil.stepped_aside_ns() > before


def test_step_aside_probes_once_per_slice_of_work() -> None:
    with _Hog():
        gil._slices.t = time.perf_counter_ns() + 10**9  # a probe "just happened", for 1 s
        assert not any(gil.step_aside(0.002) for _ in range(50))  # no slice done yet
        gil._slices.t -= 10**9 + gil.SLICE_NS  # the slice is over: the next call probes
        before = time.perf_counter_ns()
        gil.step_aside(0.002)
        assert gil._slices.t >= before  # and starts the next slice


def test_a_cpu_bound_rollout_never_starves_the_tracer(tmp_path: Path) -> None:
    """With a thread holding the GIL all along, every trajectory is still exported (the
    stages step aside at most once per slice of their work), and the metric shows it did."""
    path = tmp_path / "out.jsonl"
    tracer.init(backend="jsonl", jsonl_path=str(path), spool_dir=str(tmp_path / "spool"),
                flush_interval_s=0.05)  # fmt: skip
    try:
        with _Hog():
            for i in range(300):
                with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
                    pass
                if i % 50 == 0:
                    time.sleep(0.05)  # let the stages start while the hog runs
            assert tracer.flush(timeout_s=120)
            metrics = tracer.metrics()
    finally:
        tracer.reset()
    assert len(path.read_text().splitlines()) == 300
    assert metrics["tracer/jsonl/exported"] == 300
    assert metrics["tracer/stepped_aside_ms"] > 0


def test_the_processor_does_not_step_aside_with_the_buffer_half_full() -> None:
    tracer.init(backend="memory", export_batch_size=1_000_000, flush_interval_s=3600.0,
                max_buffer_trajectories=10)  # fmt: skip
    try:
        pipeline = tracer.get_tracer().pipeline
        assert pipeline is not None
        for i in range(5):
            assert not pipeline._urgent()
            with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
                pass
        assert pipeline._urgent()  # 5 of 10
    finally:
        tracer.reset()


def test_config_checks_the_yield() -> None:
    for bad in (0, -1, 0.5, "fast", True):
        with pytest.raises(ConfigError, match="background_yield_s"):
            tracer.TraceConfig(backend=None, background_yield_s=bad)
    assert tracer.TraceConfig(backend=None, background_yield_s=None)


def test_the_export_child_gets_no_courtesies() -> None:
    from tracer.backends.subprocess_proxy import picklable

    child = picklable(tracer.TraceConfig(backend="mlflow"))
    assert child.background_yield_s is None and child.background_switch_interval_s is None


def test_the_rollouts_own_thread_never_steps_aside(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A full buffer makes the rollout's thread build and spool its trajectory itself; that
    work must not wait for anybody (the spy records which thread asked to step aside)."""
    import tracer.pipeline as pipeline_module

    calls: list[tuple[bool, float | None]] = []
    real = pipeline_module.step_aside

    def spy(yield_s: float | None, urgent: bool = False) -> bool:
        calls.append((threading.current_thread() is threading.main_thread(), yield_s))
        return real(yield_s, urgent)

    monkeypatch.setattr(pipeline_module, "step_aside", spy)
    tracer.init(backend="jsonl", jsonl_path=str(tmp_path / "out.jsonl"),
                spool_dir=str(tmp_path / "spool"), export_batch_size=1_000_000,
                flush_interval_s=3600.0, max_buffer_trajectories=2)  # fmt: skip
    try:
        for i in range(6):  # 2 fill the buffer, the next overflow on this thread
            with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
                pass
        assert tracer.metrics()["tracer/overflowed_to_spool"] >= 1
        assert tracer.flush(timeout_s=30)
    finally:
        tracer.reset()
    on_main = [y for main, y in calls if main]
    assert on_main and set(on_main) == {None}  # asked, with stepping aside off
    assert any(y is not None for main, y in calls if not main)  # the processor's thread may


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_during_a_flush_steps_aside_again() -> None:
    """A fork while a flush waits (hurry) must not leave the child hurrying for good, nor with
    the parent's stepped-aside time."""
    read, write = os.pipe()
    with _Hog():
        _probe(0.002)  # some time stepped aside in the parent
        with gil.hurry():
            pid = os.fork()
            if pid == 0:  # the child: no flush waits here, and no hog thread either
                hurrying = gil._hurry
                aside = gil.stepped_aside_ns()
                os.write(write, f"{hurrying} {aside}".encode())
                os._exit(0)
            os.waitpid(pid, 0)
    hurrying, aside = os.read(read, 100).decode().split()
    os.close(read)
    os.close(write)
    assert (hurrying, aside) == ("0", "0")
