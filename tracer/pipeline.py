"""Background pipeline: hot-path buffer -> processing thread -> one export worker per backend.

    submit() ──> bounded deque ──> [processor thread: sampling check, token2text, truncation,
                                    redaction, TrajectoryRecord, JSON line per record]
                                        ├──> spool file ──> [export worker "mlflow"]
                                        └──> spool file ──> [export worker "jsonl"]

``submit`` never blocks: when the buffer is full (count or bytes) the trajectory is dropped
and counted. Each backend has its own thread and bounded queue, so a slow or failing backend
never delays another (tracer/export_worker.py). Threads start lazily and restart in a forked
child.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tracer.backends.base import Exporter
from tracer.export_worker import ExportWorker, InternalErrors
from tracer.process import build_record
from tracer.record import TrajectoryRecord
from tracer.redact import Redactor
from tracer.spool import BackendSpool, default_spool_dir

if TYPE_CHECKING:
    from tracer.config import TraceConfig
    from tracer.ops import Trajectory
    from tracer.sampling import Sampler

log = logging.getLogger("tracer")


class Pipeline:
    def __init__(
        self,
        config: TraceConfig,
        sampler: Sampler,
        exporter_factories: list[Callable[[], Exporter]],
        tokenizer: Callable[[], Any],
    ) -> None:
        self.config = config
        self.sampler = sampler
        self.factories = exporter_factories
        self.tokenizer = tokenizer
        self.errors = InternalErrors(config.raise_internal_errors)
        self.redactor = (
            Redactor(config.redact_patterns, config.redact_callback) if config.redact else None
        )
        self._init_state()
        self.workers = [self._worker(f()) for f in exporter_factories]
        self._forked = False
        ref = weakref.WeakMethod(self._after_fork)
        os.register_at_fork(after_in_child=lambda: (m := ref()) and m())

    def _worker(self, exporter: Exporter) -> ExportWorker:
        spool = None
        if self.config.spool and getattr(exporter, "spoolable", True):
            name = getattr(exporter, "name", type(exporter).__name__)
            spool = BackendSpool(
                self.config.spool_dir or default_spool_dir(),
                name,
                str(getattr(exporter, "destination", name)),
                self.config,
                self.config.max_spool_bytes,
            )
        return ExportWorker(exporter, self.config, self.errors, spool)

    def _init_state(self) -> None:
        self.buffer: collections.deque[Trajectory] = collections.deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.progress = threading.Condition()
        self.buffered_bytes = 0
        self.submitted = 0  # sequence number of the last accepted trajectory
        self.processed_seq = 0
        self.dropped_buffer_full = 0
        self.process_errors = 0
        self.hot_ns = 0  # the rollout's time inside tracer code, over processed trajectories
        self.hot_trajectories = 0
        self.processor: threading.Thread | None = None
        self.closed = False

    def _after_fork(self) -> None:
        # The parent exports what was buffered before the fork; the child starts empty, with
        # fresh locks, fresh exporters (connections must not be shared) and no threads yet.
        self._init_state()
        self.workers = []
        self._forked = True

    # hot path -------------------------------------------------------------------------
    def submit(self, traj: Trajectory) -> None:
        with self.lock:
            if self.closed:
                self.dropped_buffer_full += 1
                return
            if (
                len(self.buffer) >= self.config.max_buffer_trajectories
                or self.buffered_bytes + traj.nbytes > self.config.max_buffer_bytes
            ):
                self.dropped_buffer_full += 1
                if self.dropped_buffer_full in (1, 10, 100) or self.dropped_buffer_full % 1000 == 0:
                    log.warning(
                        "rollout-tracer: trace buffer full (%d trajectories, %d bytes); "
                        "%d trajectories dropped",
                        len(self.buffer),
                        self.buffered_bytes,
                        self.dropped_buffer_full,
                    )
                return
            self.buffer.append(traj)
            self.buffered_bytes += traj.nbytes
            self.submitted += 1
            if self.processor is None:
                self._start()
            if len(self.buffer) >= self.config.export_batch_size:
                self.wake.set()

    # background -----------------------------------------------------------------------
    def _start(self) -> None:
        if self._forked and not self.workers:
            self.workers = [self._worker(f()) for f in self.factories]
        for w in self.workers:
            w.start()
        self.processor = threading.Thread(
            target=self._process_loop, name="rollout-tracer", daemon=True
        )
        self.processor.start()

    def _process_loop(self) -> None:
        while True:
            self.wake.wait(self.config.flush_interval_s)
            self.wake.clear()
            self._drain()
            if self.closed and not self.buffer:
                return

    def _drain(self) -> None:
        while True:
            with self.lock:
                if not self.buffer:
                    return
                batch: list[Trajectory] = []
                while self.buffer and len(batch) < self.config.export_batch_size:
                    traj = self.buffer.popleft()
                    self.buffered_bytes -= traj.nbytes
                    self.hot_ns += traj.hot_ns
                    self.hot_trajectories += 1
                    batch.append(traj)
                seq = self.submitted - len(self.buffer)
            records: list[TrajectoryRecord] = []
            tokenizer = self.tokenizer()
            for traj in batch:
                if not self.sampler.confirm(traj.step, traj.sample_index, traj.validate):
                    continue  # displaced by a sample with a lower hash before it was exported
                try:
                    record = build_record(traj, self.config, tokenizer)
                    if self.redactor is not None:
                        record = self.redactor.record(record)
                    records.append(record)
                except Exception as exc:
                    self.process_errors += 1
                    self.errors.report("building a trace record", exc)
            lines = None
            if records and any(w.spool is not None for w in self.workers):
                lines = [json.dumps(r.to_dict(), ensure_ascii=False, default=str) for r in records]
            for w in self.workers:
                if records:
                    w.put(seq, records, lines)
                else:
                    w.mark(seq)
            with self.progress:
                self.processed_seq = max(self.processed_seq, seq)
                self.progress.notify_all()

    # control --------------------------------------------------------------------------
    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything submitted so far is exported (or given up on)."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            target = self.submitted
            if self.processor is None:
                return True
        self.wake.set()
        with self.progress:
            while self.processed_seq < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.progress.wait(min(left, 0.05))
                self.wake.set()
        return all(w.wait(target, deadline) for w in self.workers)

    def shutdown(self, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        ok = self.flush(timeout_s)
        with self.lock:
            self.closed = True
        self.wake.set()
        if self.processor is not None:
            self.processor.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            w.stop(deadline)
            try:
                w.exporter.force_flush(max(0.1, deadline - time.monotonic()))
                w.exporter.shutdown(max(0.1, deadline - time.monotonic()))
            except Exception as exc:
                self.errors.report(f"shutting down backend {w.name}", exc)
        return ok

    def metrics(self) -> dict[str, Any]:
        m: dict[str, Any] = {
            "tracer/submitted": self.submitted,
            "tracer/queue_depth": len(self.buffer),
            "tracer/queue_bytes": self.buffered_bytes,
            "tracer/dropped_buffer_full": self.dropped_buffer_full,
            "tracer/evicted_by_sampling": self.sampler.evicted,
            "tracer/process_errors": self.process_errors,
            "tracer/hot_path_ms": self.hot_ns / 1e6,
            "tracer/hot_path_us_per_trajectory": (
                self.hot_ns / 1e3 / self.hot_trajectories if self.hot_trajectories else 0.0),
        }
        for w in self.workers:
            m[f"tracer/{w.name}/exported"] = w.exported
            m[f"tracer/{w.name}/spooled_batches"] = w.spooled
            m[f"tracer/{w.name}/replayed"] = w.replayed
            m[f"tracer/{w.name}/failed"] = w.failed
            m[f"tracer/{w.name}/dropped"] = w.dropped
            m[f"tracer/{w.name}/retries"] = w.retries
            m[f"tracer/{w.name}/queue_depth"] = len(w.queue)
        return m
