"""JSONL backend: one JSON object per trajectory, appended to a local file.

File: ``config.jsonl_path``, default ``./traces/<project_name>/<experiment_name>.jsonl``. UTF-8,
one trajectory per line, appended (several processes and runs may share a file). A batch is
appended whole or not at all: under an exclusive ``flock`` that every writer of the file takes,
a write or fsync that fails (a full disk) cuts the file back to its size before the append, so
the retry never writes a line twice. Only a crash mid-append (or a cut that fails too) leaves a
partial line, which :func:`read_jsonl` skips; readers also keep only the first line of each
trajectory (``trace_id`` and ``start_ns``), whatever is on disk. Within a process a trajectory
is written once (a batch sent again is not duplicated); every trajectory counted as exported
is a line of the file: a different trajectory that carries an id already written (the same
explicit ``attempt`` given twice, another ``start_ns``) is written too, and readers see both.

Schema (version 2; the field ``schema_version`` is on every line and bumps on any change)::

    {
      "schema_version": 2,
      "trace_id": "32 hex chars",          # unique per trajectory
      "name": "trajectory",                # trace_attr(name=...)
      "project_name": str, "experiment_name": str, "worker_id": "host:pid",
      "step": int | null, "sample_index": any, "rollout_n": any, "validate": bool,
      "attempt": int,                      # 0, 1, ...: a retried sample (since version 2)
      "policy_version": any, "reward": float | null,   # last numeric reward recorded
      "status": "OK" | "ERROR",
      "start_ns": int, "end_ns": int,      # wall clock, ns since the epoch
      "attributes": {str: any},            # extra trace_attr(**attributes)
      "spans": [                           # spans[0] is the root (kind "trajectory")
        {"span_id": "16 hex", "parent_id": "16 hex" | null, "name": str,
         "kind": "trajectory|generate|parse|tool|reward|retrieve|other",
         "start_ns": int, "end_ns": int, "status": "OK" | "ERROR",
         "error": {"type", "message", "traceback"} | null,
         "inputs": any, "outputs": any,    # JSON-able snapshots, truncated with a marker
         "attributes": {str: any}}         # prompt_text, response_tokens, tool_name, reward...
      ]
    }

It is exactly ``TrajectoryRecord.to_dict()``; ``TrajectoryRecord.from_dict`` reads a line back.

Annotations (``tracer.annotate``) are appended as lines of their own, ``{"record_type":
"annotation", "schema_version": 1, "trace_id": ..., "values": {...}, ...}``
(``AnnotationRecord.to_dict()``); readers merge them into their trajectory as an ``annotation``
span (``tracer.readers.sources``). This backend cannot tell whether the trace exists, so it
appends every annotation; a reader ignores one whose trajectory is not in the file.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Sequence
from typing import Any

from tracer.annotations import AnnotationRecord
from tracer.backends.base import Exporter, ExportResult, RecentIds
from tracer.config import TraceConfig
from tracer.encode import encode_record
from tracer.record import TrajectoryRecord, read_jsonl, write_lines

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; appends of several processes may interleave
    fcntl = None  # type: ignore[assignment]

__all__ = ["JsonlExporter", "PartialAppend", "append_whole", "default_jsonl_path", "read_jsonl"]

log = logging.getLogger("tracer")

# How long an append waits for another writer of the file to finish its own. A normal append
# holds the lock for one write and fsync; a writer stopped while holding it must not stall the
# thread that hands batches over: past this the append fails and the batch waits in the spool.
LOCK_WAIT_S = 5.0


def default_jsonl_path(config: TraceConfig) -> str:
    if config.jsonl_path:
        return config.jsonl_path
    return os.path.join("traces", config.project_name, f"{config.experiment_name}.jsonl")


class JsonlExporter(Exporter):
    name = "jsonl"
    supports_annotations = True
    writes_ahead = True  # an appended line is as durable as a spool file: no second copy

    def __init__(self, config: TraceConfig) -> None:
        self.path = os.path.abspath(default_jsonl_path(config))
        self.destination = self.path
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._lock = threading.Lock()
        # trace id -> start of the trajectory written with it: a batch sent again is skipped,
        # another trajectory with that id is not (the file holds all it counts as exported)
        self._written: RecentIds[int] = RecentIds()

    def export(
        self, batch: Sequence[TrajectoryRecord], *, replay: bool = False
    ) -> ExportResult:
        return self.export_encoded(batch, [encode_record(r) for r in batch], replay=replay)

    def export_encoded(
        self, batch: Sequence[TrajectoryRecord], lines: Sequence[bytes], *, replay: bool = False
    ) -> ExportResult:
        """Append the lines the pipeline already made (the spool's bytes), each trajectory
        once: a record whose id and start were written already is skipped."""
        new: list[bytes] = []
        ids: dict[str, int] = {}
        with self._lock:
            for record, line in zip(batch, lines, strict=True):
                key = record.trace_id
                if record.start_ns in (self._written.get(key), ids.get(key)):
                    continue
                ids[key] = record.start_ns
                new.append(line)
            if new:
                try:
                    append_whole(self.path, new)
                except PartialAppend as exc:  # the first lines stay: the retry skips them
                    for key, start_ns in list(ids.items())[: exc.whole]:
                        self._written.add(key, start_ns)
                    raise
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    raise disk_full(exc, self.path) from None
                for key, start_ns in ids.items():
                    self._written.add(key, start_ns)
        return ExportResult.SUCCESS

    def annotate(self, batch: Sequence[AnnotationRecord]) -> list[bool]:
        lines = [
            json.dumps({"schema_version": 1, **a.to_dict()}, ensure_ascii=False, default=str)
            for a in batch
        ]
        if lines:
            with self._lock:
                append_whole(self.path, [line.encode("utf-8") for line in lines])
        return [True] * len(lines)

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        return None


def disk_full(exc: OSError, path: str) -> OSError:
    """The same error, saying which file and how much room its disk has: the outage line
    (``tracer.outage``: one line when it begins, one when it ends) is all the user reads."""
    try:
        usage = shutil.disk_usage(os.path.dirname(os.path.abspath(path)))
        room = f"{usage.free / 1e6:.1f} MB free of {usage.total / 1e6:.1f} MB"
    except OSError:
        room = "free space unknown"
    return OSError(exc.errno, f"{exc.strerror or 'No space left on device'}: {path} ({room})")


class PartialAppend(OSError):
    """An append failed and the file could not be cut back: its first ``whole`` lines are in
    the file (whole), the rest are not."""

    def __init__(self, whole: int, cause: OSError) -> None:
        super().__init__(cause.errno, f"{cause.strerror or cause}; the file could not be cut "
                         f"back, {whole} lines stay in it")  # fmt: skip
        self.whole = whole


def append_whole(path: str, lines: Sequence[bytes]) -> None:
    """Append ``lines`` (each without its newline) to ``path``, all of them or none: under an
    exclusive lock that every writer of the file takes, so the size before the append is this
    append's own, a failed write or fsync cuts the file back to that size and re-raises. When
    the cut fails too, raises :class:`PartialAppend` saying how many lines stayed whole."""
    with open(path, "a+b") as f:
        fd = f.fileno()
        _lock(fd)  # released when the file is closed
        start = os.fstat(fd).st_size
        # a writer that crashed mid-line left a fragment: start on a fresh line
        prefix = b"\n" if start > 0 and _last_byte(f) != b"\n" else b""
        try:
            write_lines(fd, lines, prefix)  # O_APPEND: at the end, unbuffered
            os.fsync(fd)
        except OSError as exc:
            try:
                os.ftruncate(fd, start)
            except OSError:
                raise PartialAppend(_whole_lines(fd, start, prefix, lines), exc) from exc
            raise


def _lock(fd: int) -> None:
    if fcntl is None:
        return
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.005)


def _whole_lines(fd: int, start: int, prefix: bytes, lines: Sequence[bytes]) -> int:
    """How many of ``lines`` a failed append left whole in the file (0 when unknown: the
    retry then writes them all again, and readers keep the first of each)."""
    try:
        written = os.fstat(fd).st_size - start
    except OSError:
        return 0
    end, whole = len(prefix), 0
    for line in lines:
        end += len(line) + 1
        if end > written:
            break
        whole += 1
    return whole


def _last_byte(f: Any) -> bytes:
    f.seek(-1, os.SEEK_END)
    last: bytes = f.read(1)
    f.seek(0, os.SEEK_END)
    return last
