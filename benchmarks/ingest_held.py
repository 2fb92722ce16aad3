"""The held run's measures (benchmarks/ingest.py): how far the store trails the rollout,
sampled in each writer, and whether a rate offered on a fixed schedule was held.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import tracer


class Lags:
    """How far the store trails the rollout, sampled every ``every_s`` in a writer: at each
    sample, the seconds since the newest trajectory the store holds (the tracer's
    ``tracer/mlflow/exported``: in the store, committed) was made. Trajectories are stored in
    the order they are made, so the n-th stored is the n-th made."""

    def __init__(self, made_at: list[float], every_s: float = 0.5, stored_before: int = 0
                 ) -> None:  # fmt: skip
        self.made_at = made_at
        self.stored_before = stored_before  # stored before the first of ``made_at`` (warm-up)
        self.taken: list[tuple[float, int]] = []  # (when, the tracer's exported count)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.taken.append((time.time(), int(tracer.metrics().get("tracer/mlflow/exported", 0))))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def samples(self, made: float) -> list[tuple[float, float]]:
        """(when, lag in seconds) for each sample while trajectories were being made (the
        drain after the last one is ``drain_s``); a sample before any was stored counts from
        the first one made. The warm-up's trajectories (``stored_before``) are not counted."""
        out = []
        for when, exported in self.taken:
            if when > made or not self.made_at:
                continue
            stored = max(0, exported - self.stored_before)
            newest = self.made_at[stored - 1] if stored else self.made_at[0]
            out.append((round(when, 3), round(max(0.0, when - newest), 3)))
        return out


def lag_summary(per_writer: list[list[tuple[float, float]]], start: float) -> dict[str, Any]:
    """The writers' lag samples together: the median and the largest, and the largest in each
    tenth of the run (does it grow: a backlog, or hold: a rate the store keeps up with)."""
    lags = sorted(lag for samples in per_writer for _, lag in samples)
    if not lags:
        return {}
    end = max(when for samples in per_writer for when, _ in samples)
    tenths = [0.0] * 10
    for samples in per_writer:
        for when, lag in samples:
            k = min(9, int(10 * (when - start) / max(end - start, 1e-9)))
            tenths[k] = max(tenths[k], lag)
    return {"p50": lags[len(lags) // 2], "max": lags[-1], "max_by_tenth": tenths}


def is_held(run: dict[str, Any]) -> bool:
    """Whether a run on a fixed schedule held its rate: the writers made what was offered
    (3 % slack) and the store kept up, its last trace durable within a batch or two of the
    last made (2 s, or 5 % of the run when longer): a store that falls behind shows as a drain
    that grows with the run."""
    made_all = run["made_per_s"] >= 0.97 * run["offered_per_s"]
    made_s = run["wall_s"] - run["drain_s"]
    return bool(made_all and run["drain_s"] <= max(2.0, 0.05 * made_s))
