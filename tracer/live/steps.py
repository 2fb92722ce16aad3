"""What one process keeps for the live analysis: the rows (tracer/live/row.py) of the trajectories
its processing thread built, for the last ``live_steps`` training steps and as many validation
passes, at most :data:`MAX_ROWS` a step (the rest are counted). The processing thread adds;
``partial`` copies under the lock, so a reader never sees a step half added."""

from __future__ import annotations

import collections
import threading
from typing import Any

MAX_ROWS = 4096  # rows kept per step and process; more are counted in live_rows_left_out


class LiveSteps:
    """``observe(record)`` (the processing thread); ``rows(step, validate, history)``."""

    def __init__(self, keep_steps: int, max_rows: int = MAX_ROWS) -> None:
        self.keep_steps = keep_steps
        self.max_rows = max_rows
        self.lock = threading.Lock()
        # (validate, step) -> rows, oldest step first within each validate flag
        self.steps: dict[tuple[bool, int], list[dict[str, Any]]] = {}
        self.counts: collections.Counter[str] = collections.Counter()

    def observe(self, record: Any) -> None:
        """Add one built trajectory (its row is made here, outside the lock)."""
        from tracer.live.row import live_row

        step = record.step
        if not isinstance(step, int) or isinstance(step, bool):
            with self.lock:
                self.counts["live_no_step"] += 1  # the rules need a step number
            return
        row = live_row(record)
        key = (bool(record.validate), step)
        with self.lock:
            rows = self.steps.get(key)
            if rows is None:
                newest = [s for v, s in self.steps if v == key[0]]
                if len(newest) >= self.keep_steps and step < min(newest):
                    self.counts["live_too_old"] += 1  # a straggler of a step let go
                    return
                rows = self.steps[key] = []
                self._bound(key[0])
            if len(rows) >= self.max_rows:
                self.counts["live_rows_left_out"] += 1
                return
            rows.append(row)
            self.counts["live_trajectories"] += 1

    def _bound(self, validate: bool) -> None:
        """Let the oldest steps go beyond ``keep_steps`` (caller holds ``lock``)."""
        mine = sorted(s for v, s in self.steps if v == validate)
        for step in mine[: max(0, len(mine) - self.keep_steps)]:
            del self.steps[(validate, step)]

    def rows(self, step: int, history: bool = True) -> list[dict[str, Any]]:
        """The rows of ``step`` (training and validation), and with ``history`` those of
        every earlier step kept: what the rules look back over."""
        with self.lock:
            return [row for (_, s), rows in sorted(self.steps.items(), key=lambda kv: kv[0][1])
                    if s == step or (history and s < step) for row in rows]  # fmt: skip

    def metrics(self) -> dict[str, int]:
        with self.lock:
            return {f"tracer/{k}": v for k, v in self.counts.items()}
