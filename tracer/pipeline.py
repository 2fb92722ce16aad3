"""Background pipeline: hot-path buffer -> processing thread -> one export worker per backend.

    submit() ──> bounded deque ──> [processor thread: sampling check, token2text, truncation,
                                    serialization into TrajectoryRecord]
                                        ├──> [export worker "mlflow"] -> MlflowExporter.export
                                        └──> [export worker "jsonl"]  -> JsonlExporter.export

``submit`` never blocks: when the buffer is full (count or bytes) the trajectory is dropped
and counted. Each backend has its own thread and bounded queue, so a slow or failing backend
never delays another. Threads start lazily and restart in a forked child.
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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tracer.backends.base import Exporter, ExportResult
from tracer.process import build_record
from tracer.record import TrajectoryRecord
from tracer.redact import Redactor
from tracer.spool import BackendSpool, default_spool_dir, read_batch

if TYPE_CHECKING:
    from tracer.config import TraceConfig
    from tracer.ops import Trajectory
    from tracer.sampling import Sampler

log = logging.getLogger("tracer")


class InternalErrors:
    """Logs each distinct tracer-internal failure once (then every 100th), or raises in tests."""

    def __init__(self, raise_errors: bool) -> None:
        self.raise_errors = raise_errors
        self.counts: collections.Counter[str] = collections.Counter()

    def report(self, where: str, exc: BaseException) -> None:
        key = f"{where}: {type(exc).__name__}"
        self.counts[key] += 1
        n = self.counts[key]
        if n == 1 or n % 100 == 0:
            log.warning(
                "rollout-tracer: %s failed (%s: %s); the rollout keeps running [%d times]",
                where,
                type(exc).__name__,
                exc,
                n,
                exc_info=n == 1,
            )
        if self.raise_errors:
            raise exc


class _Batch:
    __slots__ = ("n", "path", "records", "seq")

    def __init__(
        self, seq: int, records: list[TrajectoryRecord] | None, path: Path | None, n: int
    ) -> None:
        self.seq = seq
        self.records = records  # None once spilled: the batch lives only in its spool file
        self.path = path
        self.n = n


class ExportWorker:
    """One backend: a bounded queue of batches, a thread, retries with backoff, and a spool.

    Every batch is in the backend's spool file before it is queued. When the backend fails
    (after retries) it is marked down: batches then stay in the spool without further tries
    until a probe every ``replay_interval_s`` succeeds, and then all of them are replayed in
    order. Orphaned spool files of dead processes are replayed too.
    """

    def __init__(
        self,
        exporter: Exporter,
        config: TraceConfig,
        errors: InternalErrors,
        spool: BackendSpool | None,
    ) -> None:
        self.exporter = exporter
        self.name = getattr(exporter, "name", type(exporter).__name__)
        self.config = config
        self.errors = errors
        self.spool = spool
        self.queue: collections.deque[_Batch] = collections.deque()
        self.pending: collections.deque[Path] = collections.deque()  # spooled, not exported
        self.cond = threading.Condition()
        self.held = 0  # records held in memory by the queue
        self.done_seq = 0  # every batch with seq <= done_seq is exported or spooled
        self.down = False
        self.replay_round = 0  # incremented after each replay attempt (flush waits on it)
        self.replay_requested = False
        self.exported = 0
        self.replayed = 0
        self.failed = 0  # lost: could not be exported nor spooled
        self.dropped = 0
        self.retries = 0
        self.thread: threading.Thread | None = None
        self.stopping = False
        self._last_orphan_scan = 0.0

    def start(self) -> None:
        self.thread = threading.Thread(
            target=self._run, name=f"rollout-tracer-{self.name}", daemon=True
        )
        self.thread.start()

    @property
    def spooled(self) -> int:
        return len(self.pending)

    def put(self, seq: int, records: list[TrajectoryRecord], lines: list[str] | None) -> None:
        path = self.spool.write(lines) if self.spool is not None and lines else None
        if self.spool is not None and path is None:
            log.warning(
                "rollout-tracer: spool of %s is full (%d bytes); batch kept in memory only",
                self.name,
                self.spool.max_bytes,
            )
        with self.cond:
            keep: list[TrajectoryRecord] | None = records
            if self.held + len(records) > self.config.max_buffer_trajectories:
                if path is None:
                    self.dropped += len(records)
                    log.warning(
                        "rollout-tracer: backend %s is behind and its spool is full or "
                        "off; dropped %d trajectories (%d so far)",
                        self.name,
                        len(records),
                        self.dropped,
                    )
                    if not self.queue:
                        self.done_seq = max(self.done_seq, seq)
                    self.cond.notify_all()
                    return
                keep = None  # spill: memory stays bounded, the spool file has it
            else:
                self.held += len(records)
            self.queue.append(_Batch(seq, keep, path, len(records)))
            self.cond.notify_all()

    def mark(self, seq: int) -> None:
        """A processing round with nothing for this backend still advances its progress."""
        with self.cond:
            if not self.queue:
                self.done_seq = max(self.done_seq, seq)
                self.cond.notify_all()

    def _run(self) -> None:
        interval = self.config.replay_interval_s
        while True:
            with self.cond:
                while not self.queue and not self.stopping and not self.replay_requested:
                    if not self.cond.wait(interval):
                        break  # periodic: probe a down backend, look for orphans
                if self.stopping and not self.queue:
                    return
                batch = self.queue.popleft() if self.queue else None
            if batch is not None:
                self._handle(batch)
            else:
                self._replay()

    def _handle(self, batch: _Batch) -> None:
        ok = False
        if not self.down:
            records = batch.records
            if records is None and batch.path is not None:
                records = read_batch(batch.path)
            ok = self._export(records or [], retries=self.config.export_max_retries)
        if ok and batch.path is not None and self.spool is not None:
            self.spool.delete(batch.path)  # before flush() can see this batch as done
        with self.cond:
            if batch.records is not None:
                self.held -= batch.n
            if ok:
                self.exported += batch.n
            elif batch.path is not None:
                self.pending.append(batch.path)
            else:
                self.failed += batch.n
                log.error(
                    "rollout-tracer: lost %d trajectories for %s (no spool)", batch.n, self.name
                )
            if not self.queue or self.queue[0].seq > batch.seq:
                self.done_seq = max(self.done_seq, batch.seq)
            self.cond.notify_all()
        if ok and self.pending:
            self._replay()  # it worked again: replay what waited in the spool

    def _replay(self) -> None:
        """Probe with the oldest spooled batch; while that works, replay the rest in order."""
        if self.spool is not None and time.monotonic() - self._last_orphan_scan > 30:
            self._last_orphan_scan = time.monotonic()
            for orphan in self.spool.orphans():
                claimed = self.spool.claim(orphan)
                if claimed is not None:
                    with self.cond:
                        self.pending.append(claimed)
        while self.pending and not self.stopping:
            path = self.pending[0]
            records = read_batch(path) if path.exists() else []
            if records and not self._export(records, retries=0, replay=True):
                with self.cond:
                    self.down = True
                break
            if self.spool is not None:
                self.spool.delete(path)
            with self.cond:
                self.pending.popleft()
                self.replayed += len(records)
                self.down = False
        with self.cond:
            if not self.pending:
                self.down = False
            self.replay_requested = False
            self.replay_round += 1
            self.cond.notify_all()

    def _export(self, batch: list[TrajectoryRecord], retries: int, replay: bool = False) -> bool:
        delay = 0.25
        for attempt in range(retries + 1):
            try:
                if replay and hasattr(self.exporter, "replaying"):
                    # exporters that skip idempotency lookups on first export need to know
                    self.exporter.replaying = True
                    try:
                        result = self.exporter.export(batch)
                    finally:
                        self.exporter.replaying = False
                else:
                    result = self.exporter.export(batch)
            except Exception as exc:
                result = ExportResult.FAILURE
                key = f"export {self.name}"
                self.errors.counts[key] += 1
                if self.errors.counts[key] in (1, 10, 100, 1000):
                    log.warning(
                        "rollout-tracer: export to %s raised %s: %s",
                        self.name,
                        type(exc).__name__,
                        exc,
                        exc_info=self.errors.counts[key] == 1,
                    )
            if result is ExportResult.SUCCESS:
                return True
            if attempt < retries and not self.stopping:
                self.retries += 1
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        if not self.down:
            log.error(
                "rollout-tracer: backend %s failed %d times in a row; its batches wait "
                "in the spool (%s) and are replayed when it is back",
                self.name,
                retries + 1,
                self.spool.dir if self.spool is not None else "none",
            )
        self.down = True
        return False

    def wait(self, seq: int, deadline: float) -> bool:
        """Wait until batches up to ``seq`` are handled, then give spooled ones one more try."""
        with self.cond:
            while self.done_seq < seq:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            if not self.pending:
                return True
            round_ = self.replay_round
            self.replay_requested = True
            self.cond.notify_all()
            while self.replay_round == round_:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
            return not self.pending

    def stop(self, deadline: float) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            self.thread.join(max(0.0, deadline - time.monotonic()))


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
        self.pid = os.getpid()

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
                self.processed_seq = seq
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
