"""One export worker per backend: its batches oldest first, a thread, retries with backoff, the
backend's spool (``tracer.spool``), and counters that reconcile. Used by ``tracer.pipeline``.

Every batch goes to the backend's spool file before it is queued, when the spool can take it
(a backend that ``writes_ahead``, JSONL, is written at once instead, on the thread that hands
the batch over, and only a batch it refuses goes to the spool); when the spool cannot (disk
full, read-only, over ``max_spool_bytes``), the batch is kept in memory and exported from
there, the failure is counted, and the spool is offered the batch again every
``RESPOOL_INTERVAL_S`` (and at shutdown) until it takes it: a disk full for a few seconds
leaves nothing only in memory for longer than that. A trajectory is lost only when neither
memory nor the spool can hold it, and then it is counted by reason.

A backend that still fails after retries is marked down: its batches wait (on disk, or in
memory within the bound) and the oldest one probes it every ``replay_interval_s``, more often
while someone waits in ``flush``. When a probe works, everything waiting is exported in order
(orphans of dead processes included), each once: any batch that may have reached the backend
before is sent with ``replay=True`` so the backend checks before adding.

The loop cannot die: every iteration is guarded, and a batch being exported stays at the head
of the line until it is settled, so an unexpected error retries it rather than losing it.
"""

from __future__ import annotations

import bisect
import collections
import errno
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tracer.backends.base import Exporter, ExportResult
from tracer.errors import InternalErrors, log_every, say_at_shutdown
from tracer.outage import OutageLog
from tracer.record import TrajectoryRecord
from tracer.spool import BackendSpool, SpoolError, batch_size, batch_sort_key, read_batch

if TYPE_CHECKING:
    from collections.abc import Sequence

    from tracer.config import TraceConfig

log = logging.getLogger("tracer")

ORPHAN_SCAN_INTERVAL_S = 30.0
RESPOOL_INTERVAL_S = 0.5  # how often batches the spool refused (disk full) are offered again
FLUSH_PROBE_INTERVAL_S = 0.25  # how often a down backend is probed while flush() waits

# Reasons a trajectory can be lost, as they appear in metrics (``tracer/<backend>/dropped/...``).
DROP_REASONS = (
    "buffer_full",  # the hot buffer was full and the spool could not take the overflow
    "spool_full",  # the backend was behind, memory full, and the spool over max_spool_bytes
    "spool_error",  # the same, but the spool's file system refused the write
    "spool_lost",  # a spool file vanished or became unreadable before it was exported
    "rejected_by_backend",  # the backend refused the batch for good (ExportResult.REJECTED)
    "after_shutdown",  # finished after shutdown()
    "unexported_at_exit",  # only in memory (no spool) when the tracer shut down, backend down
    "disk_full_at_shutdown",  # only in memory at shutdown, and the spool's disk still full
    "spool_error_at_shutdown",  # the same, the spool refusing for another reason (read-only...)
    "build_error",  # the record could not be built (an internal error, logged)
    "internal_error",  # a tracer bug in the pipeline itself (logged, and raised in our tests)
    "evicted_by_sampling",  # displaced by a sample with a lower hash (not a loss: by design)
    "not_kept",  # a tail candidate no keep rule kept, or with no room to wait (by design)
)


