"""The live numbers of rollout workers in other Ray processes, gathered in the driver, so that a
trainer's own logger (verl's ``Tracking``) logs them under the step it logs its own metrics.

Three parts, each boring on purpose:

- :class:`Publisher`, in every rollout worker: a thread that every :data:`PUSH_INTERVAL_S`
  sends the gatherer what is new in this process's :func:`tracer.live.partial` of its newest
  steps: the trajectories' rows it has not sent yet and its current counters. One send at a
  time: a slow or dead gatherer never piles calls up in the worker; after a failed send the
  next one sends the steps whole.
- :class:`Gatherer`, a named Ray actor of the job (``num_cpus=0``, owned by the driver): holds
  those pieces until the driver has taken them. It computes nothing.
- :class:`Collector`, in the driver: a thread that waits on the gatherer for pieces (at most
  twice a second), merges them per step (:func:`tracer.live.merge`: a trajectory counted once,
  so a piece sent twice is harmless) and computes each changed step's numbers
  (:func:`tracer.live.metrics`) into a :class:`StepBook`. The trainer's log call only reads
  the book (:meth:`StepBook.for_log`): a dict lookup under a lock, never a Ray call.

A step's numbers are those that reached the driver when the trainer logged that step. What
arrives for a step after it was logged is not logged again under it (W&B refuses an older
step): it is counted in ``tracer/live_late_trajectories`` and named in one warning per step,
so that for every step the trajectories in its numbers plus the late ones are all of them.
Every failure here (no Ray, the gatherer killed, a worker gone) costs the numbers, never the
training: the trainer's own metrics are logged as they would be without us.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

log = logging.getLogger("tracer.verl")

NAMESPACE = "rollout_tracer"
ACTOR_PREFIX = "rollout_tracer_live_"  # + the Ray job id: one gatherer per job
PUSH_INTERVAL_S = 0.5  # a worker's sends
PUSH_STEPS = 4  # a worker keeps sending its newest steps: stragglers of the step before count
KEEP_STEPS = 16  # steps the driver keeps: what the pattern rules look back over
POLL_S = 0.5  # the driver asks the gatherer at most this often
WAIT_S = 2.0  # and the gatherer answers at once when it holds something, else after this
RETRY_S = 5.0  # after a failure: look the gatherer up (worker) or start it again (driver)

Partial = dict[str, Any]
Piece = tuple[int, str, Partial]  # (step, worker, partial)
Changes = tuple[str, int, list[Piece]]  # (the gatherer's epoch, its version, pieces)


def actor_name(job_id: str) -> str:
    return ACTOR_PREFIX + job_id


def step_trajectories(part: Mapping[str, Any], step: int) -> int:
    """The training trajectories of ``step`` in a partial (what lateness is measured in)."""
    return sum(1 for r in part.get("rows") or ()
               if int(r["step"]) == step and not r.get("validate"))  # fmt: skip


def _live() -> Any:
    from tracer import live

    return live


# ------------------------------------------------------------------------------ driver state
class StepBook:
    """The driver's numbers per step, and what reached it late. Fed by the collector thread
    (:meth:`receive`, then :meth:`refresh`), read by the trainer's log call (:meth:`for_log`)."""

    def __init__(self, merge: Callable[[Iterable[Partial]], Partial] | None = None,
                 metrics: Callable[[Partial], dict[str, float]] | None = None,
                 keep_steps: int = KEEP_STEPS) -> None:  # fmt: skip
        self.merge = merge or _live().merge
        self.metrics = metrics or _live().metrics
        self.keep_steps = keep_steps
        self.lock = threading.Lock()  # guards what for_log reads: numbers, logged, late
        self.parts: dict[int, Partial] = {}  # step -> every worker's pieces, merged
        self.workers: dict[int, set[str]] = {}  # step -> the workers that sent pieces of it
        self.dirty: set[int] = set()
        self.numbers: dict[int, tuple[dict[str, float], int]] = {}  # step -> (metrics, count)
        self.logged: dict[int, int] = {}  # step -> trajectories in its logged numbers
        self.late = 0  # trajectories that arrived after their step was logged
        self.warned: set[int] = set()
        self.received = False

    def receive(self, pieces: Iterable[Piece]) -> None:
        """Pieces from the gatherer (the collector thread)."""
        for step, worker, part in pieces:
            self.received = True
            if step not in self.parts and len(self.parts) >= self.keep_steps \
                    and step < min(self.parts):  # fmt: skip
                with self.lock:  # a step already let go of: never logged, so late
                    self._count_late(step, step_trajectories(part, step), worker)
                continue
            old = self.parts.get(step)
            self.parts[step] = self.merge([old, part] if old is not None else [part])
            self.workers.setdefault(step, set()).add(worker)
            self.dirty.add(step)
            for gone in sorted(self.parts)[: max(0, len(self.parts) - self.keep_steps)]:
                del self.parts[gone]
                self.workers.pop(gone, None)
                self.dirty.discard(gone)

    def refresh(self) -> None:
        """Compute the numbers of every step that changed (the collector thread), and count
        what reached an already logged step."""
        for step in sorted(self.dirty):
            kept = [p for s, p in sorted(self.parts.items()) if s <= step]
            merged = self.merge(kept)
            count = step_trajectories(merged, step)
            numbers = self.metrics(merged)
            numbers["tracer/live_workers"] = float(len(self.workers.get(step, ())))
            with self.lock:
                self.numbers[step] = (numbers, count)
                logged = self.logged.get(step)
                if logged is not None and count > logged:
                    self.logged[step] = count
                    self._count_late(step, count - logged, "")
        self.dirty.clear()
        with self.lock:
            for table in (self.numbers, self.logged):
                for gone in sorted(table)[: max(0, len(table) - self.keep_steps)]:
                    del table[gone]  # type: ignore[attr-defined]

    def _count_late(self, step: int, n: int, worker: str) -> None:
        """(caller holds ``lock``)"""
        self.late += n
        if n and step not in self.warned:
            self.warned.add(step)
            log.warning("rollout-tracer: the trainer logged step %d before all its "
                        "trajectories reached the driver (%d late so far%s); the late ones are "
                        "counted in tracer/live_late_trajectories, not in step %d's numbers "
                        "(the trace store has them all)", step, n,
                        f", worker {worker}" if worker else "", step)  # fmt: skip

    def for_log(self, step: int) -> dict[str, float]:
        """The numbers to log with the trainer's ``step``; from then on, what arrives for
        ``step`` is late. Empty until any worker has sent anything."""
        with self.lock:
            if not self.received:
                return {}
            numbers, count = self.numbers.get(step, ({}, 0))
            self.logged[step] = count
            out = {"tracer/live_step_trajectories": 0.0, "tracer/live_workers": 0.0, **numbers,
                   "tracer/live_late_trajectories": float(self.late)}  # fmt: skip
        return out


