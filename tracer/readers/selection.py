"""Which stored trajectories a reader returns, and the page size readers use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tracer.record import TrajectoryRecord

PAGE_SIZE = 500  # an MLflow server caps max_results at 500


@dataclass
class Selection:
    """Which trajectories to read: ``steps`` (None = all), ``validate`` (None = both)."""

    steps: Sequence[int] | None = None
    validate: bool | None = None

    def keeps(self, record: TrajectoryRecord) -> bool:
        if self.steps is not None and record.step not in self.steps:
            return False
        return self.validate is None or bool(record.validate) == self.validate


def parse_steps(step: int | None = None, steps: str | None = None) -> list[int] | None:
    """``step=3`` -> [3]; ``steps="1:10"`` -> [1..10] (inclusive); ``"1,4,7"`` -> [1, 4, 7]."""
    if step is not None:
        return [int(step)]
    if not steps:
        return None
    if ":" in steps:
        lo, hi = steps.split(":", 1)
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in steps.split(",") if s.strip()]
