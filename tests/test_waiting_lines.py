"""What waits for export in the user's process: lines (bytes), not records, for a backend whose
lines suffice (``Exporter.lines_suffice``, the export child's proxy). A record is ~20 containers
that the user's garbage collector walks while it waits (and promotes to its oldest generation,
walked again by each full pass over the user's whole heap); bytes are never walked. The
backend still gets the records when it asks: read from the lines (``tracer.batch.LineRecords``).

Real pipeline (spool on), a backend of this file that holds its first call until told."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

import tracer
from tracer.backends import register_backend
from tracer.backends.base import Exporter, ExportResult
from tracer.batch import LineRecords
from tracer.record import SpanRecord, TrajectoryRecord


class Holding(Exporter):
    """Stores lines; its first call waits for ``go``. ``lines_suffice`` as the test says."""

    name = "holding"
    latest: Holding | None = None

    def __init__(self, config: object) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        self.calls: list[tuple[type, list[str], list[bytes]]] = []
        Holding.latest = self

    def export_encoded(self, batch: Sequence[TrajectoryRecord], lines: Sequence[bytes], *,
                       replay: bool = False) -> ExportResult:  # fmt: skip
        self.entered.set()
        assert self.go.wait(60)
        self.calls.append((type(batch), [r.trace_id for r in batch], list(lines)))
        return ExportResult.SUCCESS


class HoldingLines(Holding):
    name = "holding-lines"
    lines_suffice = True


@tracer.trace_op(kind="generate")
def generate(prompt: str) -> dict[str, object]:
    return {"text": prompt.upper(), "ids": list(range(8))}


PROJECT = "waiting-lines"


def _alive() -> int:
    """This test's records alive in the process (others' may be: a memory backend's)."""
    return sum(type(o) is TrajectoryRecord and o.project_name == PROJECT
               for o in gc.get_objects())  # fmt: skip


@pytest.fixture()
def holding(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Holding]:
    cls = request.param
    register_backend(cls.name, cls)
    tracer.init(backend=cls.name, spool_dir=str(tmp_path / "spool"), flush_interval_s=0.02,
                export_interval_s=0, export_in_subprocess=False, project_name=PROJECT)  # fmt: skip
    yield Holding.latest  # type: ignore[misc]
    if Holding.latest is not None:
        Holding.latest.go.set()
    tracer.shutdown()


def _trace(first: int, n: int) -> None:
    for i in range(first, first + n):
        with tracer.trace_attr(step=0, sample_index=i):
            for turn in range(4):
                generate(f"question {i} turn {turn}")


def _processed(n: int) -> None:
    deadline = time.monotonic() + 30
    while tracer.metrics()["tracer/submitted"] < n or tracer.metrics()["tracer/queue_depth"]:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)  # the processing thread hands the last batch to the worker


@pytest.mark.parametrize("holding", [HoldingLines, Holding], indirect=True)
def test_batches_waiting_for_a_lines_only_backend_hold_no_records(holding: Holding) -> None:
    worker = tracer.get_tracer().pipeline.workers[0]
    put, given = worker.put, []

    def spy(seq: int, records: Sequence[TrajectoryRecord], *args: object) -> None:
        given.append(type(records))  # what the processing thread hands over
        put(seq, records, *args)  # type: ignore[arg-type]

    worker.put = spy  # type: ignore[method-assign]
    _trace(0, 1)
    assert holding.entered.wait(30)  # the first call holds; the next batches wait behind it
    _trace(1, 40)
    _processed(41)
    gc.collect()
    waiting = _alive()
    with worker.cond:
        queued = {type(b.records) for b in worker.todo}
    holding.go.set()
    assert tracer.flush(60)
    kinds = {kind for kind, _, _ in holding.calls}
    ids = [tid for _, tids, _ in holding.calls for tid in tids]
    assert len(ids) == len(set(ids)) == 41
    for _, tids, lines in holding.calls:  # each record is the one its line holds
        assert [line[:60].decode().split('"')[3] for line in lines] == tids
    if holding.lines_suffice:
        assert waiting == 0
        assert kinds == queued == set(given) == {LineRecords}
    else:  # a backend that reads records keeps them: what the test above would see
        assert waiting >= 40
        assert LineRecords not in kinds | queued | set(given)


def test_a_worker_keeps_lines_only_for_a_backend_whose_lines_suffice(tmp_path: Path) -> None:
    """Records handed to such a worker (by the keep rules' release, say) wait as lines too."""
    register_backend(HoldingLines.name, HoldingLines)
    tracer.init(backend=HoldingLines.name, spool_dir=str(tmp_path / "spool"),
                export_interval_s=0, export_in_subprocess=False)  # fmt: skip
    try:
        worker = tracer.get_tracer().pipeline.workers[0]
        record = TrajectoryRecord("ab" * 16, "t", "p", "e", 0, 0, 0, False, "w", 1, 2,
                                  spans=[SpanRecord("cd" * 8, None, "t", "trajectory", 1, 2)])
        from tracer.encode import encode_record

        with worker.cond:  # nothing leaves the line while this looks
            worker.put(1, [record], [encode_record(record)], 10, 1)
            [batch] = [b for b in worker.todo if b.seq == 1]
            assert type(batch.records) is LineRecords
            assert [r.spans[0].span_id for r in batch.records] == ["cd" * 8]
    finally:
        assert HoldingLines.latest is not None
        HoldingLines.latest.go.set()
        tracer.shutdown()