def _at_shutdown(exc: SpoolError) -> str:
    """The drop reason of a batch the spool refused with ``exc`` at shutdown."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return "disk_full_at_shutdown" if full else "spool_error_at_shutdown"


class _Batch:
    __slots__ = ("attempted", "born_ns", "first_try", "key", "lines", "n", "nbytes", "own", "path",
                 "records", "seq", "settling")  # fmt: skip

    def __init__(
        self,
        seq: int | None,
        records: list[TrajectoryRecord] | None,
        path: Path | None,
        n: int,
        nbytes: int,
        born_ns: int = 0,
    ) -> None:
        self.born_ns = born_ns or time.time_ns()  # when its oldest trajectory finished
        self.seq = seq  # lowest sequence number of its trajectories; None for an orphan
        self.own = seq is not None
        self.records = records  # None when it lives only in its spool file
        self.lines: list[bytes] | None = None  # the records' JSON lines, while in memory
        self.path = path
        self.n = n
        self.nbytes = nbytes
        self.attempted = False  # sent once already: may be (partly) stored, replay with care
        self.first_try = False  # refused once when handed over: still gets the usual retries
        self.settling = False  # stored: the spool must not take a new copy of it now
        self.key = batch_sort_key(path) if path is not None else (time.time_ns(), "")


class ExportWorker:
    """One backend's batches, thread, retries and spool; see the module docstring."""

    def __init__(
        self,
        exporter: Exporter,
        config: TraceConfig,
        errors: InternalErrors,
        spool: BackendSpool | None,
    ) -> None:
        self.exporter = exporter
        self.name = exporter.name
        self.outage = OutageLog(exporter.name, getattr(exporter, "destination", "") or "")
        # a byte-oriented backend writes the spool's lines; keep them in memory only for one
        self.wants_lines = type(exporter).export_encoded is not Exporter.export_encoded
        # a backend whose stored lines outlive the process as a spool file would is written
        # at once by put(), on the caller's thread: one copy of each batch on disk, not two
        self.writes_ahead = self.wants_lines and bool(getattr(exporter, "writes_ahead", False))
        self._calling = threading.Lock()  # one exporter call at a time: the thread's or put()'s
        self.config = config
        self.errors = errors
        self.spool = spool
        self.cond = threading.Condition()
        self.todo: list[_Batch] = []  # everything not exported yet, oldest first
        self.held = 0  # trajectories whose records are in memory
        self.held_bytes = 0
        self.down = False
        self.next_probe = 0.0
        self.flush_until = 0.0  # while a flush waits, probe a down backend more often
        self.close_at = 0.0  # shutdown's deadline once it began: no export call outlasts it
        self.next_respool = 0.0  # when memory-only batches are next offered to the spool
        self.refused_because = "spool_error_at_shutdown"  # the spool's last refusal, as a reason
        self.inflight_since = 0.0  # monotonic start of the export call in progress, or 0
        self.last_probe = 0.0
        self.failed_call_s = 0.0  # the longest failed probe of this outage
        self.thread: threading.Thread | None = None
        self.stopping = False
        self.abandoned = False  # shutdown reported what is left: a late batch goes to the spool
        # a spool may hold batches of dead processes: look at once, then every 30 s
        self.next_orphan_scan = 0.0 if spool is not None else float("inf")
        # counters
        self.exported = 0  # own trajectories stored
        self.replayed = 0  # trajectories stored by a replay (after a failure, or orphans)
        self.orphans_replayed = 0  # of those, from other (dead) processes' spool files
        self.retries = 0
        self.spool_errors = 0
        self.loop_errors = 0
        self.dropped: collections.Counter[str] = collections.Counter()

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
        records: list[TrajectoryRecord],
        lines: list[bytes] | None,
        nbytes: int,
        born_ns: int = 0,
    ) -> None:
        """Take a batch: to the spool first (when it can), then in line for export; to a
        backend that ``writes_ahead``, at once when nothing waits before it (only a batch it
        refuses is spooled and queued). ``born_ns``: when its oldest trajectory finished (the
        durability lag's clock)."""
        if self.abandoned:
            self._put_late(seq, records, lines, nbytes, born_ns)
            return
        first_try = False
        if self.writes_ahead and lines:
            stored = self._write_ahead(records, lines)
            if stored is not None:
                if stored is ExportResult.REJECTED:
                    with self.cond:
                        self._drop(_Batch(seq, None, None, len(records), nbytes, born_ns),
                                   "rejected_by_backend")  # fmt: skip
                return
            first_try = True
        path, reason = None, "spool_full"
        if self.spool is not None and lines:
            try:
                path = self.spool.write(lines)
            except SpoolError as exc:
                reason = "spool_error"
                with self.cond:
                    self.refused_because = _at_shutdown(exc)
                    self.spool_errors += 1
                    n = self.spool_errors
                if log_every(n):
                    log.warning(
                        "rollout-tracer: cannot write the %s spool (%s); exporting from memory "
                        "[%d spool errors]", self.name, exc, n)  # fmt: skip
        n = len(records)
        with self.cond:
            late = self.abandoned  # shutdown reported what was left while this was written
            if not late:
                batch = _Batch(seq, records, path, n, nbytes, born_ns)
                batch.attempted = batch.first_try = first_try  # it may be stored in part
                if not self._room(n, nbytes):
                    self._spill(n, nbytes)
                if self._room(n, nbytes):
                    self.held += n
                    self.held_bytes += nbytes
                    # a batch only memory holds keeps its lines: the spool is offered them again
                    batch.lines = lines if self.wants_lines or path is None else None
                elif path is not None:
                    batch.records = None  # memory stays bounded: the spool file has it
                else:
                    self._drop(batch, reason if self.spool is not None else "buffer_full")
                    return
                bisect.insort(self.todo, batch, key=lambda b: b.key)
                self.cond.notify_all()
        if late:
            self._put_late(seq, records, lines, nbytes, born_ns, path, tried=True)
            return
        if path is not None:
            self.respool()  # the disk takes batches again: the older memory-only ones too

    def _put_late(self, seq: int, records: list[TrajectoryRecord], lines: list[bytes] | None,
                  nbytes: int, born_ns: int, path: Path | None = None,
                  tried: bool = False) -> None:  # fmt: skip
        """A batch handed on after shutdown reported what was left (the processing thread was
        held past its deadline): to the spool, for a later replay, with a line that says so;
        counted lost when the spool cannot take it. Never exported from here. ``tried``: the
        spool was offered it already (``path``, None when it refused)."""
        if not tried and self.spool is not None and lines:
            try:
                path = self.spool.write(lines)
            except SpoolError:
                path = None
        with self.cond:
            batch = _Batch(seq, None, path, len(records), nbytes, born_ns)
            if path is None:
                self._drop(batch, "unexported_at_exit")
                return
            bisect.insort(self.todo, batch, key=lambda b: b.key)  # pending, on disk
        assert self.spool is not None
        say_at_shutdown(
            f"rollout-tracer: {batch.n} trajectories for {self.name} were processed after "
            f"shutdown; they are kept in {self.spool.dir}. Export them with: rollout-tracer "
            f"replay --spool-dir {self.spool.dir.parent}")  # fmt: skip

    def respool(self, *, final: bool = False) -> int:
        """Offer the spool the batches it refused earlier (disk full, read-only), oldest first,
        at most every ``RESPOOL_INTERVAL_S`` unless ``final``; stops at the first refusal.
        Returns how many trajectories are still only in memory (waiting, own or not)."""
        if self.spool is None:
            return 0
        with self.cond:
            now = time.monotonic()
            if not final and now < self.next_respool:
                return -1
            self.next_respool = now + RESPOOL_INTERVAL_S
            waiting = [(b, b.lines) for b in self.todo
                       if b.path is None and b.lines is not None and not b.settling]  # fmt: skip
        for b, lines in waiting:
            try:
                path = self.spool.write(lines)
            except SpoolError as exc:
                path = None
                self.refused_because = _at_shutdown(exc)
            else:
                if path is None:
                    self.refused_because = "spool_full"  # over max_spool_bytes
            if path is None:
                break  # still refused: the next offer is RESPOOL_INTERVAL_S away
            with self.cond:
                kept = not b.settling and b in self.todo
                if kept:
                    b.path = path  # its place in line (its key) stays
                    if not self.wants_lines:
                        b.lines = None
            if not kept:  # stored meanwhile: this copy must not be replayed
                self.spool.delete(path)
        with self.cond:
            return sum(b.n for b in self.todo if b.path is None)

    def _write_ahead(self, records: list[TrajectoryRecord],
                     lines: list[bytes]) -> ExportResult | None:  # fmt: skip
        """Export a batch on the caller's thread, once, when no batch waits before it and the
        backend is up; the result, or None when it was not stored (not tried, or it failed:
        the caller spools it and queues it for the thread's retries)."""
        if not self._calling.acquire(blocking=False):  # the thread is exporting: queue it
            return None
        try:
            with self.cond:
                if self.todo or self.down or self.stopping:
                    return None
            result = self._export(records, lines, 0, False)  # one try, counted as any
            if result is ExportResult.FAILURE:
                return None
            if result is ExportResult.SUCCESS:
                with self.cond:
                    self.exported += len(records)
                    self.cond.notify_all()
            return result
        finally:
            self._calling.release()

    def _room(self, n: int, nbytes: int) -> bool:
        return (
            self.held + n <= self.config.max_buffer_trajectories
            and self.held_bytes + nbytes <= self.config.max_buffer_bytes
        )

    def _spill(self, n: int, nbytes: int) -> None:
        """Make room by letting go of in-memory copies of batches that are on disk (newest
        first: the oldest are exported next)."""
        for b in reversed(self.todo):
            if self._room(n, nbytes):
                return
            if b.records is not None and b.path is not None and b is not self._head_inflight():
                b.records = b.lines = None
                self.held -= b.n
                self.held_bytes -= b.nbytes

    def _head_inflight(self) -> _Batch | None:
        return self.todo[0] if self.todo and self.inflight_since else None

    def _drop(self, batch: _Batch, reason: str) -> None:
        """Count a batch as lost (caller holds ``cond``)."""
        self.dropped[reason] += batch.n
        total = sum(self.dropped.values())
        log.error(
            "rollout-tracer: %d trajectories lost for %s (%s); %d lost so far",
            batch.n, self.name, reason, total)  # fmt: skip
        self.cond.notify_all()

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

    def _step(self) -> bool:
        """One iteration: wait for work, export the oldest batch. False when stopped."""
        if self.spool is not None and time.monotonic() >= self.next_orphan_scan:
            self.next_orphan_scan = time.monotonic() + ORPHAN_SCAN_INTERVAL_S
            self._adopt_orphans()
        self.respool()
        with self.cond:
            while True:
                if self.stopping:
                    return False
                now = time.monotonic()
                if any(b.path is None and b.lines is not None for b in self.todo) and (
                        self.spool is not None and now >= self.next_respool):  # fmt: skip
                    return True  # time to offer the spool the batches it refused
                if self.close_at and now >= self.close_at:
                    # shutdown's deadline passed: it says where each batch is; a call begun
                    # now would go on behind its back. Wait for stop().
                    self.cond.wait(RESPOOL_INTERVAL_S)
                    continue
                if self.todo:
                    if not self.down:
                        break
                    probe_at = self.next_probe
                    if self.flush_until > now:
                        probe_at = min(probe_at, self.last_probe + FLUSH_PROBE_INTERVAL_S)
                        if now + self.failed_call_s > self.flush_until:
                            # a probe now could outlast the flush; a shutdown may follow it
                            probe_at = max(probe_at, self.flush_until + 1.0)
                    if self.close_at and now + self.failed_call_s > self.close_at:
                        # shutdown began: a probe that cannot end by its deadline would be
                        # left running, exporting after shutdown() said the batches wait in
                        # the spool; also after the flush ended, until stop() comes
                        probe_at = float("inf")
                    if now >= probe_at:
                        break
                    self.cond.wait(min(probe_at - now, self.config.replay_interval_s,
                                       RESPOOL_INTERVAL_S))  # fmt: skip
                else:
                    self.cond.wait(min(self.config.replay_interval_s, max(
                        0.01, self.next_orphan_scan - now)))  # fmt: skip
                    if not self.todo and time.monotonic() >= self.next_orphan_scan:
                        return True  # time for an orphan scan
            batch = self.todo[0]
            self.inflight_since = time.monotonic()
        records = batch.records
        lines = batch.lines if self.wants_lines else None
        if records is None:
            try:
                records = read_batch(batch.path) if batch.path is not None else []
            except (OSError, ValueError) as exc:  # deleted, unreadable: the rest goes on
                log.error("rollout-tracer: spool file %s is gone (%s)", batch.path, exc)
                with self.cond:
                    self.inflight_since = 0.0
                    self._settle(batch)
                    self._drop(batch, "spool_lost")
                return True
        if lines is None:  # a backend that reads the records: decoded now, not while waiting
            for record in records:
                record.materialize()
        with self.cond:
            if self.stopping or (self.close_at and time.monotonic() >= self.close_at):
                # shutdown came (or its deadline passed) while the batch was read: it stays
                # where it is, untouched (no call was made)
                self.inflight_since = 0.0
                return not self.stopping
        replay = batch.attempted or not batch.own
        batch.attempted = True
        retried = self.down or (replay and not batch.first_try)
        retries = 0 if retried else self.config.export_max_retries
        batch.first_try = False
        with self._calling:
            result = self._export(records, lines, retries, replay)
        if result is not ExportResult.FAILURE:
            with self.cond:  # from now on respool() leaves it alone
                batch.settling = True
                path = batch.path
            if path is not None and self.spool:
                self.spool.delete(path)  # before flush() can see this batch as done
        with self.cond:
            self.last_probe = time.monotonic()
            took, self.inflight_since = self.last_probe - self.inflight_since, 0.0
            if result is ExportResult.FAILURE:
                if retries == 0:  # a probe (one attempt); the longest, not the last: OTel's
                    # call ends at once or after a backoff inside it, by its jitter's toss
                    self.failed_call_s = max(self.failed_call_s, took)
                if not self.down:
                    self.outage.went_down(retries + 1, self.spool.dir if self.spool else None)
                self.down = True
                self.next_probe = self.last_probe + self.config.replay_interval_s
                return True
            if self.down:
                self.outage.came_back(self.todo)
            self.down = False
            self.failed_call_s = 0.0
            self._settle(batch)
            if result is ExportResult.REJECTED:
                self._drop(batch, "rejected_by_backend")
                return True
            if batch.own:
                self.exported += batch.n
            else:
                self.orphans_replayed += batch.n
            if replay:
                self.replayed += batch.n
            self.cond.notify_all()
        return True

    def _settle(self, batch: _Batch) -> None:
        """Take a batch off the line (caller holds ``cond``)."""
        self.todo.remove(batch)
        self.outage.settled(batch, batch.n)
        if batch.records is not None:
            self.held -= batch.n
            self.held_bytes -= batch.nbytes
            batch.records = batch.lines = None

    def _adopt_orphans(self) -> None:
        assert self.spool is not None
        for orphan in self.spool.orphans():
            claimed = self.spool.claim(orphan)
            if claimed is None:
                continue
            n = batch_size(claimed)
            with self.cond:
                bisect.insort(self.todo, _Batch(None, None, claimed, n, 0), key=lambda b: b.key)
                self.cond.notify_all()

    def _export(self, batch: Sequence[TrajectoryRecord], lines: list[bytes] | None,
                retries: int, replay: bool) -> ExportResult:  # fmt: skip
        delay = 0.25
        for attempt in range(retries + 1):
            try:
                if lines is not None:
                    result = self.exporter.export_encoded(batch, lines, replay=replay)
                else:
                    result = self.exporter.export(batch, replay=replay)
            except Exception as exc:
                result = ExportResult.FAILURE
                self.errors.counts[f"export {self.name}"] += 1
                self.outage.failed_attempt(exc)  # an outage: one line when down, no traceback
            if result is not ExportResult.FAILURE:
                return result
            replay = True  # it may have been stored in part
            if attempt < retries and not self.stopping:
                self.retries += 1
                time.sleep(delay)
                delay = min(delay * 2, 5.0)
        return ExportResult.FAILURE


    # control ----------------------------------------------------------------------------
    def outstanding(self, seq: int) -> bool:
        """Whether a trajectory with sequence number <= seq is still waiting here."""
        with self.cond:
            return any(b.own and b.seq is not None and b.seq <= seq for b in self.todo)

    def wait(self, seq: int, deadline: float) -> bool:
        """Wait until every own batch up to ``seq`` is settled, probing a down backend often
        until ``deadline``. True when none is left waiting."""
        with self.cond:
            self.flush_until = max(self.flush_until, deadline)
            self.cond.notify_all()
            while any(b.own and b.seq is not None and b.seq <= seq for b in self.todo):
                left = deadline - time.monotonic()
                if left <= 0 or self._dead():
                    return False
                self.cond.wait(min(left, 0.1))
            return True

    def closing(self, deadline: float) -> None:
        """Shutdown began and must end by ``deadline`` (monotonic): from now on no probe of a
        down backend starts that could not end by then (the last failed probe's length), and
        after it no export call starts at all."""
        with self.cond:
            self.close_at = deadline
            self.cond.notify_all()

    def _dead(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def stop(self, deadline: float) -> bool:
        """Stop the thread; False when it is stuck in an export call past the deadline (the
        exporter must then not be shut down: never two calls at once)."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if self.thread is not None:
            # an idle thread leaves at once; a little grace even when flush used the budget
            self.thread.join(max(0.5, deadline - time.monotonic()))
            return not self.thread.is_alive()
        return True

    def abandon(self) -> tuple[int, int]:
        """At shutdown: what is left. Batches in the spool stay there for a later replay (the
        spool is released, so another process or ``rollout-tracer replay`` may take them); a
        batch only memory holds is offered to the spool one last time, and what it refuses is
        lost and counted by reason. Returns (on disk, lost)."""
        reason = "unexported_at_exit"  # no spool to take it
        if self.spool is not None and self.respool(final=True):
            reason = self.refused_because
        with self.cond:
            self.abandoned = True
            on_disk = lost = 0
            for b in list(self.todo):
                if b.path is not None and b.path.exists():
                    on_disk += b.n
                else:
                    lost += b.n
                    self._settle(b)
            if lost:  # one line for all of them
                self._drop(_Batch(None, None, None, lost, 0), reason)
        if self.spool is not None:
            self.spool.release()
        return on_disk, lost

    def oldest_in_memory_ns(self) -> int | None:
        """When the oldest of the own batches that only memory holds (no spool file, not
        stored yet) finished; None when every waiting batch is on disk."""
        with self.cond:
            born = [b.born_ns for b in self.todo if b.own and b.path is None]
            return min(born) if born else None

    def pending(self) -> int:
        """Own trajectories not yet stored (in memory or in the spool)."""
        with self.cond:
            return sum(b.n for b in self.todo if b.own)

    def metrics(self, prefix: str) -> dict[str, float]:
        with self.cond:
            inflight = time.monotonic() - self.inflight_since if self.inflight_since else 0.0
            waiting = [b for b in self.todo if b.attempted or not b.own]
            m: dict[str, float] = {
                f"{prefix}exported": self.exported,
                f"{prefix}pending": sum(b.n for b in self.todo if b.own),
                f"{prefix}replayed": self.replayed,
                f"{prefix}orphans_replayed": self.orphans_replayed,
                f"{prefix}spooled_batches": sum(1 for b in waiting if b.path is not None),
                f"{prefix}queue_depth": len(self.todo),
                f"{prefix}held_bytes": self.held_bytes,
                f"{prefix}retries": self.retries,
                f"{prefix}spool_errors": self.spool_errors,
                f"{prefix}loop_errors": self.loop_errors,
                f"{prefix}down": int(self.down),
                f"{prefix}worker_alive": int(not self._dead()),
                f"{prefix}export_inflight_s": round(inflight, 3),
                f"{prefix}failed": sum(self.dropped.values()),
            }
            for reason, count in self.dropped.items():
                m[f"{prefix}dropped/{reason}"] = count
            return m
