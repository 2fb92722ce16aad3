"""The processing thread's work on a batch taken from the hot buffer: sample, build the
record, redact, apply the keep rules, serialize once, and hand the records to every backend's
export worker. Each trajectory taken ends up in a worker or in a drop counter, whatever
happens (an unexpected error is counted as ``internal_error``, never silent). The buffer, the
thread and shutdown are ``tracer.pipeline``'s."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tracer.batch import LineRecords
from tracer.encode import encode_record
from tracer.errors import InternalErrors
from tracer.record import TrajectoryRecord
from tracer.record_builder import build_record

if TYPE_CHECKING:
    from tracer.config import TraceConfig
    from tracer.export_worker import ExportWorker
    from tracer.keep import KeepRules
    from tracer.live.steps import LiveSteps
    from tracer.redact import Redactor
    from tracer.sampling import Sampler
    from tracer.trajectory import Trajectory


class Processed:
    """What one pass of ``_process`` has so far: records for the workers (with their lines,
    None where one must be made again) and what it counted already. ``with_records``: False
    when every worker takes lines only (``Exporter.lines_suffice``): a record that has its line
    is not kept (None in ``records``), so it is gone when the next one is built, not kept alive
    through the rest of the batch (a garbage-collector pass or two in the user's process
    promoted them to its oldest generation, to be walked again by the next full pass)."""

    __slots__ = ("born", "from_keep", "handed", "lines", "records", "seqs", "settled",
                 "with_records")  # fmt: skip

    def __init__(self, with_records: bool = True) -> None:
        self.with_records = with_records
        self.records: list[TrajectoryRecord | None] = []
        self.lines: list[bytes | None] = []
        self.seqs: list[int] = []
        self.born: list[int] = []  # end times of this pass's own trajectories
        self.settled = 0  # trajectories of the batch already counted (evicted, build error)
        self.from_keep = 0  # records the keep rules released (some from earlier batches)
        self.handed = 0  # workers that have the records

    def add(self, seq: int, record: TrajectoryRecord, line: bytes | None, born_ns: int) -> None:
        self.seqs.append(seq)
        self.records.append(record if self.with_records or line is None else None)
        self.lines.append(line)
        if born_ns:
            self.born.append(born_ns)


class Processing:
    """The processing half of ``tracer.pipeline.Pipeline`` (its base class): the attributes
    below are the pipeline's, set in its ``__init__``."""

    config: TraceConfig
    sampler: Sampler
    tokenizer: Callable[[], Any]
    errors: InternalErrors
    redactor: Redactor | None
    keep: KeepRules | None
    live: LiveSteps | None
    workers: list[ExportWorker]
    lock: threading.Lock
    wake: threading.Event
    in_process: dict[int, tuple[int, int, int]]
    hot_ns: int
    hot_trajectories: int
    processor: threading.Thread | None
    _end_steps: list[tuple[Any, bool | None]]

    def _drop_before_workers(self, n: int, reason: str) -> None:
        raise NotImplementedError

    def _start(self) -> None:
        raise NotImplementedError

    def _process_guarded(self, batch: list[tuple[int, Trajectory]], token: int) -> None:
        try:
            self._process(batch)
        except Exception as exc:  # _process settles every trajectory; this is the backstop
            with self.lock:
                self._drop_before_workers(len(batch), "internal_error")
            self.errors.report("processing trajectories", exc, background=True)
        finally:
            with self.lock:
                del self.in_process[token]

    def _process(self, batch: list[tuple[int, Trajectory]]) -> None:
        """Sample, build, redact, keep, serialize, hand off: each trajectory taken here ends
        up in a worker or in a drop counter, whatever happens."""
        out = Processed(with_records=not all(w.lines_suffice for w in self.workers))
        try:
            tokenizer = self.tokenizer()
            self._count_hot_path(batch)
            for seq, traj in batch:
                head = self.sampler.confirm(traj.step, traj.sample_index, traj.validate)
                if not head and self.keep is None:
                    self._drop_counted(out, "evicted_by_sampling")  # a lower hash came, by design
                    continue
                built = self._build(traj, tokenizer)
                if built is None:
                    self._drop_counted(out, "build_error")
                    continue
                record, line = built
                self._observe(record)
                if self.keep is not None:  # decided here or later (held, pending)
                    self._keep(seq, record, traj.nbytes, head, out)
                    continue
                out.add(seq, record, line, traj.end_ns)
            self._hand_off(out)
        except Exception as exc:
            # Something unexpected after the trajectories left the buffer: whatever no worker
            # got is counted as lost (never silently), then the loop goes on.
            self._count_unhanded(out, len(batch) - out.settled + out.from_keep)
            self.errors.report("processing trajectories", exc, background=True)

    def _count_hot_path(self, batch: list[tuple[int, Trajectory]]) -> None:
        hot_ns = sum(traj.hot_ns for _seq, traj in batch)
        with self.lock:  # once per batch: the lock is shared with the rollout's submit
            self.hot_ns += hot_ns
            self.hot_trajectories += len(batch)

    def _drop_counted(self, out: Processed, reason: str) -> None:
        with self.lock:
            self._drop_before_workers(1, reason)
        out.settled += 1

    def _build(self, traj: Trajectory, tokenizer: Any) -> tuple[TrajectoryRecord, bytes] | None:
        """The trajectory's record and its JSON line, redacted; None when it cannot be built
        (an internal error, logged). The line is made once and serves the redaction check,
        the spool and byte-oriented backends."""
        try:
            record = build_record(traj, self.config, tokenizer)
            line = encode_record(record)
            if self.redactor is not None and self.redactor.needs(line):
                record = self.redactor.record(record)
                line = encode_record(record)
            if self.keep is not None:  # rules and their predicate read Python values
                record.materialize()
            return record, line
        except Exception as exc:
            self.errors.report("building a trace record", exc, background=True)
            return None

    def _observe(self, record: TrajectoryRecord) -> None:
        """Add the trajectory to the live analysis (tracer/live/); an error there is counted
        and logged, and the trajectory goes on to the backends all the same."""
        if self.live is not None:
            try:
                self.live.observe(record)
            except Exception as exc:
                self.errors.report("the live analysis", exc, background=True)

    def _keep(self, seq: int, record: TrajectoryRecord, nbytes: int, head: bool,
              out: Processed) -> None:  # fmt: skip
        assert self.keep is not None
        released, not_kept = self.keep.observe(seq, record, nbytes, head)
        out.settled += 1  # held, dropped or in out (counted in from_keep)
        out.from_keep += len(released)
        if not_kept:
            with self.lock:
                self._drop_before_workers(not_kept, "not_kept")
        for kept_seq, kept in released:
            out.add(kept_seq, kept, None, 0)  # its line is made again: keep tagged it

    def _hand_off(self, out: Processed) -> None:
        """Give the records and their lines to every worker (a line missing is made here)."""
        if not out.records:
            return
        lines = [line if line is not None else encode_record(record)  # type: ignore[arg-type]
                 for record, line in zip(out.records, out.lines, strict=True)]  # fmt: skip
        nbytes = sum(len(line) for line in lines)
        born_ns = min(out.born) if out.born else time.time_ns()
        records = out.records if out.with_records else LineRecords(lines)
        for w in self.workers:
            w.put(min(out.seqs), records, lines, nbytes, born_ns)  # type: ignore[arg-type]
            out.handed += 1

    def _count_unhanded(self, out: Processed, before_any: int) -> None:
        """After an unexpected error: count what no worker got (``before_any`` when none)."""
        if out.handed == 0:
            with self.lock:
                self._drop_before_workers(before_any, "internal_error")
        else:
            for w in self.workers[out.handed:]:
                with w.cond:
                    w.dropped["internal_error"] += len(out.records)

    # keep rules -----------------------------------------------------------------------
    def end_step(self, step: Any, validate: bool | None = None) -> None:
        """Ask the processing thread to finish ``step`` for the keep rules once everything
        submitted so far is processed (never blocks)."""
        if self.keep is None:
            return
        with self.lock:
            self._end_steps.append((step, validate))
            if self.processor is None:
                self._start()
        self.wake.set()

    def _end_requested_steps(self) -> None:
        if self.keep is None:
            return
        with self.lock:
            requests, self._end_steps = self._end_steps, []
        for step, validate in requests:
            self._hand_released(self.keep.end_step(step, validate))

    def _hand_released(self, released: tuple[list[tuple[int, TrajectoryRecord]], int]) -> None:
        """Hand trajectories the keep rules decided on outside ``_process`` to every worker."""
        kept, not_kept = released
        if not_kept:
            with self.lock:
                self._drop_before_workers(not_kept, "not_kept")
        out = Processed()
        for seq, record in kept:
            out.add(seq, record, None, 0)
        try:
            self._hand_off(out)
        except Exception as exc:
            self._count_unhanded(out, len(out.records))
            self.errors.report("handing kept trajectories", exc, background=True)
