"""``tracer.annotate``: values computed after the rollout (trainer and reference log-probs,
entropy, advantages, a reward model's score), attached to trajectories already stored.

How the driver finds a trace a Ray worker wrote: with ``run_salt`` set (the same in every
process of the run), a trajectory's trace id is derived from the salt and its identity
(project, experiment, step, sample_index, rollout_n, validate; ``tracer.ids``). ``annotate``
computes the same id from the same identity; no lookup table crosses processes.

The caller's cost is a copy of the arrays and a queue put (never blocking; a full queue drops
the annotation and counts it). One background thread decodes masks, encodes the arrays
(``tracer.tokens``) and hands batches to the backends, through exporters of its own (the
export workers' exporters are never called from two threads). A backend that finds no trace
(the trajectory was not sampled) skips it with one lookup and counts it ``skipped``.
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
from tracer.errors import InternalErrors
from tracer.tokens import as_float_list, encode_floats

if TYPE_CHECKING:
    from tracer.backends.base import Exporter
    from tracer.config import TraceConfig

log = logging.getLogger("tracer")

MASK_NAMES = ("response_mask", "loss_mask")
_RETRIES = 3


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
    def __init__(self, config: TraceConfig) -> None:
        self.config = config
        self.errors = InternalErrors(config.raise_internal_errors)
        self.queue: collections.deque[tuple[AnnotationRecord, dict[str, Any]]] = (
            collections.deque()
        )
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.idle = threading.Condition(self.lock)
        self.in_flight = 0
        self.counts: collections.Counter[str] = collections.Counter()
        self.closed = False
        self.exporters: list[Exporter] = []
        for name in config.backends:
            exporter = as_exporter(create_exporter(name, config))
            if exporter.supports_annotations:
                self.exporters.append(exporter)
            else:
                log.warning("rollout-tracer: backend %r cannot annotate stored traces; "
                            "annotations skip it", name)  # fmt: skip
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

    def _run(self) -> None:
        while not self.closed:
            self.wake.wait(self.config.flush_interval_s)
            self.wake.clear()
            while True:
                with self.lock:
                    n = min(len(self.queue), self.config.export_batch_size)
                    batch = [self.queue.popleft() for _ in range(n)]
                if not batch:
                    break
                try:
                    self._process(batch)
                except Exception as exc:  # the loop never dies
                    self.counts["failed"] += len(batch)
                    self.errors.report("annotating", exc, background=True)
                finally:
                    with self.lock:
                        self.in_flight -= len(batch)
                        self.idle.notify_all()

    def _process(self, batch: list[tuple[AnnotationRecord, dict[str, Any]]]) -> None:
        records = []
        for ann, raw in batch:
            ann.values = encode_values(raw)
            records.append(ann)
        for exporter in self.exporters:
            for attempt in range(_RETRIES):
                try:
                    found = exporter.annotate(records)
                    self.counts[f"{exporter.name}/applied"] += sum(found)
                    self.counts[f"{exporter.name}/skipped"] += len(found) - sum(found)
                    break
                except Exception as exc:
                    if attempt == _RETRIES - 1:
                        self.counts[f"{exporter.name}/failed"] += len(records)
                        log.warning("rollout-tracer: %s could not store %d annotations: %s: %s",
                                    exporter.name, len(records), type(exc).__name__, exc)
                    else:
                        time.sleep(0.2 * (attempt + 1))

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        self.wake.set()
        with self.lock:
            while self.in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.idle.wait(left)
        self.errors.check()
        return True

    def close(self, timeout_s: float) -> bool:
        ok = self.flush(timeout_s)
        self.closed = True
        self.wake.set()
        for exporter in self.exporters:
            exporter.shutdown(timeout_s)
        return ok

    def metrics(self) -> dict[str, int]:
        return {f"tracer/annotations/{k}": v for k, v in self.counts.items()}
