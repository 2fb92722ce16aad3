"""``tracer.annotate``: values computed after the rollout (trainer and reference log-probs,
entropy, advantages, a reward model's score), attached to trajectories already stored.

How the driver finds a trace a Ray worker wrote: with ``run_salt`` set (the same in every
process of the run), a trajectory's trace id is derived from the salt and its identity
(project, experiment, step, sample_index, rollout_n, validate; ``tracer.ids``). ``annotate``
computes the same id from the same identity; no lookup table crosses processes.

A sample run again is a new attempt with its own trace (``tracer.attempts``). An annotation
that names no attempt goes to the latest: the one this process traced last, else the latest a
backend that can look traces up holds (MLflow); a backend that cannot (JSONL) gets attempt 0.

The caller's cost is a copy of the arrays and a queue put (never blocking; a full queue drops
the annotation and counts it). One background thread decodes masks, encodes the arrays
(``tracer.tokens``) and hands batches to the backends, through exporters of its own (the
export workers' exporters are never called from two threads).

An annotation whose trace a backend does not hold yet (the trajectory has just ended, or the
backend is down) is pending: it is tried again every ``RETRY_INTERVAL_S`` until the trace is
there or ``annotation_timeout_s`` has passed since ``annotate``, then counted
``annotation_lost``. ``flush()`` waits for pending annotations and returns False while any is
left, or when one was lost since the previous flush. ``skipped`` counts only annotations of
trajectories this process knows were not sampled (its own sampler turned them down).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from tracer.annotations import AnnotationRecord
from tracer.backends import create_exporter
from tracer.backends.base import as_exporter
from tracer.errors import InternalErrors, log_every
from tracer.tokens import as_float_list, encode_floats

if TYPE_CHECKING:
    from tracer.backends.base import Exporter
    from tracer.config import TraceConfig

log = logging.getLogger("tracer")

MASK_NAMES = ("response_mask", "loss_mask")
RETRY_INTERVAL_S = 0.25  # how often pending annotations look for their trace again


def copy_value(value: Any) -> Any:
    """What the caller's thread keeps: numbers as floats, arrays copied (never converted)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "detach"):  # torch: no device sync unless it is on a GPU
        value = value.detach()
        return value.clone() if value.device.type == "cpu" else value.to("cpu")
    if hasattr(value, "copy") and hasattr(value, "shape"):  # numpy
        return float(value) if value.shape == () else value.copy()
    if isinstance(value, (list, tuple)):
        return list(value)
    raise TypeError(
        f"annotation values must be numbers or per-token arrays, got {type(value).__name__}"
    )


def encode_values(raw: dict[str, Any]) -> dict[str, Any]:
    """Background: per-token arrays -> ``f32:`` strings over model tokens only (positions where
    a given ``response_mask``/``loss_mask`` is 0 are dropped), numbers stay numbers."""
    mask = None
    for name in MASK_NAMES:
        if name in raw:
            mask = as_float_list(raw[name])
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if name in MASK_NAMES:
            continue
        if isinstance(value, float):
            out[name] = value
            continue
        values = as_float_list(value)
        if values is None:
            continue
        if mask is not None and len(mask) == len(values):
            values = [v for v, m in zip(values, mask, strict=True) if m]
        out[name] = encode_floats(values)
    return out


