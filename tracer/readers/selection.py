"""Which stored trajectories a reader returns, the page size readers use, and the errors a reader
raises when the selection or the store is wrong (each names what was tried and what exists)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from tracer.record import TrajectoryRecord

PAGE_SIZE = 500  # an MLflow server caps max_results at 500


def paged(records: Iterable[TrajectoryRecord], page_size: int = PAGE_SIZE
          ) -> Iterator[list[TrajectoryRecord]]:  # fmt: skip
    """``records`` in lists of ``page_size`` (the last one shorter, none empty): what a
    source yields, so an export holds one page at a time."""
    page: list[TrajectoryRecord] = []
    for record in records:
        page.append(record)
        if len(page) >= page_size:
            yield page
            page = []
    if page:
        yield page
STEPS_FORMAT = "FIRST:LAST (inclusive, e.g. 1:10) or a list (e.g. 1,4,7)"


class NoTrajectories(LookupError):
    """The source was read and nothing matched the selection (a command exits with status 1)."""


class StoreNotFound(FileNotFoundError):
    """The store, file or folder a reader was pointed at does not exist (nothing is created)."""


@dataclass
class Selection:
    """Which trajectories to read: ``steps`` (None = all), ``validate`` (None = both)."""

    steps: Sequence[int] | None = None
    validate: bool | None = None

    def keeps(self, record: TrajectoryRecord) -> bool:
        if self.steps is not None and record.step not in self.steps:
            return False
        return self.validate is None or bool(record.validate) == self.validate

    def describe(self, experiment: str | None = None) -> str:
        """The selection as the options that made it (for 'nothing matched' messages)."""
        parts = [f"--experiment {experiment}"] if experiment else []
        if self.steps is not None:
            parts.append(f"--steps {_ranges(self.steps)}")
        if self.validate is not None:
            parts.append("--validate" if self.validate else "--no-validate")
        return " ".join(parts) or "(everything)"


def _ranges(steps: Iterable[int]) -> str:
    values = sorted(set(steps))
    if len(values) > 2 and values == list(range(values[0], values[-1] + 1)):
        return f"{values[0]}:{values[-1]}"
    return ",".join(str(s) for s in values)


def no_match(where: str, selection: Selection, experiment: str | None,
             steps: Iterable[object] = (), experiments: Iterable[object] = ()) -> NoTrajectories:
    """A ``NoTrajectories`` that says what was asked and, when known, what the source holds."""
    msg = f"no trajectories in {where} match {selection.describe(experiment)}"
    present = sorted({str(s) for s in experiments if s})
    if present:
        msg += f"; experiments there: {', '.join(present)}"
    found = sorted({s for s in steps if isinstance(s, int)})
    if found:
        msg += f"; steps there: {_ranges(found)}"
    return NoTrajectories(msg)


def parse_steps(step: int | None = None, steps: str | None = None) -> list[int] | None:
    """``step=3`` -> [3]; ``steps="1:10"`` -> [1..10] (inclusive); ``"1,4,7"`` -> [1, 4, 7].
    Anything else raises ``ValueError`` naming ``--steps``, its format and an example."""
    if step is not None:
        return [int(step)]
    if steps is None:
        return None
    text = steps.strip()
    try:
        if ":" in text:
            lo, hi = (int(part) for part in text.split(":", 1))
            if lo > hi:
                raise ValueError(f"--steps {steps}: FIRST is after LAST (did you mean {hi}:{lo}?)")
            return list(range(lo, hi + 1))
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError as exc:
        if str(exc).startswith("--steps"):
            raise
        raise ValueError(f"--steps {steps!r}: expected {STEPS_FORMAT}") from None
    if not values:
        raise ValueError(f"--steps {steps!r}: expected {STEPS_FORMAT}")
    return values
