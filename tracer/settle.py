"""How an export call's end settles the batches it took (``tracer.export_worker``): each one
stored (its spool file deleted), refused for good, or back in line, its spool file unmarked
(``tracer.spool``), or left to the spool when shutdown is over. A call takes one batch, or
several that share it (``tracer.batch.call_group``): each is settled as if it had been alone,
and the backend's state (down, back) changes once, by the first.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tracer.backends.base import ExportResult
from tracer.batch import Batch, Owner
from tracer.batch_queue import BatchQueue

if TYPE_CHECKING:
    from pathlib import Path

    from tracer.call_window import CallWindow
    from tracer.outage import OutageLog


class SettlingQueue(BatchQueue):
    """A line of batches whose calls end here; ``tracer.export_worker.ExportWorker`` makes
    the calls."""

    window: CallWindow
    outage: OutageLog
    deduplicates: bool

    def _may_call(self, takes_s: float) -> bool:
        raise NotImplementedError

    def _settle_call(self, group: list[Batch], result: ExportResult, attempts: int,
                     cut_short: bool, replay: bool, longest: float) -> None:  # fmt: skip
        """The call's end (caller holds ``file_lock``): each batch of the call is stored (its
        spool file goes), refused for good, or back in line, unmarked (in the spool only, when
        shutdown left it to this call). A batch an earlier call of unknown outcome had stays
        marked. The backend's state (down, back) changes once, by the first batch."""
        paths = []
        for batch in group:
            with self.cond:
                path = batch.path
            if path is not None and self.spool is not None:
                if result is not ExportResult.FAILURE:
                    self.spool.delete(path)  # before flush() can see this batch as done
                elif not batch.in_doubt:
                    path = self.spool.unmark(path)
            paths.append(path)
        with self.cond:
            self.window.last_probe = time.monotonic()
            self.inflight_since = 0.0
            for i, (batch, path) in enumerate(zip(group, paths, strict=True)):
                self._settle_batch(batch, path, result, attempts, cut_short, replay, longest,
                                   first=i == 0)  # fmt: skip
            self.cond.notify_all()

    def _settle_batch(self, batch: Batch, path: Path | None, result: ExportResult,
                      attempts: int, cut_short: bool, replay: bool, longest: float,
                      first: bool) -> None:  # fmt: skip
        """One batch of the call that ended (caller holds ``cond``); ``first``: the one that
        tells the backend's state and logs its changes."""
        if result is ExportResult.FAILURE:
            batch.path = path
            if self.abandoned:  # shutdown is over: the spool keeps it, or it is lost
                batch.move(Owner.SPOOL if batch.path is not None else Owner.DONE)
                if batch.path is None:
                    self._settle(batch)
                    self._drop(batch, "unexported_at_exit")
                return
            batch.move(Owner.QUEUE)
            if not first:
                return
            if cut_short or not self._may_call(0.0):
                # shutdown ended the retries (or aborted the call), not the backend
                self.outage.stopped_at_shutdown(attempts)
            elif self.window.failed(longest, self.window.last_probe):
                self.outage.went_down(attempts, self.spool.dir if self.spool else None)
            return
        batch.move(Owner.DONE)
        if first and self.window.worked(longest):
            self.outage.came_back(self.todo)
        self._settle(batch)
        if result is ExportResult.REJECTED:
            self._drop(batch, "rejected_by_backend")
            return
        if batch.own:
            self.exported += batch.n
        else:
            self.orphans_replayed += batch.n
        if replay:
            self.replayed += batch.n
        if batch.in_doubt and not batch.own and not self.deduplicates:
            self.in_doubt_replayed += batch.n  # an earlier run may have stored them
            self.outage.replayed_in_doubt(batch.n)

    def _settle(self, batch: Batch) -> None:
        super()._settle(batch)
        self.outage.settled(batch, batch.n)
