"""Tracer-internal failures: counted, logged once per kind (then every 100th), never raised into
the rollout, except under the project's own tests (``raise_internal_errors``)."""

from __future__ import annotations

import collections
import logging
import sys
import threading

log = logging.getLogger("tracer")


class InternalErrors:
    """Counts and logs internal failures by where they happened.

    ``report`` raises under ``raise_errors`` on the caller's thread. A background loop passes
    ``background=True`` instead: the loop must go on, so the error is kept and raised by the
    next ``check()`` (``flush`` calls it), where a test sees it.
    """

    def __init__(self, raise_errors: bool) -> None:
        self.raise_errors = raise_errors
        self.counts: collections.Counter[str] = collections.Counter()
        self._kept: list[BaseException] = []
        self._lock = threading.Lock()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def report(self, where: str, exc: BaseException, *, background: bool = False) -> None:
        key = f"{where}: {type(exc).__name__}"
        with self._lock:
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
            if not background:
                raise exc
            with self._lock:
                self._kept.append(exc)

    def check(self) -> None:
        """Raise the first error a background loop kept (only under ``raise_errors``)."""
        with self._lock:
            kept, self._kept = self._kept, []
        if kept:
            raise kept[0]


def say_at_shutdown(line: str) -> None:
    """One error line about what shutdown left behind: through logging when the user set it
    up, else on stderr (also at interpreter exit)."""
    if log.hasHandlers():
        log.error("%s", line)
    else:
        print(line, file=sys.stderr, flush=True)


def log_every(counter: int) -> bool:
    """Rate limit for recurring warnings: the 1st, 10th, 100th, then every 1000th."""
    return counter in (1, 10, 100) or counter % 1000 == 0
