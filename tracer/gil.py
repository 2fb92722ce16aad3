"""Keep the rollout's thread responsive while the tracer's background threads hold the GIL.

A thread that wants the GIL waits ``sys.getswitchinterval()`` (5 ms by default) before it
asks the holder to let go. An asyncio rollout gives the GIL away at every ``await`` on the
engine and wants it back the moment a response arrives; with the tracer's processing or
export thread busy, every such wake-up could wait up to 5 ms, and those waits add up along a
multi-turn trajectory (measured: a fast engine at 0.77 of its untraced throughput, with no
more CPU work on the rollout's thread).

:func:`courtesy` lowers the switch interval while at least one background stage is working
and puts the previous value back when the last one is done, so the rollout's thread waits at
most ``interval_s`` for the GIL. When nothing of the tracer runs, the interpreter runs with
the user's own setting. If the user changes the interval while it is lowered, theirs is kept.
``TraceConfig.background_switch_interval_s = None`` turns this off.

A shorter wait is not yet a fair share: while both want it, the GIL goes round-robin, so a
rollout whose Python work comes in bursts (every trajectory of a step tokenizes its prompt at
once) runs those bursts at half speed for as long as the tracer's threads have work.
:func:`step_aside`, called by a background stage between its items, hands the GIL over; if
the hand-back took long, another thread was waiting for it and ran meanwhile, and the stage
sleeps ``background_yield_s`` (without the GIL) before it goes on, at most once per quarter
millisecond of its own work, so it always progresses. The tracer's work then runs mostly in the
rollout's idle time (its awaits on the engine). A stage whose input is filling up passes
``urgent`` and does not wait: an overflowing buffer would cost the rollout more.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_active = 0  # background stages working now
_saved: float | None = None  # the interval before the first of them began
_ours: float | None = None  # the interval we set (to tell whether the user changed it since)


@contextmanager
def courtesy(interval_s: float | None) -> Iterator[None]:
    """Run the block with the switch interval at most ``interval_s`` (None: leave it)."""
    if interval_s is None:
        yield
        return
    _begin(interval_s)
    try:
        yield
    finally:
        _end()


def _begin(interval_s: float) -> None:
    global _active, _saved, _ours
    with _lock:
        _active += 1
        current = sys.getswitchinterval()
        if _active == 1 or current != _ours:  # the first stage, or the user set one meanwhile
            _saved = current
        if current > interval_s:
            sys.setswitchinterval(interval_s)
            _ours = sys.getswitchinterval()  # the interpreter rounds it


def _end() -> None:
    global _active, _saved, _ours
    with _lock:
        _active -= 1
        if _active > 0:
            return
        if _saved is not None and _ours is not None and sys.getswitchinterval() == _ours:
            sys.setswitchinterval(_saved)
        _saved = _ours = None


def active() -> int:
    """How many background stages hold the interval lowered now (for tests and metrics)."""
    return _active


def _after_fork_in_child() -> None:
    # the stages that lowered it do not exist in the child: give the child the old value back
    global _active, _saved, _ours, _lock, _aside_lock, _aside_ns, _hurry
    _lock = threading.Lock()
    if _active and _saved is not None and sys.getswitchinterval() == _ours:
        sys.setswitchinterval(_saved)
    _active, _saved, _ours = 0, None, None
    _aside_lock, _aside_ns, _hurry = threading.Lock(), 0, 0  # the parent's are not the child's


os.register_at_fork(after_in_child=_after_fork_in_child)


# step_aside: probe at most once per this much of a stage's own work. Measured on the fast
# engine (benchmarks/throughput.py, 2 cores): 0.975 of untraced with 1 ms slices, 0.99-0.996
# with 0.25 ms. A probe costs ~80 µs of the stage's wall time (the kernel's timer slack on
# sleep(0)) but no CPU and no GIL; a flush, which waits for the stages, turns probes off.
SLICE_NS = 250_000
# a hand-back slower than this means another thread held the GIL meanwhile: it waited for it
# (it holds it at least the switch interval, 0.5 ms under courtesy; the probe alone ~0.08 ms)
CONTENDED_NS = 300_000
_slices = threading.local()
_aside_lock = threading.Lock()
_aside_ns = 0  # total time stages kept off the GIL for another thread (tracer/stepped_aside_ms)


_hurry = 0  # flushes under way: somebody waits for the stages, which then never step aside


@contextmanager
def hurry() -> Iterator[None]:
    """While a ``flush`` waits for the background, the stages do not step aside (the thread
    that would get the GIL is then mostly another stage of the tracer, not the rollout)."""
    global _hurry
    with _aside_lock:
        _hurry += 1
    try:
        yield
    finally:
        with _aside_lock:
            _hurry -= 1


def step_aside(yield_s: float | None, urgent: bool = False) -> bool:
    """Between two items of a background stage: once per slice of its work, give the GIL to
    a thread that wants it, and when one did, keep off the GIL for ``yield_s`` (the stage
    keeps at least slice / (slice + yield_s) of a core, ~1/9 by default). Returns whether it
    waited."""
    global _aside_ns
    if yield_s is None or urgent or _hurry:
        return False
    now = time.perf_counter_ns()
    last = getattr(_slices, "t", None)
    if last is None or now - last < SLICE_NS:
        if last is None:
            _slices.t = now
        return False
    time.sleep(0)  # releases the GIL; a thread waiting for it takes it and holds it a while
    waited = time.perf_counter_ns() - now >= CONTENDED_NS
    if waited:
        time.sleep(yield_s)
    _slices.t = end = time.perf_counter_ns()
    if waited:
        with _aside_lock:
            _aside_ns += end - now
    return waited


def stepped_aside_ns() -> int:
    """How long, in all, this process's background stages kept off the GIL for another
    thread (the hand-backs that found it wanted, and the waits after them)."""
    return _aside_ns