# ------------------------------------------------------------------------------ the actor
class Gatherer:
    """The named actor: pieces the driver has not taken yet. ``changes`` answers as soon as
    it holds something newer than the caller's version, or after ``wait_s``; what the caller
    had (its version, same epoch) is let go."""

    def __init__(self, keep_steps: int = KEEP_STEPS) -> None:
        self.epoch = uuid.uuid4().hex  # a new actor: the driver starts from version 0
        self.version = 0
        self.keep_steps = keep_steps
        self.pieces: list[tuple[int, Piece]] = []  # (version, piece)
        self.changed = asyncio.Event()

    async def put(self, worker: str, parts: dict[int, Partial]) -> None:
        self.version += 1
        self.pieces.extend((self.version, (int(s), worker, p)) for s, p in parts.items())
        steps = sorted({piece[0] for _, piece in self.pieces})
        if len(steps) > self.keep_steps:  # a driver that stopped taking: bounded anyway
            first = steps[-self.keep_steps]
            self.pieces = [(v, p) for v, p in self.pieces if p[0] >= first]
        self.changed.set()

    async def changes(self, epoch: str, version: int, wait_s: float) -> Changes:
        if epoch == self.epoch:
            self.pieces = [(v, p) for v, p in self.pieces if v > version]
            if not self.pieces:
                self.changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.changed.wait(), wait_s)
        return self.epoch, self.version, [p for _, p in self.pieces]


def _job_id() -> str:
    import ray

    return str(ray.get_runtime_context().get_job_id())


