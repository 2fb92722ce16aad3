"""One backend's line of batches and its spool: what waits, where it waits, what is left at
shutdown, and the counters. The export thread and its calls are ``tracer.export_worker``.

Every batch goes to the backend's spool file before it is queued, when the spool can take it
(a backend that ``writes_ahead``, JSONL, is written at once instead, on the thread that hands
the batch over, and only a batch it refuses goes to the spool); when the spool cannot (disk
full, read-only, over ``max_spool_bytes``), the batch is kept in memory and exported from
there, the failure is counted, and the spool is offered the batch again every
``RESPOOL_INTERVAL_S`` (and at shutdown) until it takes it: a disk full for a few seconds
leaves nothing only in memory for longer than that. One offer runs at a time, so a batch is
never written twice. A trajectory is lost only when neither memory nor the spool can hold it,
and then it is counted by reason.

Who may act on a batch is its owner (``tracer.batch``): this line, an export call, or, after
shutdown, the spool. Shutdown (``abandon``) leaves what waits in the spool, counts what only
memory held as lost, and leaves a batch a call still holds to that call, marked in doubt.
"""

from __future__ import annotations

import bisect
import collections
import errno
import logging
import threading
import time
from typing import TYPE_CHECKING, NamedTuple

from tracer.batch import Batch, Owner
from tracer.errors import log_every, say_at_shutdown
from tracer.spool import BackendSpool, SpoolError, batch_size, is_in_doubt

if TYPE_CHECKING:
    from collections.abc import Sequence
    from pathlib import Path

    from tracer.config import TraceConfig
    from tracer.record import TrajectoryRecord

log = logging.getLogger("tracer")

RESPOOL_INTERVAL_S = 0.5  # how often batches the spool refused (disk full) are offered again
FINAL_OFFER_WAIT_S = 2.0  # how long shutdown's last offer waits for one in progress

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


class Left(NamedTuple):
    """What shutdown left of one backend's trajectories."""

    on_disk: int  # in the spool, not stored
    lost: int  # only in memory, and the spool refused them (counted by reason)
    in_doubt: int  # in an export call at the deadline: stored or not is unknown


