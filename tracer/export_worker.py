"""One export worker per backend: a thread that hands the oldest batch of its line
(``tracer.batch_queue``) to an export call, retries with backoff, and settles it. Used by
``tracer.pipeline``.

A backend that still fails after retries is marked down: its batches wait (on disk, or in
memory within the bound) and the oldest one probes it every ``replay_interval_s``, more often
while someone waits in ``flush``. When a probe works, everything waiting is exported in order
(orphans of dead processes included), each once: any batch that may have reached the backend
before is sent with ``replay=True`` so the backend checks before adding.

Shutdown has a deadline (``closing``). From then on no call begins that could not end by it
(``tracer.call_window``: a call, retry or probe as long as the longest attempt that failed in
this outage, or as the last call that worked; any call at all after it), the wait between
retries ends at ``stop()``,
and a batch is either stored (its spool file gone) or in the spool (not stored). The one case
left open is a call already running at the deadline: its batch stays in the spool marked in
doubt (``tracer.batch``); a backend that deduplicates by trace id adds nothing when it is
replayed, and for one that does not the shutdown line and ``tracer/<backend>/in_doubt`` say
how many may arrive twice.

Every call is written ahead: its batch file is marked in doubt before the call begins and
unmarked when its outcome is known (``tracer.spool``), so a process killed during a call
leaves the batch marked, and the replay that sends it again says so.

The loop cannot die: every iteration is guarded, and a batch being exported stays at the head
of the line until it is settled, so an unexpected error retries it rather than losing it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from tracer.backends.base import Exporter, ExportResult
from tracer.batch import Batch, LineRecords, Owner, call_group, joined_records, wait_to_share_s
from tracer.batch_queue import RESPOOL_INTERVAL_S
from tracer.call_window import CallWindow
from tracer.errors import InternalErrors
from tracer.outage import OutageLog
from tracer.record import TrajectoryRecord
from tracer.settle import SettlingQueue
from tracer.spool import BackendSpool, read_batch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tracer.config import TraceConfig

log = logging.getLogger("tracer")

ORPHAN_SCAN_INTERVAL_S = 30.0


class ExportWorker(SettlingQueue):
    """One backend's thread, calls and retries over its line of batches; see the module
    docstrings here and in ``tracer.batch_queue``."""

    def __init__(
        self,
        exporter: Exporter,
        config: TraceConfig,
        errors: InternalErrors,
        spool: BackendSpool | None,
    ) -> None:
        # a byte-oriented backend writes the spool's lines; keep them in memory only for one
        wants_lines = type(exporter).export_encoded is not Exporter.export_encoded
        super().__init__(exporter.name, config, spool, wants_lines)
        self.exporter = exporter
        self.outage = OutageLog(exporter.name, getattr(exporter, "destination", "") or "")
        # a backend whose stored lines outlive the process as a spool file would is written
        # at once by put(), on the caller's thread: one copy of each batch on disk, not two
        self.writes_ahead = self.wants_lines and bool(getattr(exporter, "writes_ahead", False))
        # its batches wait as lines only: records are read from them if the backend asks
        self.lines_suffice = self.wants_lines and bool(getattr(exporter, "lines_suffice", False))
        self.deduplicates = bool(getattr(exporter, "deduplicates", True))
        self._calling = threading.Lock()  # one exporter call at a time: the thread's or put()'s
        self.errors = errors
        self.window = CallWindow(config.replay_interval_s)  # when a call may begin (cond)
        self.retry_wait_since = 0.0  # monotonic start of the wait before a retry, or 0
        self.flushing = 0  # flush() calls under way (hurry)
        self.thread: threading.Thread | None = None
        self.stopping = False
        # a spool may hold batches of dead processes: look at once, then every 30 s
        self.next_orphan_scan = 0.0 if spool is not None else float("inf")

    # producer side (processing thread, or the rollout's thread on overflow) ----------------
    def start(self) -> None:
        """Start the export thread, once (the pipeline calls this again when its own thread
        failed to start); a start that raises leaves none, so the next call tries again."""
        if self.thread is not None and self.thread.is_alive():
            return
        thread = threading.Thread(target=self._run, name=f"rollout-tracer-{self.name}",
                                  daemon=True)  # fmt: skip
        thread.start()
        self.thread = thread

    def put(
        self,
        seq: int,
        records: Sequence[TrajectoryRecord],
        lines: list[bytes] | None,
        nbytes: int,
        born_ns: int = 0,
    ) -> None:
        """Take a batch: to the spool first (when it can), then in line for export; to a
        backend that ``writes_ahead``, at once when nothing waits before it (only a batch it
        refuses is spooled and queued). ``born_ns``: when its oldest trajectory finished (the
        durability lag's clock)."""
        if self.lines_suffice and lines:
            records = LineRecords(lines)
        if self.abandoned:
            self.put_late(seq, records, lines, nbytes, born_ns)
            return
        first_try = False
        if self.writes_ahead and lines:
            stored = self._write_ahead(records, lines)
            if stored is not None:
                if stored is ExportResult.REJECTED:
                    with self.cond:
                        self._drop(Batch(seq, None, None, len(records), nbytes, born_ns),
                                   "rejected_by_backend")  # fmt: skip
                return
            first_try = True
        self.spool_and_queue(seq, records, lines, nbytes, born_ns, first_try)

    def _write_ahead(self, records: Sequence[TrajectoryRecord],
                     lines: list[bytes]) -> ExportResult | None:  # fmt: skip
        """Export a batch on the caller's thread, once, when no batch waits before it and the
        backend is up; the result, or None when it was not stored (not tried, or it failed:
        the caller spools it and queues it for the thread's retries)."""
        if not self._calling.acquire(blocking=False):  # the thread is exporting: queue it
            return None
        try:
            with self.cond:
                if self.todo or self.window.down or not self._may_call(0.0):
                    return None
            result, _attempts, _stopped, _took = self._export(records, lines, 0, False)
            if result is ExportResult.FAILURE:
                return None
            if result is ExportResult.SUCCESS:
                with self.cond:
                    self.exported += len(records)
                    self.cond.notify_all()
            return result
        finally:
            self._calling.release()

    # the worker thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self._step():
                    return
            except Exception as exc:
                with self.cond:
                    self.loop_errors += 1
                    self.inflight_since = 0.0
                self.errors.report(f"export worker {self.name}", exc, background=True)
                time.sleep(0.05)  # never spin on a persistent error

    def _may_call(self, takes_s: float) -> bool:
        """Whether an export call that takes ``takes_s`` may begin now: not after stop(),
        and not when it could not end by shutdown's deadline (caller holds ``cond``)."""
        if self.stopping or self.abandoned:
            return False
        return self.window.fits(takes_s, time.monotonic())

    def _next_batch(self) -> Batch | bool:
        """Wait for a batch to export now (still the line's). False when stopped; True when
        something else is due first (an orphan scan, an offer to the spool)."""
        with self.cond:
            while True:
                if self.stopping:
                    return False
                now = time.monotonic()
                if any(b.path is None and b.lines is not None for b in self.todo) and (
                        self.spool is not None and now >= self.next_respool):  # fmt: skip
                    return True  # time to offer the spool the batches it refused
                if not self._may_call(0.0):
                    # shutdown's deadline passed: it says where each batch is; a call begun
                    # now would go on behind its back. Wait for stop().
                    self.cond.wait(RESPOOL_INTERVAL_S)
                    continue
                if self.todo and self.todo[0].waiting:
                    probe_at = self.window.next_call_at(now)  # a probe, while it is down
                    if now >= probe_at:
                        if (linger := self._linger(now)) <= 0:
                            break
                        self.cond.wait(linger)
                        continue
                    self.cond.wait(min(probe_at - now, self.config.replay_interval_s,
                                       RESPOOL_INTERVAL_S))  # fmt: skip
                else:
                    self.cond.wait(min(self.config.replay_interval_s, max(
                        0.01, self.next_orphan_scan - now)))  # fmt: skip
                    if not self.todo and time.monotonic() >= self.next_orphan_scan:
                        return True  # time for an orphan scan
            self.inflight_since = time.monotonic()
            return self.todo[0]

    def _step(self) -> bool:
        """One iteration: wait for work, export the oldest batch. False when stopped."""
        if self.spool is not None and time.monotonic() >= self.next_orphan_scan:
            self.next_orphan_scan = time.monotonic() + ORPHAN_SCAN_INTERVAL_S
            self._adopt_orphans()
        self.respool()
        batch = self._next_batch()
        if not isinstance(batch, Batch):
            return batch
        records = batch.records
        lines = batch.lines if self.wants_lines else None
        if records is None:
            try:
                records = read_batch(batch.path) if batch.path is not None else []
            except (OSError, ValueError) as exc:  # deleted, unreadable: the rest goes on
                log.error("rollout-tracer: spool file %s is gone (%s)", batch.path, exc)
                with self.cond:
                    self.inflight_since = 0.0
                    if batch.waiting:
                        batch.move(Owner.DONE)
                        self._settle(batch)
                        self._drop(batch, "spool_lost")
                return True
        with self.file_lock:
            with self.cond:
                if not batch.waiting or not self._may_call(self.window.call_s()):
                    # shutdown came (or its deadline is too near) while the batch was read:
                    # it stays where it is, untouched (no call was made)
                    self.inflight_since = 0.0
                    return not self.stopping
                group = [batch]
                if self.todo and self.todo[0] is batch:  # with the batches that share its call
                    group = call_group(self.todo, self.config.export_batch_size, lines is not None)
                for b in group:
                    b.move(Owner.CALL)  # the hand-over: from here only this call settles it
            for b in group:
                if b.path is not None and self.spool is not None:
                    self._mark(b, b.path)
        if len(group) > 1:  # each was in memory (call_group): one call for all of them
            records = joined_records([b.records for b in group])
            lines = [line for b in group for line in b.lines or ()] if lines is not None else None
        if lines is None:  # a backend that reads the records: decoded now, not while waiting
            for record in records:
                record.materialize()
        replay = batch.attempted or not batch.own
        retried = self.window.down or (replay and not batch.first_try)
        retries = 0 if retried else self.config.export_max_retries
        for b in group:
            b.attempted, b.first_try = True, False
        with self._calling:
            result, attempts, stopped, longest = self._export(records, lines, retries, replay)
        with self.file_lock:
            self._settle_call(group, result, attempts, stopped, replay, longest)
        return True

    def _linger(self, now: float) -> float:
        """How long the head of the line waits for more to share its call (caller holds
        ``cond``; ``tracer.batch.wait_to_share_s``): not while the backend is down, a flush
        waits or shutdown began."""
        w, interval = self.window, self.config.export_interval_s
        if interval <= 0 or w.down or self.flushing or w.close_at or self.stopping:
            return 0.0
        return wait_to_share_s(self.todo, self.config.export_batch_size, self.wants_lines,
                               interval, now)  # fmt: skip

    def _export(self, batch: Sequence[TrajectoryRecord], lines: list[bytes] | None,
                retries: int, replay: bool) -> tuple[ExportResult, int, bool, float]:  # fmt: skip
        """Up to ``1 + retries`` attempts; (the result, attempts made, whether shutdown cut
        the retries short, the longest attempt's seconds). The wait before a retry ends at
        stop(), and no retry begins that could not end by shutdown's deadline (as long as the
        longest attempt before it)."""
        delay = 0.25
        attempt = 0
        longest = 0.0
        while True:
            began = time.monotonic()
            try:
                if lines is not None:
                    result = self.exporter.export_encoded(batch, lines, replay=replay)
                else:
                    result = self.exporter.export(batch, replay=replay)
            except Exception as exc:
                result = ExportResult.FAILURE
                self.errors.counts[f"export {self.name}"] += 1
                self.outage.failed_attempt(exc)  # an outage: one line when down, no traceback
            attempt += 1
            longest = max(longest, time.monotonic() - began)
            if result is not ExportResult.FAILURE or attempt > retries:
                return result, attempt, False, longest
            replay = True  # it may have been stored in part
            took = longest
            with self.cond:
                self.retry_wait_since = time.monotonic()
                self.cond.wait_for(lambda t=took: not self._may_call(t), delay)  # type: ignore[misc]
                self.retry_wait_since = 0.0
                if not self._may_call(took):
                    return result, attempt, True, longest
                self.retries += 1
            delay = min(delay * 2, 5.0)

    # control ----------------------------------------------------------------------------
    def wait(self, seq: int, deadline: float) -> bool:
        """Wait until every own batch up to ``seq`` is settled, probing a down backend often
        until ``deadline``. True when none is left waiting."""
        with self.cond:
            self.window.flush_until = max(self.window.flush_until, deadline)
            self.cond.notify_all()
            while any(b.own and b.seq is not None and b.seq <= seq for b in self.todo):
                left = deadline - time.monotonic()
                if left <= 0 or self._dead():
                    return False
                self.cond.wait(min(left, 0.1))
            return True

    def hurry(self, by: int) -> None:
        """A flush began (1) or ended (-1): while one runs, no batch waits for others to share
        its call (every backend's at once, not only the one ``wait`` is waiting for)."""
        with self.cond:
            self.flushing += by
            self.cond.notify_all()

    def closing(self, deadline: float) -> None:
        """Shutdown began and must end by ``deadline`` (monotonic): from now on no call starts
        that could not end by then (a probe or a retry as long as the last failed call), and
        after it no export call starts at all."""
        with self.cond:
            self.window.close_at = deadline
            self.cond.notify_all()

    def _dead(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def request_stop(self) -> None:
        """Tell the thread to stop (a wait before a retry ends at once); ``stop`` waits."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def stop(self, until: float) -> bool:
        """Stop the thread and wait for it until ``until`` (monotonic; shutdown's deadline and
        its grace, shared by every backend); False when it is stuck in an export call past it
        (the exporter must then not be shut down: never two calls at once)."""
        self.request_stop()
        if self.thread is not None:
            self.thread.join(max(0.0, until - time.monotonic()))
            return not self.thread.is_alive()
        return True

    def metrics(self, prefix: str) -> dict[str, float]:
        with self.cond:
            inflight = time.monotonic() - self.inflight_since if self.inflight_since else 0.0
            m = self.counters(prefix)
            m[f"{prefix}down"] = int(self.window.down)
            m[f"{prefix}worker_alive"] = int(not self._dead())
            m[f"{prefix}export_inflight_s"] = round(inflight, 3)
            return m


def wait_all(workers: list[ExportWorker], seq: int, deadline: float) -> bool:
    """``wait`` on every worker, each one hurried (``hurry``) until the last wait ends."""
    for w in workers:
        w.hurry(1)
    try:
        return all([w.wait(seq, deadline) for w in workers])
    finally:
        for w in workers:
            w.hurry(-1)