# ------------------------------------------------------------------------------ driver thread
class Collector:
    """The driver's thread: starts the job's gatherer and feeds :class:`StepBook` from it."""

    def __init__(self, book: StepBook) -> None:
        self.book = book
        self.stop_event = threading.Event()
        self.errors = 0
        self.thread = threading.Thread(target=self._run, name="rollout-tracer-live-collector",
                                       daemon=True)  # fmt: skip

    def start(self) -> Collector:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()

    def _run(self) -> None:
        import ray

        actor: Any = None
        epoch, version = "", 0
        while not self.stop_event.is_set():
            asked = time.monotonic()
            try:
                if actor is None:
                    actor = ray.remote(Gatherer).options(
                        name=actor_name(_job_id()), namespace=NAMESPACE, get_if_exists=True,
                        num_cpus=0, max_restarts=0).remote()  # fmt: skip
                epoch, version, pieces = ray.get(actor.changes.remote(epoch, version, WAIT_S),
                                                 timeout=WAIT_S + 60)  # fmt: skip
                self.book.receive(pieces)
                self.book.refresh()
            except Exception as exc:  # no Ray, the gatherer killed: numbers pause, training not
                self.errors += 1
                if self.errors in (1, 10, 100) or self.errors % 1000 == 0:
                    log.warning("rollout-tracer: the live numbers of the rollout workers "
                                "cannot reach the driver (%s: %s); the trainer's own metrics "
                                "are logged as usual; trying again in %.0f s [%d times]",
                                type(exc).__name__, exc, RETRY_S, self.errors)  # fmt: skip
                actor = None
                self.stop_event.wait(RETRY_S)
                continue
            self.stop_event.wait(max(0.0, POLL_S - (time.monotonic() - asked)))


# ------------------------------------------------------------------------------ worker thread
class Publisher:
    """A rollout worker's thread: sends what is new in the partials of its newest steps."""

    def __init__(self, worker: str, partial: Callable[[int], Partial] | None = None,
                 interval_s: float = PUSH_INTERVAL_S) -> None:  # fmt: skip
        self.worker, self.interval_s = worker, interval_s
        self.partial = partial or (lambda step: _live().partial(step, history=False,
                                                                 timeout_s=0))  # fmt: skip
        self.newest: int | None = None
        self.sent: dict[int, tuple[set[Any], Any]] = {}  # step -> (trace ids, counters) sent
        self.actor: Any = None
        self.in_flight: Any = None
        self.retry_at = 0.0
        self.errors = 0
        self.found = False  # the gatherer was found once: failures after that are worth a line
        self.lock = threading.Lock()  # one push at a time (the thread's, or stop()'s)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rollout-tracer-live-publisher",
                                       daemon=True)  # fmt: skip

    def note_step(self, step: Any) -> None:
        """A training trajectory of ``step`` opened here (the rollout's thread: a compare)."""
        if isinstance(step, int) and (self.newest is None or step > self.newest):
            self.newest = step

    def start(self) -> Publisher:
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread after one last send."""
        self.stop_event.set()
        self.push()

    def _run(self) -> None:
        while not self.stop_event.wait(self.interval_s):
            self.push()

    def _pieces(self, newest: int) -> dict[int, Partial]:
        """What is new since the last send: rows not sent, and the newest step's counters."""
        out = {}
        for step in range(newest - PUSH_STEPS + 1, newest + 1):
            part = self.partial(step)
            ids, counters = self.sent.get(step, (set(), None))
            rows = [r for r in part.get("rows") or () if r.get("trace_id") not in ids]
            if rows or (step == newest and part.get("processes") != counters):
                out[step] = {**part, "rows": rows}
        return out

    def _sent(self, pieces: dict[int, Partial], newest: int) -> None:
        for step, piece in pieces.items():
            ids = self.sent.setdefault(step, (set(), None))[0]
            ids.update(r.get("trace_id") for r in piece["rows"])
            self.sent[step] = (ids, piece.get("processes"))
        for old in [s for s in self.sent if s <= newest - PUSH_STEPS]:
            del self.sent[old]

    def push(self) -> None:
        import ray

        with self.lock:
            newest = self.newest
            if newest is None:
                return
            try:
                if self.in_flight is not None:
                    ready, _ = ray.wait([self.in_flight], timeout=0)
                    if not ready:
                        return  # the last send is still on its way: never pile up
                    ref, self.in_flight = self.in_flight, None
                    ray.get(ref)  # raises when the gatherer is gone
                if self.actor is None:
                    if time.monotonic() < self.retry_at:
                        return
                    self.actor = ray.get_actor(actor_name(_job_id()), namespace=NAMESPACE)
                    self.found = True
                pieces = self._pieces(newest)
                if not pieces:
                    return
                self.in_flight = self.actor.put.remote(self.worker, pieces)
                self._sent(pieces, newest)
            except Exception as exc:  # no gatherer yet, or gone: look again later, send all
                self.actor, self.in_flight = None, None
                self.sent.clear()
                self.retry_at = time.monotonic() + RETRY_S
                if not self.found:  # no driver collects (no verl Tracking in this job): quiet
                    return
                self.errors += 1
                if self.errors in (10, 100) or self.errors % 1000 == 0:
                    log.warning("rollout-tracer: this worker's live numbers cannot reach the "
                                "driver (%s: %s) [%d times]", type(exc).__name__, exc,
                                self.errors)  # fmt: skip