class BatchQueue:
    """One backend's batches, oldest first, with its spool and counters (see the module
    docstring). ``cond`` guards everything here."""

    def __init__(self, name: str, config: TraceConfig, spool: BackendSpool | None,
                 wants_lines: bool) -> None:  # fmt: skip
        self.name = name
        self.config = config
        self.spool = spool
        self.wants_lines = wants_lines  # a byte-oriented backend: keep the lines in memory
        self.cond = threading.Condition()
        self._respooling = threading.Lock()  # one offer to the spool at a time
        # a batch file's in-doubt mark (its name) changes only under this lock, and only with
        # the batch's owner: a call begins (marked), ends (deleted or unmarked), an offer to
        # the spool writes a batch a call has (marked); shutdown releases the spool under it
        self.file_lock = threading.Lock()
        self.todo: list[Batch] = []  # everything not exported yet, oldest first
        self.held = 0  # trajectories whose records are in memory
        self.held_bytes = 0
        self.next_respool = 0.0  # when memory-only batches are next offered to the spool
        self.refused_because = "spool_error_at_shutdown"  # the spool's last refusal, as a reason
        self.abandoned = False  # shutdown reported what is left: a late batch goes to the spool
        self.inflight_since = 0.0  # monotonic start of the export call in progress, or 0
        # counters
        self.exported = 0  # own trajectories stored
        self.replayed = 0  # trajectories stored by a replay (after a failure, or orphans)
        self.orphans_replayed = 0  # of those, from other (dead) processes' spool files
        self.in_doubt = 0  # in an export call at shutdown's deadline (maybe stored, in spool)
        self.in_doubt_replayed = 0  # in-doubt batches replayed to a backend that may duplicate
        self.retries = 0
        self.spool_errors = 0
        self.unmarked_calls = 0  # calls whose batch file could not be marked in doubt first
        self.loop_errors = 0
        self.dropped: collections.Counter[str] = collections.Counter()

    # into the line ----------------------------------------------------------------------
    def spool_and_queue(self, seq: int, records: Sequence[TrajectoryRecord],
                        lines: list[bytes] | None, nbytes: int, born_ns: int,
                        first_try: bool) -> None:  # fmt: skip
        """Write a new batch to the spool (when it can), then queue it; ``first_try``: a
        backend that writes ahead refused it once (it may be stored in part)."""
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
                batch = Batch(seq, records, path, n, nbytes, born_ns)
                batch.attempted = batch.first_try = first_try
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
            self.put_late(seq, records, lines, nbytes, born_ns, path, tried=True)
            return
        if path is not None:
            self.respool()  # the disk takes batches again: the older memory-only ones too

    def put_late(self, seq: int, records: Sequence[TrajectoryRecord], lines: list[bytes] | None,
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
            batch = Batch(seq, None, path, len(records), nbytes, born_ns)
            if path is None:
                self._drop(batch, "unexported_at_exit")
                return
            batch.move(Owner.SPOOL)
            bisect.insort(self.todo, batch, key=lambda b: b.key)  # pending, on disk
        assert self.spool is not None
        say_at_shutdown(
            f"rollout-tracer: {batch.n} trajectories for {self.name} were processed after "
            f"shutdown; they are kept in {self.spool.dir}. Export them with: rollout-tracer "
            f"replay --spool-dir {self.spool.dir.parent}")  # fmt: skip

    def respool(self, *, final: bool = False, until: float | None = None) -> int:
        """Offer the spool the batches it refused earlier (disk full, read-only), oldest first,
        at most every ``RESPOOL_INTERVAL_S`` unless ``final``; stops at the first refusal.
        One offer at a time: a ``final`` one waits for one in progress (up to
        ``FINAL_OFFER_WAIT_S``, and not past ``until``: a hung disk must not hold shutdown), so
        no batch gets two spool files. Returns how many trajectories are still only in
        memory, or -1 when it is not time yet (or another offer is running)."""
        if self.spool is None:
            return 0
        wait = FINAL_OFFER_WAIT_S if final else -1
        if final and until is not None:
            wait = max(0.0, min(wait, until - time.monotonic()))
        if not self._respooling.acquire(blocking=final, timeout=wait):
            return -1
        try:
            return self._respool(final)
        finally:
            self._respooling.release()

    def _respool(self, final: bool) -> int:
        assert self.spool is not None
        with self.cond:
            now = time.monotonic()
            if not final and now < self.next_respool:
                return -1
            self.next_respool = now + RESPOOL_INTERVAL_S
            waiting = [(b, b.lines) for b in self.todo if b.path is None and b.lines is not None
                       and b.owner in (Owner.QUEUE, Owner.CALL)]  # fmt: skip
        for b, lines in waiting:
            with self.file_lock:  # its owner stays as it is while its file is written
                with self.cond:
                    if b.owner not in (Owner.QUEUE, Owner.CALL):
                        continue  # stored meanwhile: no copy to replay
                    in_call = b.owner is Owner.CALL  # it may be storing it now: in doubt
                try:
                    path = self.spool.write(lines, in_doubt=in_call)
                except SpoolError as exc:
                    path = None
                    self.refused_because = _at_shutdown(exc)
                else:
                    if path is None:
                        self.refused_because = "spool_full"  # over max_spool_bytes
                if path is None:
                    break  # still refused: the next offer is RESPOOL_INTERVAL_S away
                with self.cond:
                    kept = b.owner in (Owner.QUEUE, Owner.CALL)  # else counted at shutdown
                    if kept:
                        b.path = path  # its place in line (its key) stays
                        if not self.wants_lines:
                            b.lines = None
                if not kept:  # this copy must not be replayed
                    self.spool.delete(path)
        with self.cond:
            return sum(b.n for b in self.todo if b.path is None)

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
            if b.records is not None and b.path is not None and b.waiting and not (
                    self.inflight_since and b is self.todo[0]):  # fmt: skip
                b.records = b.lines = None
                self.held -= b.n
                self.held_bytes -= b.nbytes

    def _drop(self, batch: Batch, reason: str) -> None:
        """Count a batch as lost (caller holds ``cond``)."""
        self.dropped[reason] += batch.n
        total = sum(self.dropped.values())
        log.error(
            "rollout-tracer: %d trajectories lost for %s (%s); %d lost so far",
            batch.n, self.name, reason, total)  # fmt: skip
        self.cond.notify_all()

    def _settle(self, batch: Batch) -> None:
        """Take a batch its owner has let go of off the line (caller holds ``cond``)."""
        self.todo.remove(batch)
        if batch.records is not None:
            self.held -= batch.n
            self.held_bytes -= batch.nbytes
            batch.records = batch.lines = None

    # a batch's file: marked before a call, orphans of dead processes -------------------
    def _mark(self, batch: Batch, path: Path) -> None:
        """Write-ahead: the batch's file is marked in doubt before the call that could store
        it (caller holds ``file_lock``). Where the disk refuses, the call still goes ahead (the
        spool must not stop exports), and it is counted and logged."""
        assert self.spool is not None
        marked = self.spool.mark_in_doubt(path)
        with self.cond:
            if marked is not None:
                batch.path = marked
                return
            self.unmarked_calls += 1
            n = self.unmarked_calls
        if log_every(n):
            log.warning("rollout-tracer: cannot mark %s in doubt before exporting it to %s; a "
                        "crash during this call would replay it unmarked [%d so far]",
                        path, self.name, n)  # fmt: skip

    def _adopt_orphans(self) -> None:
        assert self.spool is not None
        for orphan in self.spool.orphans():
            claimed = self.spool.claim(orphan)
            if claimed is None:
                continue
            batch = Batch(None, None, claimed, batch_size(claimed), 0)
            batch.in_doubt = is_in_doubt(claimed)
            with self.cond:
                bisect.insort(self.todo, batch, key=lambda b: b.key)
                self.cond.notify_all()

    # shutdown ------------------------------------------------------------------------
    def abandon(self, until: float | None = None) -> Left:
        """At shutdown: what is left. Batches in the spool stay there for a later replay (the
        spool is released, so another process or ``rollout-tracer replay`` may take them); a
        batch only memory holds is offered to the spool one last time, and what it refuses is
        lost and counted by reason. A batch an export call still holds stays that call's: it
        is in doubt (its spool file was marked so before the call), and the call's end settles
        it. ``until``: when shutdown must be over (waits for an offer in progress end there)."""
        reason = "unexported_at_exit"  # no spool to take it
        if self.spool is not None and self.respool(final=True, until=until):
            reason = self.refused_because
        with self.cond:
            self.abandoned = True
            on_disk = lost = in_doubt = 0
            for b in list(self.todo):
                if b.owner is Owner.CALL:  # its file was marked before the call began
                    in_doubt += b.n
                elif b.owner is Owner.QUEUE and b.path is not None and b.path.exists():
                    b.move(Owner.SPOOL)
                    on_disk += b.n
                elif b.owner is Owner.QUEUE:
                    b.move(Owner.DONE)
                    lost += b.n
                    self._settle(b)
            self.in_doubt += in_doubt
            if lost:  # one line for all of them
                self._drop(Batch(None, None, None, lost, 0), reason)
        if self.spool is not None:
            with self.file_lock:  # a call that began before this has its batch marked
                self.spool.release()
        return Left(on_disk, lost, in_doubt)

    # what is waiting -----------------------------------------------------------------
    def outstanding(self, seq: int) -> bool:
        """Whether a trajectory with sequence number <= seq is still waiting here."""
        with self.cond:
            return any(b.own and b.seq is not None and b.seq <= seq for b in self.todo)

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

    def counters(self, prefix: str) -> dict[str, float]:
        """The line's counters (caller holds ``cond``)."""
        waiting = [b for b in self.todo if b.attempted or not b.own]
        m: dict[str, float] = {
            f"{prefix}exported": self.exported,
            f"{prefix}pending": sum(b.n for b in self.todo if b.own),
            f"{prefix}replayed": self.replayed,
            f"{prefix}orphans_replayed": self.orphans_replayed,
            f"{prefix}in_doubt": self.in_doubt,
            f"{prefix}in_doubt_replayed": self.in_doubt_replayed,
            f"{prefix}spooled_batches": sum(1 for b in waiting if b.path is not None),
            f"{prefix}queue_depth": len(self.todo),
            f"{prefix}held_bytes": self.held_bytes,
            f"{prefix}retries": self.retries,
            f"{prefix}spool_errors": self.spool_errors,
            f"{prefix}loop_errors": self.loop_errors,
            f"{prefix}failed": sum(self.dropped.values()),
        }
        for reason, count in self.dropped.items():
            m[f"{prefix}dropped/{reason}"] = count
        return m