class Annotator:
    """The background half of ``tracer.annotate``; see the module docstring."""

    def __init__(self, config: TraceConfig) -> None:
        self.config = config
        self.errors = InternalErrors(config.raise_internal_errors)
        self.queue: collections.deque[tuple[AnnotationRecord, dict[str, Any]]] = (
            collections.deque()
        )
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.idle = threading.Condition(self.lock)
        self.in_flight = 0  # queued, being encoded, or being tried
        # per backend: annotations whose trace it does not hold yet, with their deadline
        self.waiting: dict[str, list[tuple[AnnotationRecord, float]]] = {
            name: [] for name in config.backends
        }
        # made on the background thread (the caller never waits for a backend, which may be
        # down); a backend that cannot annotate leaves ``waiting``
        self.exporters: dict[str, Exporter] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self._lost_at_last_flush = 0
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="rollout-tracer-annotator",
                                       daemon=True)  # fmt: skip
        self.thread.start()

    def put(self, ann: AnnotationRecord, raw: dict[str, Any]) -> bool:
        with self.lock:
            self.counts["submitted"] += 1
            if len(self.queue) >= self.config.max_buffer_trajectories:
                self.counts["dropped"] += 1
                return False
            self.queue.append((ann, raw))
            self.in_flight += 1
        self.wake.set()
        return True

    def skip(self) -> None:
        """An annotation of a trajectory this process did not sample: nothing to store."""
        with self.lock:
            self.counts["submitted"] += 1
            for name in self.waiting:
                self.counts[f"{name}/skipped"] += 1

    def _pending(self) -> int:
        return sum(len(w) for w in self.waiting.values())

    def _run(self) -> None:
        while not self.closed:
            with self.lock:
                pending = self._pending()
            self.wake.wait(RETRY_INTERVAL_S if pending else self.config.flush_interval_s)
            self.wake.clear()
            try:
                self._connect()
                self._take_new()
                self._retry_waiting()
            except Exception as exc:  # the loop never dies
                self.errors.report("annotating", exc, background=True)
                time.sleep(0.05)

    def _connect(self) -> None:
        """Make the exporters not made yet; one that fails is tried again next time."""
        for name in list(self.waiting):
            if name in self.exporters:
                continue
            try:
                exporter = as_exporter(create_exporter(name, self.config))
            except Exception as exc:
                if log_every(self._count_error(name)):
                    log.warning("rollout-tracer: cannot reach %s to annotate (%s: %s); "
                                "annotations wait for it", name, type(exc).__name__, exc)
                continue
            if exporter.supports_annotations:
                self.exporters[name] = exporter
                continue
            log.warning("rollout-tracer: backend %r cannot annotate stored traces; "
                        "annotations skip it", name)  # fmt: skip
            exporter.shutdown()
            with self.lock:
                del self.waiting[name]
                self.idle.notify_all()

    def _take_new(self) -> None:
        while True:
            with self.lock:
                n = min(len(self.queue), self.config.export_batch_size)
                batch = [self.queue.popleft() for _ in range(n)]
            if not batch:
                return
            try:
                items = []
                for ann, raw in batch:
                    ann.values = encode_values(raw)
                    deadline = ann.created_ns / 1e9 + self.config.annotation_timeout_s
                    items.append((ann, deadline))
                for name in list(self.waiting):
                    self._try(name, items)
            except Exception as exc:
                with self.lock:
                    self.counts["failed"] += len(batch)
                self.errors.report("annotating", exc, background=True)
            finally:
                with self.lock:
                    self.in_flight -= len(batch)
                    self.idle.notify_all()

    def _retry_waiting(self) -> None:
        now = time.time()
        for name in list(self.waiting):
            with self.lock:  # in flight while out of the list: flush() must still wait
                todo, self.waiting[name] = self.waiting[name], []
                self.in_flight += len(todo)
            try:
                live = [(a, d) for a, d in todo if d > now]
                lost = len(todo) - len(live)
                if lost:
                    with self.lock:
                        self.counts[f"{name}/annotation_lost"] += lost
                    log.warning("rollout-tracer: %d annotations lost for %s: their trace was "
                                "not stored within annotation_timeout_s=%s", lost, name,
                                self.config.annotation_timeout_s)  # fmt: skip
                for i in range(0, len(live), self.config.export_batch_size):
                    self._try(name, live[i : i + self.config.export_batch_size])
            finally:
                with self.lock:
                    self.in_flight -= len(todo)
                    self.idle.notify_all()

    def _try(self, name: str, items: list[tuple[AnnotationRecord, float]]) -> None:
        """Hand annotations to one backend; those whose trace it lacks (or that failed, or
        whose backend is not reached yet) wait."""
        exporter = self.exporters.get(name)
        found = [False] * len(items)
        if exporter is not None and items:
            try:
                found = exporter.annotate([a for a, _ in items])
            except Exception as exc:  # the backend is down: they wait, like missing traces
                if log_every(self._count_error(name)):
                    log.warning("rollout-tracer: %s could not store %d annotations (%s: %s); "
                                "they wait for it", name, len(items),
                                type(exc).__name__, exc)  # fmt: skip
        with self.lock:
            self.counts[f"{name}/applied"] += sum(found)
            if name in self.waiting:
                self.waiting[name].extend(
                    item for item, ok in zip(items, found, strict=True) if not ok
                )
            self.idle.notify_all()

    def _count_error(self, name: str) -> int:
        """Count one failed call to backend ``name``; returns how many so far (for log_every)."""
        with self.lock:
            self.counts[f"{name}/errors"] += 1
            return self.counts[f"{name}/errors"]

    def _lost_total(self) -> int:
        return sum(v for k, v in self.counts.items()
                   if k.endswith(("/annotation_lost", "dropped", "failed")))  # fmt: skip

    def flush(self, timeout_s: float) -> bool:
        """Wait until every annotation so far is applied or lost. False while any is queued
        or pending at the deadline, or when one was lost since the previous flush."""
        deadline = time.monotonic() + timeout_s
        self.wake.set()
        with self.lock:
            while self.in_flight or self._pending():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.idle.wait(min(left, RETRY_INTERVAL_S))
            lost = self._lost_total()
            ok = lost <= self._lost_at_last_flush
            self._lost_at_last_flush = lost
        self.errors.check()
        return ok

    def close(self, timeout_s: float) -> bool:
        ok = self.flush(timeout_s)
        self.closed = True
        self.wake.set()
        self.thread.join(min(1.0, max(0.0, timeout_s)))
        with self.lock:  # what still waits now is lost: say so, never silently
            for name, waiting in self.waiting.items():
                if waiting:
                    self.counts[f"{name}/annotation_lost"] += len(waiting)
                    log.warning("rollout-tracer: %d annotations lost for %s: their trace was "
                                "not stored before shutdown", len(waiting), name)
                    waiting.clear()
        for exporter in self.exporters.values():
            exporter.shutdown(timeout_s)
        return ok

    def metrics(self) -> dict[str, int]:
        with self.lock:
            out = {f"tracer/annotations/{k}": v for k, v in self.counts.items()}
            out["tracer/annotations/pending"] = self._pending() + self.in_flight
        return out
