"""The end of shutdown, per backend: stop its export worker by the deadline, shut the exporter
down only when no call of it is running, and say in one line where each trajectory left is:
in the spool (not stored), lost (counted by reason), or in doubt (an export call still had it
at the deadline: it may be stored already and stays in the spool, marked so)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tracer.errors import InternalErrors, say_at_shutdown
from tracer.spool_folders import strip_credentials

if TYPE_CHECKING:
    from tracer.batch_queue import Left
    from tracer.export_worker import ExportWorker

log = logging.getLogger("tracer")


# After shutdown's deadline, every backend together: an idle worker thread gets this long to
# leave (a thread starved of the GIL), and a call aborted at the deadline (its export process
# killed) this much more to end. So shutdown(T) returns within T + STOP_GRACE_S +
# ABORT_GRACE_S whatever the number of backends (plus spool writes in progress, and exporters'
# own shutdown when they overrun the time they are given).
STOP_GRACE_S = 0.5
ABORT_GRACE_S = 1.0


def stop_workers(workers: list[ExportWorker], deadline: float, errors: InternalErrors) -> bool:
    """Stop every backend's worker and exporter by one shared end, and report what is left.
    True when nothing is left (everything they were given is stored or counted)."""
    for w in workers:  # all at once: the idle ones leave side by side
        w.request_stop()
    grace = deadline + STOP_GRACE_S
    ok = True
    for w in workers:
        ok = stop_worker(w, deadline, grace, errors) and ok
    return ok


def stop_worker(w: ExportWorker, deadline: float, grace: float, errors: InternalErrors) -> bool:
    """Stop one backend's worker and exporter (its thread waited for until ``grace``), and
    report what is left. True when nothing is left."""
    stopped = w.stop(grace)
    if not stopped and w.exporter.abort():  # e.g. a hung export process: killed
        stopped = w.stop(grace + ABORT_GRACE_S)  # its call ends; the batch is spooled
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
        end = grace + ABORT_GRACE_S
        try:
            w.exporter.force_flush(max(0.0, end - time.monotonic()))
            w.exporter.shutdown(max(0.0, end - time.monotonic()))
        except Exception as exc:
            errors.report(f"shutting down backend {w.name}", exc, background=True)
    left = w.abandon(until=grace + ABORT_GRACE_S)
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
