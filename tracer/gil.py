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
"""

from __future__ import annotations

import os
import sys
import threading
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
    global _active, _saved, _ours, _lock
    _lock = threading.Lock()
    if _active and _saved is not None and sys.getswitchinterval() == _ours:
        sys.setswitchinterval(_saved)
    _active, _saved, _ours = 0, None, None


os.register_at_fork(after_in_child=_after_fork_in_child)
