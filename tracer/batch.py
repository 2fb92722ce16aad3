"""A batch of trajectories on its way to one backend, and who owns it.

A batch has exactly one owner at a time, and only the owner acts on it:

- ``QUEUE``: it waits in line (in memory, in its spool file, or both); the worker's thread
  may hand it to an export call, shutdown may leave it in the spool;
- ``CALL``: an export call has it (retries included); only that call's end settles it;
- ``SPOOL``: shutdown left it in the spool file for a later replay (this process no longer
  touches it: another process, or ``rollout-tracer replay``, may take it);
- ``DONE``: stored, refused for good, or counted lost: nobody's.

Every change of owner goes through ``Batch.move`` under the worker's lock, which checks the
transition: a batch the shutdown thread left in the spool cannot be taken by a call, and a
batch a call holds cannot be settled by anyone else (``BatchOwnershipError``: a tracer bug,
raised in the project's tests). A call still running at shutdown's deadline keeps its batch:
it may be stored or not, and its spool file stays marked in doubt (as every batch file is
while a call has it, ``tracer.spool``) until the call's end says which.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

from tracer.spool import batch_sort_key

if TYPE_CHECKING:
    from tracer.record import TrajectoryRecord


class LineRecords(Sequence["TrajectoryRecord"]):
    """A batch's records read from its lines when asked (each time), for a backend whose
    lines suffice (``Exporter.lines_suffice``: the export child's proxy reads records only if
    it must export in this process). Records that wait for export in the user's process are
    garbage collector work there: ~20 containers a trace, promoted to the oldest generation
    while they wait, each adding to the next full pass over the whole heap. Lines are bytes,
    which the collector never walks."""

    __slots__ = ("lines",)

    def __init__(self, lines: Sequence[bytes]) -> None:
        self.lines = lines

    def __len__(self) -> int:
        return len(self.lines)

    @overload
    def __getitem__(self, i: int) -> TrajectoryRecord: ...
    @overload
    def __getitem__(self, i: slice) -> LineRecords: ...
    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return LineRecords(self.lines[i])
        from tracer.encode import decode_record

        return decode_record(self.lines[i])

    def __iter__(self) -> Iterator[TrajectoryRecord]:
        from tracer.encode import decode_record

        return map(decode_record, self.lines)


def joined_records(
    parts: Sequence[Sequence[TrajectoryRecord] | None],
) -> Sequence[TrajectoryRecord]:
    """The records of batches that share a call, in order (read from none of their lines when
    each batch has only lines)."""
    if all(type(p) is LineRecords for p in parts):
        return LineRecords([line for p in parts for line in p.lines])  # type: ignore[union-attr]
    return [r for p in parts for r in p or ()]


class Owner(enum.Enum):
    QUEUE = "queue"
    CALL = "call"
    SPOOL = "spool"
    DONE = "done"


# who may hand a batch to whom
_ALLOWED = {
    (Owner.QUEUE, Owner.CALL),  # the worker's thread begins an export call
    (Owner.CALL, Owner.QUEUE),  # the call failed: back in line, for a retry or a probe
    (Owner.CALL, Owner.DONE),  # the call stored it (or the backend refused it for good)
    (Owner.CALL, Owner.SPOOL),  # a call still running at shutdown failed: it stays on disk
    (Owner.QUEUE, Owner.DONE),  # its spool file vanished, or shutdown counted it lost
    (Owner.QUEUE, Owner.SPOOL),  # shutdown left it in the spool
}


class BatchOwnershipError(RuntimeError):
    """A batch was handed over by someone who did not own it (a tracer bug)."""


class Batch:
    __slots__ = ("attempted", "born_ns", "first_try", "in_doubt", "key", "lines", "n",
                 "nbytes", "own", "owner", "path", "queued_at", "records", "seq")  # fmt: skip

    def __init__(
        self,
        seq: int | None,
        records: Sequence[TrajectoryRecord] | None,
        path: Path | None,
        n: int,
        nbytes: int,
        born_ns: int = 0,
    ) -> None:
        self.born_ns = born_ns or time.time_ns()  # when its oldest trajectory finished
        self.queued_at = time.monotonic()  # when it joined the line
        self.seq = seq  # lowest sequence number of its trajectories; None for an orphan
        self.own = seq is not None
        self.records = records  # None when it lives only in its spool file
        self.lines: list[bytes] | None = None  # the records' JSON lines, while in memory
        self.path = path
        self.n = n
        self.nbytes = nbytes
        self.owner = Owner.QUEUE
        self.attempted = False  # sent once already: may be (partly) stored, replay with care
        self.first_try = False  # refused once when handed over: still gets the usual retries
        # an earlier call of unknown outcome had it (an orphan whose file is marked in doubt)
        self.in_doubt = False
        self.key = batch_sort_key(path) if path is not None else (time.time_ns(), "")

    def move(self, to: Owner) -> None:
        """Hand the batch to its next owner (caller holds the worker's lock)."""
        if (self.owner, to) not in _ALLOWED:
            raise BatchOwnershipError(f"a batch owned by {self.owner.value} cannot go to "
                                      f"{to.value}")  # fmt: skip
        self.owner = to

    @property
    def waiting(self) -> bool:
        """In line, and no call has it."""
        return self.owner is Owner.QUEUE


def shares_calls(batch: Batch, with_lines: bool) -> bool:
    """Whether ``batch`` may share an export call with the batches beside it: this process's
    own, never sent (nothing of it can be in the backend yet), in line, in memory (its
    lines too, for a backend that takes lines)."""
    return (batch.own and not batch.attempted and not batch.in_doubt and batch.waiting
            and batch.records is not None and (batch.lines is not None or not with_lines))


def call_group(line: list[Batch], limit: int, with_lines: bool) -> list[Batch]:
    """The batches the next export call takes from the head of ``line``: the head, and the
    batches right behind it that may share its call (:func:`shares_calls`), up to ``limit``
    trajectories in all. Each keeps its own spool file, marked in doubt during the call and
    settled by its end: one call and one transaction for several, ownership as for one."""
    head = line[0]
    group = [head]
    if not shares_calls(head, with_lines):
        return group
    n = head.n
    for batch in line[1:]:
        if n + batch.n > limit or not shares_calls(batch, with_lines):
            break
        group.append(batch)
        n += batch.n
    return group


def wait_to_share_s(line: list[Batch], limit: int, with_lines: bool, interval: float,
                    now: float) -> float:
    """How long the head of ``line`` waits for more batches to share its call: until
    ``interval`` seconds after it joined the line, while what waits is small, under an eighth
    of ``limit`` (32 of 256) and all of it fits one call (a head or a batch behind it that
    cannot share goes at once). Only batches the spool holds wait (one that only memory holds,
    spool off or full, goes at once): a crash loses nothing more, and a call (a store
    transaction) costs about the same for 2 trajectories as for 32; past that its cost is
    spread thin, and a busy process holding its batches longer (in memory, for its garbage
    collector to walk) and sending them in bursts lost more than it saved
    (benchmarks/ingest.py's held run)."""
    head = line[0]
    if not shares_calls(head, with_lines):
        return 0.0
    group = call_group(line, limit, with_lines)
    if (len(group) < len(line) or sum(b.n for b in group) >= max(1, limit // 8)
            or any(b.path is None for b in group)):  # fmt: skip
        return 0.0
    return head.queued_at + interval - now
