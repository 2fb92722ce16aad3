"""One export worker per backend: a bounded queue of batches, a thread, retries with backoff,
and the backend's spool (see ``tracer.spool``). Used by ``tracer.pipeline``."""

from __future__ import annotations

import collections
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tracer.backends.base import Exporter, ExportResult
from tracer.record import TrajectoryRecord
from tracer.spool import BackendSpool, read_batch

if TYPE_CHECKING:
    from tracer.config import TraceConfig

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
