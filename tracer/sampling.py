"""Deterministic per-step sampling of whole GRPO groups.

``max_samples_per_step_per_worker = N`` keeps, for each (step, validate) of this worker, the N
sample indices with the lowest seeded hash among those seen (bottom-k sampling). A sample's
decision is shared by all its ``rollout_n`` trajectories, so groups are kept whole, and the
hash depends only on (seed, step, validate, sample_index), so a rerun keeps the same samples
whatever order the trajectories start in.

A sample admitted early can be displaced by a later one with a lower hash; its trajectories
are then discarded before export (counted as ``evicted``). Once any trajectory of a sample
has been handed to a backend the sample is pinned and never displaced, so a step never holds
more than N samples, nor a partial group. When every sample of a step starts before the first
one finishes (verl's agent loop starts a batch with ``asyncio.gather``) the kept set is exactly
the N lowest hashes; otherwise it can differ from them only by pinned samples.
"""

from __future__ import annotations

import hashlib
import os
import threading
import weakref
from collections import OrderedDict
from typing import Any

_MAX_TRACKED_STEPS = 256


def sample_hash(seed: int, step: Any, validate: bool, sample_index: Any) -> int:
    key = f"{seed}|{step}|{int(bool(validate))}|{sample_index}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


class _StepState:
    __slots__ = ("auto_index", "kept", "pinned", "rejected")

    def __init__(self) -> None:
        self.kept: dict[Any, int] = {}  # sample_index -> hash
        self.pinned: set[Any] = set()
        self.rejected: set[Any] = set()
        self.auto_index = 0


class Sampler:
    """Thread-safe; ``admit`` runs once per trajectory on the hot path (~1-2 µs)."""

    def __init__(self, max_samples: int | None, seed: int = 0) -> None:
        self.max_samples = max_samples
        self.seed = seed
        self._lock = threading.Lock()
        self._steps: OrderedDict[tuple[Any, bool], _StepState] = OrderedDict()
        self.evicted = 0
        _SAMPLERS.add(self)

    def _state(self, key: tuple[Any, bool]) -> _StepState:
        state = self._steps.get(key)
        if state is None:
            state = self._steps[key] = _StepState()
            while len(self._steps) > _MAX_TRACKED_STEPS:
                self._steps.popitem(last=False)
        return state

    def admit(self, step: Any, sample_index: Any, validate: bool) -> tuple[bool, Any]:
        """Decide for a trajectory starting now. Returns (traced, effective sample_index)."""
        n = self.max_samples
        if n is None:
            return True, sample_index
        if n == 0:
            return False, sample_index
        key = (step, bool(validate))
        with self._lock:
            state = self._state(key)
            if sample_index is None:  # no index given: number the trajectories of the step
                sample_index = f"auto-{state.auto_index}"
                state.auto_index += 1
            if sample_index in state.kept:
                return True, sample_index
            if sample_index in state.rejected:
                return False, sample_index
            h = sample_hash(self.seed, step, validate, sample_index)
            if len(state.kept) < n:
                state.kept[sample_index] = h
                return True, sample_index
            worst = None
            for s, hs in state.kept.items():
                if s not in state.pinned and (worst is None or hs > worst[0]):
                    worst = (hs, s)
            if worst is not None and h < worst[0]:
                del state.kept[worst[1]]
                state.rejected.add(worst[1])
                state.kept[sample_index] = h
                return True, sample_index
            state.rejected.add(sample_index)
            return False, sample_index

    def holds(self, step: Any, sample_index: Any, validate: bool) -> bool:
        """Whether head sampling keeps this sample now (no side effect; the keep rules ask it
        for a trajectory that finds the buffer full)."""
        if self.max_samples is None:
            return True
        with self._lock:
            state = self._steps.get((step, bool(validate)))
            return state is not None and sample_index in state.kept

    def rejects(self, step: Any, sample_index: Any, validate: bool) -> bool:
        """Whether this sampler turned the sample down (False when it never saw it: another
        process may have traced it)."""
        if not self.max_samples:
            return self.max_samples == 0
        with self._lock:
            state = self._steps.get((step, bool(validate)))
            return state is not None and sample_index in state.rejected

    def confirm(self, step: Any, sample_index: Any, validate: bool) -> bool:
        """Called by the pipeline before export: True (and pinned) if the sample is still kept."""
        if self.max_samples is None:
            return True
        with self._lock:
            state = self._steps.get((step, bool(validate)))
            if state is None or sample_index not in state.kept:
                self.evicted += 1
                return False
            state.pinned.add(sample_index)
            return True


# A fork while another thread holds a sampler's lock would leave the child's copy locked for
# good (its holder does not exist there): every sampler gets a fresh lock in the child.
_SAMPLERS: weakref.WeakSet[Sampler] = weakref.WeakSet()


def _fresh_locks() -> None:
    for sampler in list(_SAMPLERS):
        sampler._lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_locks)
