"""Attempt numbers: a sample run again in one run (same experiment, step, sample_index,
rollout_n, validate) is a new trajectory with a trace id of its own, never an overwrite.

A trajectory's identity is (experiment, step, sample_index, rollout_n, validate, attempt). Each
process numbers the attempts it starts of one identity 0, 1, 2, ... A caller that knows better
(a Ray task re-run on another worker, which starts counting at 0) passes
``trace_attr(attempt=...)``; attempts counted here afterwards start above it.

Memory is bounded: the counts of the ``KEPT_STEPS`` most recently started steps are kept, older
steps are forgotten. A retry of a forgotten step counts from 0 again, so it must name its
attempt to get an id of its own.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from typing import Any

KEPT_STEPS = 16

Key = tuple[str, str, bool]  # (sample_index, rollout_n, validate), as the trace id reads them


def identity_key(sample_index: Any, rollout_n: Any, validate: Any) -> Key:
    return (str(sample_index), str(rollout_n), bool(validate))


class AttemptCounter:
    """Thread-safe; ``take`` runs once per traced trajectory with a derived trace id."""

    def __init__(self, kept_steps: int = KEPT_STEPS) -> None:
        self.kept_steps = kept_steps
        self._lock = threading.Lock()
        self._steps: OrderedDict[str, dict[Key, int]] = OrderedDict()
        _COUNTERS.add(self)

    def take(self, step: Any, key: Key, attempt: int | None = None) -> int:
        """The attempt number of a trajectory starting now: ``attempt`` when the caller names
        one, else one more than the latest so far (0 for the first)."""
        with self._lock:
            step_key = str(step)
            counts = self._steps.get(step_key)
            if counts is None:
                counts = self._steps[step_key] = {}
                while len(self._steps) > self.kept_steps:
                    self._steps.popitem(last=False)
            latest = counts.get(key, -1)
            if attempt is None:
                attempt = latest + 1
            counts[key] = max(latest, attempt)
            return attempt

    def latest(self, step: Any, key: Key) -> int | None:
        """The highest attempt started here for this identity, or None when this process has
        not started one (or has forgotten its step)."""
        with self._lock:
            counts = self._steps.get(str(step))
            return None if counts is None else counts.get(key)


_COUNTERS: weakref.WeakSet[AttemptCounter] = weakref.WeakSet()


def _fresh_locks() -> None:
    # a fork while another thread held a counter's lock would leave the child's copy locked
    for counter in list(_COUNTERS):
        counter._lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_locks)
