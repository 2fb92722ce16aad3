"""The switch-interval courtesy (tracer/gil.py): lowered only while the tracer's background
stages work, the user's own value back when they are idle, after a fork, or if the user set
one meanwhile."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator, Sequence
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
