"""A local, bounded, append-only spool: the write-ahead log of every backend.

The processing thread writes each batch of finished records to one file per backend *before*
handing it to that backend's export worker; the file is deleted once the backend has it. So:

- a backend outage leaves its batches here (memory stays bounded: a worker whose queue is full
  keeps only the file name), and they are replayed when the backend is back;
- a process killed with SIGKILL loses only what had not reached the spool yet (trajectories
  finished within the last flush interval); the next tracer on the same spool, or
  ``rollout-tracer replay``, exports the rest. Replays are idempotent because every backend
  writes by trace id.

The spool is a safety net, never a single point of failure: when a file cannot be written
(full disk, read-only, quota, permissions) ``write`` raises ``SpoolError`` and the caller
exports from memory.

Layout: ``<spool_dir>/<backend>-<destination hash>/`` holds
- ``destination.json``: what ``rollout-tracer replay`` needs to rebuild the exporter and find
  the store, credentials stripped (``tracer.spool_folders``);
- one ``<owner>.owner`` lock file per live spool writer; ``owner`` is
  ``<host>_<pid>_<random>``, so a restarted container with the same PID, a second ``init`` in
  one process, and another host on a shared (NFS) folder are all different owners;
- batch files ``<wall ns>_<owner>_<counter>_<n>.jsonl`` (created with ``O_EXCL``, mode 0600),
  one JSON record per line (``TrajectoryRecord.to_dict``). Names sort oldest first;
- a batch in doubt (``<wall ns>_<owner>_<counter>_<n>.in-doubt.jsonl``): an export call may
  have stored it. It is marked *before* every call that could store it (write-ahead: the live
  tracer and ``rollout-tracer replay`` alike) and unmarked only when the call's outcome is
  known: stored, the file is deleted; failed, it is renamed back (unless an earlier call of
  unknown outcome had it: that doubt stays). A process killed during a call leaves it marked,
  so a replay into a backend that does not deduplicate says it may be stored twice. The mark
  is the file's own name, so batch and mark move as one rename (a claim, a late call's end)
  and neither is ever left without the other.

Ownership is decided by the lock, not by whether a PID is alive: a writer holds an exclusive
``flock`` on its owner file for as long as it lives. A batch whose owner's lock can be taken is
an orphan (its process crashed, was killed, or exited while the backend was down); whoever
renames it under its own owner first (atomic) replays it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tracer.record import TrajectoryRecord, read_jsonl, write_lines
from tracer.spool_folders import DESTINATION_FILE, destination_payload, spool_folder

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; a live writer's files look orphaned
    fcntl = None  # type: ignore[assignment]

_NAME = re.compile(r"^(\d+)_(.+)_(\d+)_(\d+)(\.in-doubt)?\.jsonl$")
DOUBT = ".in-doubt"  # before ".jsonl" in the name of a batch that may be stored already
# Owners alive in this process: flock is per open file, but on NFS Linux emulates it with
# POSIX locks, which a process never conflicts with itself on; this set covers that case.
_live_owners: set[str] = set()
_live_lock_fds: set[int] = set()


class SpoolError(OSError):
    """A batch could not be written to the spool (disk full, read-only, permissions...)."""


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()) or "host"


def _after_fork_in_child() -> None:
    # The child must not keep the parent's locks alive through inherited descriptors (the
    # parent's files would never look orphaned after it dies), nor count them as its own.
    for fd in list(_live_lock_fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    _live_lock_fds.clear()
    _live_owners.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


class BackendSpool:
    """The spool folder of one backend destination, written by one owner. Thread-safe."""

    def __init__(
        self,
        root: str,
        backend: str,
        destination: str,
        config: Any,
        max_bytes: int,
        folder: Path | None = None,  # replay into a new destination: read the old folder
    ) -> None:
        self.dir = folder if folder is not None else spool_folder(root, backend, destination)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._counter = 0
        self.owner = f"{_host()}_{os.getpid()}_{secrets.token_hex(4)}"
        self._lock_fd: int | None = None
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._about = (backend, destination, config)
        self._described = self._write_destination()
        self._take_ownership()
        self.used = 0  # bytes of this owner's batches (adopted orphans included)

    def _write_destination(self) -> bool:
        """The folder's destination.json, unless it has one. False when the disk refused it:
        the next batch file written tries again (without it, replay cannot see the folder)."""
        meta = self.dir / DESTINATION_FILE
        if meta.exists():
            return True
        payload = destination_payload(*self._about)
        tmp = self.dir / f".{DESTINATION_FILE}.{self.owner}.tmp"
        try:
            _write_new(tmp, (), prefix=json.dumps(payload, indent=1, default=str).encode())
            os.replace(tmp, meta)
        except OSError:
            # Replay needs it, export does not: a full disk must not stop the tracer here.
            _unlink(tmp)
            return False
        return True

    def _take_ownership(self) -> None:
        _live_owners.add(self.owner)
        if fcntl is None:
            return
        try:
            fd = os.open(self.dir / f"{self.owner}.owner", os.O_CREAT | os.O_RDWR, 0o600)
        except OSError:
            return  # no lock file (full or read-only disk): our batches may look orphaned
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new unique name: never contended
        self._lock_fd = fd
        _live_lock_fds.add(fd)

    def release(self) -> None:
        """Give up ownership: what is left here becomes an orphan that others may replay."""
        _live_owners.discard(self.owner)
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            _live_lock_fds.discard(fd)
            _unlink(self.dir / f"{self.owner}.owner")
            with contextlib.suppress(OSError):
                os.close(fd)

    def batch_files(self) -> Iterator[Path]:
        try:
            entries = list(self.dir.iterdir())
        except OSError:
            return
        for p in entries:
            if p.suffix == ".jsonl" and not p.name.startswith("."):
                yield p

    def write(self, lines: list[bytes], in_doubt: bool = False) -> Path | None:
        """Write one batch (each record's JSON line, ``tracer.encode``) as a new file, marked
        in doubt when an export call has it already. None when the spool is full
        (``max_bytes``); raises ``SpoolError`` when the file system refuses (the caller keeps
        the batch in memory)."""
        size = sum(map(len, lines)) + len(lines)  # newline-terminated
        with self._lock:
            if self.used + size > self.max_bytes:
                return None
            self._counter += 1
            doubt = DOUBT if in_doubt else ""
            name = (f"{time.time_ns():019d}_{self.owner}_{self._counter:08d}_{len(lines)}"
                    f"{doubt}.jsonl")  # fmt: skip
            self.used += size
        path = self.dir / name
        tmp = self.dir / f".{name}.tmp"
        try:
            _write_new(tmp, lines)
            _rename(tmp, path)  # a reader never sees half a batch
        except OSError as exc:
            _unlink(tmp)
            with self._lock:
                self.used = max(0, self.used - size)
            raise SpoolError(exc.errno or errno.EIO, f"spool write failed: {exc}") from exc
        if not self._described:  # made on a full disk: the disk takes files again
            self._described = self._write_destination()
        return path

    def delete(self, path: Path) -> None:
        """A batch is stored: its file goes (already gone: claimed by a replay, or by hand)."""
        try:
            size = path.stat().st_size
            _unlink(path, strict=True)
        except OSError:
            return
        with self._lock:
            self.used = max(0, self.used - size)

    def mark_in_doubt(self, path: Path) -> Path | None:
        """Mark a batch as possibly stored: before an export call that could store it. Its new
        path, or None when it cannot be renamed (gone, or the file system refuses)."""
        if is_in_doubt(path):
            return path
        new = _with_doubt(path, True)
        try:
            _rename(path, new)
        except OSError:
            return None
        return new

    def unmark(self, path: Path) -> Path:
        """A call that had the batch failed: it is not stored (by that call). Its new path;
        the same path when it cannot be renamed (gone: a replay took it, marked, which only
        makes it say "may be stored twice" when it was not)."""
        if not is_in_doubt(path):
            return path
        new = _with_doubt(path, False)
        try:
            _rename(path, new)
        except OSError:
            return path
        return new

    def orphans(self) -> list[Path]:
        """Batch files whose owner is gone (crashed, killed, or exited while the backend was
        down), oldest first. Decided by the owner's lock, so PID reuse cannot fool it."""
        out: list[Path] = []
        verdict: dict[str, bool] = {}
        for p in self.batch_files():
            m = _NAME.match(p.name)
            owner = m.group(2) if m else ""
            if owner not in verdict:
                verdict[owner] = not owner or self._owner_gone(owner)
            if verdict[owner]:
                out.append(p)
        return sorted(out, key=batch_sort_key)

    def _owner_gone(self, owner: str) -> bool:
        if owner in _live_owners:
            return False
        if fcntl is None:
            return owner.split("_")[1:2] != [str(os.getpid())]
        lock = self.dir / f"{owner}.owner"
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            return True  # released at exit, or never created
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its owner holds it: alive
        finally:
            os.close(fd)  # closing our descriptor drops a lock we may have taken
        _unlink(lock)  # a dead owner's lock file: tidy up
        return True

    def claim(self, path: Path) -> Path | None:
        """Take an orphan for replay by renaming it under our owner (atomic: one winner; its
        in-doubt mark is part of its name and comes along). The original timestamp stays first
        in the name, so replay order is kept."""
        m = _NAME.match(path.name)
        with self._lock:
            self._counter += 1
            n = self._counter
        legacy = _legacy_marker(path)  # an older tracer marked in doubt with a file beside it
        doubt = DOUBT if is_in_doubt(path) or legacy.exists() else ""
        if m:
            new = path.with_name(f"{m.group(1)}_{self.owner}_{n:08d}_{m.group(4)}{doubt}.jsonl")
        else:  # an older tracer's file name: still replayable, ordered by mtime
            stamp = int(_mtime(path) * 1e9)
            new = path.with_name(f"{stamp:019d}_{self.owner}_{n:08d}_0{doubt}.jsonl")
        try:
            _rename(path, new)
        except OSError:
            return None
        if doubt:
            _unlink(legacy)  # its batch carries the mark now
        with self._lock:
            self.used += _size(new)
        return new


def batch_sort_key(path: Path) -> tuple[int, str]:
    m = _NAME.match(path.name)
    return (int(m.group(1)), path.name) if m else (int(_mtime(path) * 1e9), path.name)


def _legacy_marker(path: Path) -> Path:
    return path.with_name(f".{path.name}.in-doubt")


def is_in_doubt(path: Path) -> bool:
    """Whether a batch file is marked as possibly stored already (``mark_in_doubt``)."""
    m = _NAME.match(path.name)
    return bool(m and m.group(5))


def _with_doubt(path: Path, doubt: bool) -> Path:
    stem = path.name[: -len(".jsonl")].removesuffix(DOUBT)
    return path.with_name(f"{stem}{DOUBT if doubt else ''}.jsonl")


def batch_size(path: Path) -> int:
    """The number of trajectories a batch file holds, from its name."""
    m = _NAME.match(path.name)
    if m and int(m.group(4)) > 0:
        return int(m.group(4))
    return sum(1 for _ in read_jsonl(path)) if path.exists() else 0


def read_batch(path: Path) -> list[TrajectoryRecord]:
    """One spool batch (a torn line from a crash mid-write is skipped, the rest kept)."""
    return list(read_jsonl(path))


def _write_new(path: Path, lines: Sequence[bytes], prefix: bytes = b"") -> None:
    """Create ``path`` (it must not exist) holding ``prefix``, then each line and a newline
    (``tracer.record.write_lines``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        write_lines(fd, lines, prefix)
    finally:
        os.close(fd)


# The spool's file-system calls that create, rename and remove batch files, in one place each.
def _rename(src: Path, dst: Path) -> None:
    os.rename(src, dst)


def _unlink(path: Path, strict: bool = False) -> None:
    try:
        os.unlink(path)
    except OSError:
        if strict:
            raise


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
