"""The end of shutdown, per backend: stop its export worker by the deadline, shut the exporter
down only when no call of it is running, and say in one line where each trajectory left is:
in the spool (not stored), lost (counted by reason), or in doubt (an export call still had it
at the deadline: it may be stored already and stays in the spool, marked so)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tracer.errors import InternalErrors, say_at_shutdown
from tracer.spool import strip_credentials

if TYPE_CHECKING:
    from tracer.batch_queue import Left
    from tracer.export_worker import ExportWorker

log = logging.getLogger("tracer")


def stop_worker(w: ExportWorker, deadline: float, errors: InternalErrors) -> bool:
    """Stop one backend's worker and exporter, and report what is left. True when nothing is
    left (everything it was given is stored or counted)."""
    stopped = w.stop(deadline)
    if not stopped and w.exporter.abort():  # e.g. a hung export process: killed
        stopped = w.stop(time.monotonic() + 2.0)  # its call ends; the batch is spooled
    if not stopped:
        # the wait before a retry ends at stop(): a thread still here is in a call (or, on a
        # thread starved of the GIL, not yet out of that wait: said as it is)
        waiting = w.retry_wait_since
        since = waiting or w.inflight_since
        what = "is waiting to retry" if waiting else "is stuck in an export call"
        log.error(
            "rollout-tracer: backend %s %s (%.0f s); not shutting it down (never two calls "
            "at once)", w.name, what, time.monotonic() - since if since else 0.0)  # fmt: skip
    else:
        try:
            w.exporter.force_flush(max(0.1, deadline - time.monotonic()))
            w.exporter.shutdown(max(0.1, deadline - time.monotonic()))
        except Exception as exc:
            errors.report(f"shutting down backend {w.name}", exc, background=True)
    left = w.abandon()
    if any(left):
        report_left(w, left)
        return False
    return True


def report_left(w: ExportWorker, left: Left) -> None:
    """One line: where the trajectories shutdown left for ``w`` are, and how to export them."""
    where = strip_credentials(str(w.exporter.spool_key))
    parts = []
    replay = ""
    if w.spool is not None:
        replay = f"rollout-tracer replay --spool-dir {w.spool.dir.parent}"
    if left.on_disk and w.spool is not None:
        parts.append(
            f"{left.on_disk} trajectories for {w.name} ({where}) were not exported before "
            f"shutdown; they are kept in {w.spool.dir}. Export them with: {replay}"
        )
    if left.in_doubt:
        then = (f"what {w.spool.dir} holds of them stays there, marked in doubt"
                if w.spool is not None else "they are lost if it fails")  # fmt: skip
        twice = ("" if w.deduplicates else
                 f"; {w.name} does not deduplicate by trace id, so a replay may store them "
                 f"twice (tracer/{w.name}/in_doubt)")  # fmt: skip
        parts.append(f"{left.in_doubt} trajectories for {w.name} were in an export call still "
                     f"running at shutdown's deadline (in doubt: it may have stored them); "
                     f"{then}{twice}")  # fmt: skip
    if left.lost:
        parts.append(f"{left.lost} trajectories for {w.name} were only in memory and are lost")
    say_at_shutdown("rollout-tracer: " + "; ".join(parts))
