"""What a backend outage says in the rollout's log: one warning line when a backend goes down
(which backend, where it writes, that its trajectories wait in the spool and where), one when it
is back and what waited has been sent. An outage is expected, so its tracebacks are logged at
debug level only; an unexpected exception keeps its traceback (the first time, then counted)."""

from __future__ import annotations

import errno
import logging
import re
from typing import Any

from tracer.errors import log_every
from tracer.spool_folders import strip_credentials

log = logging.getLogger("tracer")

# class names and messages of "cannot reach it now" along an exception's chain (requests,
# urllib3, http.client, MLflow's REST client wrapping them in an MlflowException)
_OUTAGE_NAMES = re.compile(r"Connection|Timeout|MaxRetry|RemoteDisconnected|ProtocolError|"
                           r"Unavailable")  # fmt: skip
_OUTAGE_TEXT = re.compile(r"Max retries exceeded|Connection (refused|aborted|reset)|"
                          r"RemoteDisconnected|timed out|Name or service not known|"
                          r"Temporary failure in name resolution|error code 50[234]|"
                          r"status code 50[234]|database is locked|"
                          # PostgreSQL restarting or gone (psycopg2's text, wrapped by MLflow
                          # in an MlflowException in the parent's bulk writer)
                          r"the database system is (shutting down|starting up|in recovery)|"
                          r"server closed the connection unexpectedly|"
                          r"could not connect to server|connection to server at", re.I)  # fmt: skip


def is_outage(exc: BaseException) -> bool:
    """True when ``exc`` says the backend cannot be reached (or is busy) now."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain is short; a cycle must not hang us
        if seen is None:
            break
        if isinstance(seen, (ConnectionError, TimeoutError)):
            return True
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True  # a file backend's disk is full: it takes data again once freed
        if _OUTAGE_NAMES.search(type(seen).__name__) or _OUTAGE_TEXT.search(str(seen)):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _short(exc: BaseException | None) -> str:
    if exc is None:
        return "the export failed"
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:240]}{'…' if len(text) > 240 else ''}"


class OutageLog:
    """The log lines of one backend's export worker (not thread-safe: the worker's thread and
    callers holding its lock use it)."""

    def __init__(self, name: str, destination: str) -> None:
        self.name = name
        where = strip_credentials(destination) if destination else ""
        self.label = f"{name} ({where})" if where and where != name else name
        self.last_error: BaseException | None = None
        self.unexpected = 0
        self.backlog: set[int] | None = None  # batches waiting when it came back
        self.sent = 0

    def failed_attempt(self, exc: BaseException) -> None:
        self.last_error = exc
        if is_outage(exc):
            log.debug("rollout-tracer: export to %s failed: %s", self.label, _short(exc),
                      exc_info=True)  # fmt: skip
            return
        self.unexpected += 1
        if log_every(self.unexpected):
            log.warning("rollout-tracer: export to %s raised %s [%d times]", self.label,
                        _short(exc), self.unexpected, exc_info=self.unexpected == 1)  # fmt: skip

    def went_down(self, attempts: int, spool_dir: Any) -> None:
        where = f"spooling to {spool_dir}" if spool_dir else "held in memory (no spool)"
        log.warning("rollout-tracer: backend %s is down (%s, %d attempts); its trajectories are "
                    "%s and are sent when it is back", self.label, _short(self.last_error),
                    attempts, where)  # fmt: skip
        self.last_error = None
        self.backlog = None

    def stopped_at_shutdown(self, attempts: int) -> None:
        """Shutdown ended an export call (its deadline, or an abort), not the backend."""
        log.warning("rollout-tracer: export to %s stopped at shutdown (%s, %d attempts); the "
                    "shutdown line says where its trajectories are", self.label,
                    _short(self.last_error), attempts)  # fmt: skip
        self.last_error = None

    def replayed_in_doubt(self, n: int) -> None:
        """A batch marked in doubt (an export call of unknown outcome had it: one running at
        a shutdown's deadline, or in a process killed during it) was replayed to a backend
        that does not deduplicate by trace id."""
        log.warning("rollout-tracer: %d trajectories replayed to %s were in doubt (an export "
                    "call of unknown outcome had them: at an earlier run's shutdown deadline, "
                    "or in a process killed during it); %s does not deduplicate by trace id, "
                    "so they may be stored twice", n, self.label, self.name)  # fmt: skip

    def came_back(self, waiting: list[Any]) -> None:
        self.backlog = {id(b) for b in waiting}
        self.sent = 0

    def settled(self, batch: Any, n: int) -> None:
        if self.backlog is None:
            return
        self.backlog.discard(id(batch))
        self.sent += n
        if not self.backlog:
            log.warning("rollout-tracer: backend %s is back; the %d trajectories that waited "
                        "have been sent", self.label, self.sent)  # fmt: skip
            self.backlog = None
