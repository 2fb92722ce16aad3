"""What one process keeps for the live analysis: the rows (tracer/live/row.py) of the trajectories
its processing thread built, for the last ``live_steps`` training steps and as many validation
passes, at most :data:`MAX_ROWS` a step (the rest are counted). The processing thread adds;
``partial`` copies under the lock, so a reader never sees a step half added."""

from __future__ import annotations

import collections
import threading
from typing import Any

MAX_ROWS = 2048  # rows kept per step and process; more are counted in live_rows_left_out


class LiveSteps:
    """``observe(record)`` (the processing thread); ``rows(step, validate, history)``."""

    def __init__(self, keep_steps: int, max_rows: int = MAX_ROWS) -> None:
        self.keep_steps = keep_steps
        self.max_rows = max_rows
        self.lock = threading.Lock()
        # (validate, step) -> rows, oldest step first within each validate flag
        self.steps: dict[tuple[bool, int], list[dict[str, Any]]] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        # step -> (rows grouped, the level it was judged against or None where its own
        # correct answers set it, its groups and total): training steps grouped once, for
        # tracer.step_metrics (this process's rows are all its step has)
        self._settled: dict[int, tuple[int, float | None, list[Any], Any]] = {}
        # what correct answers were paid, every step seen (validate -> correctness name ->
        # [reward sum, count]): the level a step with no correct answer is judged against
        # once the steps that had one are let go (tracer/readers/habits/earned.py)
        self.paid: dict[bool, dict[str, list[float]]] = {False: {}, True: {}}
        # the same per kept step ((validate, step) -> [reward sum, count], accuracy only): the
        # level of the steps the rules look back over (tracer.step_metrics)
        self.step_paid: dict[tuple[bool, int], list[float]] = {}

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
            self._pay(key, row)

    def _pay(self, key: tuple[bool, int], row: dict[str, Any]) -> None:
        """Count the row's reward under each correctness it passes (caller holds ``lock``)."""
        from tracer.readers.habits.earned import LOW_CORRECTNESS, num, parts_of, truth

        reward = num(row.get("reward"))
        if reward is None:
            return
        named = {**parts_of(row.get("reward_parts")), "accuracy": truth(row.get("accuracy"))}
        for name, value in named.items():
            if value is not None and value >= LOW_CORRECTNESS:
                total = self.paid[key[0]].setdefault(name, [0.0, 0])
                total[0] += reward
                total[1] += 1
                if name == "accuracy":
                    mine = self.step_paid.setdefault(key, [0.0, 0])
                    mine[0] += reward
                    mine[1] += 1

    def _bound(self, validate: bool) -> None:
        """Let the oldest steps go beyond ``keep_steps`` (caller holds ``lock``)."""
        mine = sorted(s for v, s in self.steps if v == validate)
        for step in mine[: max(0, len(mine) - self.keep_steps)]:
            del self.steps[(validate, step)]
            self.step_paid.pop((validate, step), None)

    def rows(self, step: int, history: bool = True) -> list[dict[str, Any]]:
        """The rows of ``step`` (training and validation), and with ``history`` those of
        every earlier step kept: what the rules look back over."""
        with self.lock:
            return [row for (_, s), rows in sorted(self.steps.items(), key=lambda kv: kv[0][1])
                    if s == step or (history and s < step) for row in rows]  # fmt: skip

    def rows_before(self, step: int, validate: bool) -> list[dict[str, Any]]:
        """The rows of the kept steps before ``step``, training or validation ones."""
        with self.lock:
            return [row for (v, s), rows in self.steps.items() if v == validate and s < step
                    for row in rows]  # fmt: skip

    def paid_level(self, first: int, last: int, validate: bool = False) -> float | None:
        """What correct answers (accuracy) were paid on average in the kept steps ``first <
        step <= last``; None when none was correct there."""
        total = n = 0.0
        with self.lock:
            for (v, s), (paid, count) in self.step_paid.items():
                if v == validate and first < s <= last:
                    total, n = total + paid, n + count
        return total / n if n else None

    def settled(self, before: int, level: float | None = None) -> dict[int, tuple[list[Any], Any]]:
        """The kept training steps before ``before``, each grouped by behaviour once (the
        readers' ``aggregate`` with the default thresholds), again only when rows came since
        or, for a step with no correct answer, when ``level`` (what correct answers were paid
        in the steps looked back over) moved."""
        import dataclasses

        from tracer.readers.habits.patterns import PatternThresholds, aggregate

        th = PatternThresholds()
        with self.lock:
            wanted = {s: rows for (v, s), rows in self.steps.items() if not v and s < before}
            own = {s for (v, s) in self.step_paid if not v and s < before}
            self._settled = {s: e for s, e in self._settled.items() if s in wanted}
        out = {}
        earlier = {False: level} if level is not None else None
        for s, rows in wanted.items():
            n = len(rows)  # rows are only ever appended
            judged = None if s in own else level
            entry = self._settled.get(s)
            if entry is None or entry[0] != n or entry[1] != judged:
                groups, totals = aggregate(rows[:n], th.earned_by, th.earned, th.min_count,
                                           earlier)  # fmt: skip
                entry = self._settled[s] = (n, judged, groups, totals.get(s))
            if entry[3] is not None:  # the rules read the groups; a validation pass is
                out[s] = (entry[2], dataclasses.replace(entry[3]))  # written on the total
        return out

    def paid_totals(self) -> dict[str, dict[str, list[float]]]:
        """:attr:`paid` as JSON data (``"true"``/``"false"`` keys), a copy."""
        with self.lock:
            return {str(v).lower(): {k: list(t) for k, t in by.items()}
                    for v, by in self.paid.items()}  # fmt: skip

    def metrics(self) -> dict[str, int]:
        with self.lock:
            return {f"tracer/{k}": v for k, v in self.counts.items()}
