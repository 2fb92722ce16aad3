"""When one backend's next export call may begin: never one that could not end by shutdown's
deadline (none at all after it), and while the backend is down, a probe every
``replay_interval_s``, more often while a flush waits but never one that would outlast it.

How long a call may take is what this backend showed: the longest attempt that failed in this
outage (a retried call's attempts included), or the longest attempt of the last call that
worked. The export worker (``tracer.export_worker``) holds one of these and asks it under its
own lock; it holds no lock and starts nothing itself.
"""

from __future__ import annotations

FLUSH_PROBE_INTERVAL_S = 0.25  # how often a down backend is probed while flush() waits


class CallWindow:
    """One backend's call timing: shutdown's deadline, the outage's probes, a flush's wait."""

    def __init__(self, replay_interval_s: float) -> None:
        self.replay_interval_s = replay_interval_s
        self.close_at = 0.0  # shutdown's deadline once it began: no export call outlasts it
        self.down = False
        self.next_probe = 0.0
        self.flush_until = 0.0  # while a flush waits, probe a down backend more often
        self.last_probe = 0.0  # when the last call ended
        self.failed_call_s = 0.0  # the longest failed attempt of this outage
        self.last_call_s = 0.0  # the longest attempt of the last call that worked

    def call_s(self) -> float:
        """How long the next call may take."""
        return max(self.failed_call_s, self.last_call_s)

    def fits(self, takes_s: float, now: float) -> bool:
        """Whether a call that takes ``takes_s`` and begins ``now`` ends by shutdown's
        deadline (always, before shutdown began)."""
        return not self.close_at or now + takes_s < self.close_at

    def next_call_at(self, now: float) -> float:
        """When the call of the oldest waiting batch may begin: now while the backend is up;
        its next probe while it is down; never (``inf``) when it could not end by shutdown's
        deadline: a call left running would export after shutdown said the batches wait in the
        spool (also after a flush ended, until the worker is stopped)."""
        takes = self.call_s()
        at = now
        if self.down:
            at = self.next_probe
            if self.flush_until > now:
                at = min(at, self.last_probe + FLUSH_PROBE_INTERVAL_S)
                if now + takes > self.flush_until:
                    # a probe now could outlast the flush; a shutdown may follow it
                    at = max(at, self.flush_until + 1.0)
        return at if self.fits(takes, now) else float("inf")

    def failed(self, longest: float, now: float) -> bool:
        """A call failed (not cut short by shutdown): the backend is down, probed again in
        ``replay_interval_s``. True when it was up until now."""
        # every attempt counts, a probe's or a retried call's; the longest, not the last:
        # OTel's call ends at once or after a backoff inside it, by its jitter
        self.failed_call_s = max(self.failed_call_s, longest)
        went_down = not self.down
        self.down = True
        self.next_probe = now + self.replay_interval_s
        return went_down

    def worked(self, longest: float) -> bool:
        """A call stored its batch (or the backend refused it for good). True when the
        backend was down until now."""
        came_back = self.down
        self.down = False
        self.failed_call_s = 0.0
        self.last_call_s = longest
        return came_back
