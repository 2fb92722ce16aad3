"""A local, bounded, append-only spool: the write-ahead log of every backend.

The processing thread writes each batch of finished records to one file per backend *before*
handing it to that backend's export worker; the file is deleted once the backend has it. So:

- a backend outage leaves its batches here (nothing lost, memory stays bounded: a worker whose
  queue is full keeps only the file name), and they are replayed when the backend is back;
- a process killed with SIGKILL loses only what had not reached the spool yet (trajectories
  finished within the last flush interval); the next tracer on the same spool, or
  ``rollout-tracer replay``, exports the rest. Replays are idempotent because every backend
  writes by trace id.

Layout: ``<spool_dir>/<backend>-<destination hash>/`` holds ``destination.json`` (backend name
and the trace config, so ``rollout-tracer replay`` can rebuild the exporter) and batch files
``<pid>-<seq>-<n>.jsonl``, one JSON record per line (``TrajectoryRecord.to_dict``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tracer.record import TrajectoryRecord, read_jsonl

DESTINATION_FILE = "destination.json"


def default_spool_dir() -> str:
    return os.path.join(os.getcwd(), ".rollout-tracer", "spool")


def pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class BackendSpool:
    """The spool folder of one backend destination. Thread-safe."""

    def __init__(
        self, root: str, backend: str, destination: str, config: Any, max_bytes: int
    ) -> None:
        digest = hashlib.sha1(f"{backend}|{destination}".encode()).hexdigest()[:12]
        self.dir = Path(root) / f"{backend}-{digest}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._counter = 0
        meta = self.dir / DESTINATION_FILE
        if not meta.exists():
            payload = {
                "backend": backend,
                "destination": destination,
                "config": _config_dict(config),
            }
            tmp = meta.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(payload, indent=1, default=str))
            os.replace(tmp, meta)
        self.used = sum(p.stat().st_size for p in self._batch_files())

    def _batch_files(self) -> Iterator[Path]:
        for p in self.dir.iterdir():
            if p.suffix == ".jsonl":
                yield p

    def write(self, lines: list[str]) -> Path | None:
        """Append one batch as a new file; None when the spool is full (caller counts a drop)."""
        data = ("\n".join(lines) + "\n").encode()
        with self._lock:
            if self.used + len(data) > self.max_bytes:
                return None
            self._counter += 1
            name = f"{os.getpid()}-{self._counter:08d}-{len(lines)}.jsonl"
            self.used += len(data)
        path = self.dir / name
        tmp = self.dir / f".{name}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # a reader never sees half a batch
        return path

    def delete(self, path: Path) -> None:
        try:
            size = path.stat().st_size
            path.unlink()
        except FileNotFoundError:
            return
        with self._lock:
            self.used = max(0, self.used - size)

    def orphans(self) -> list[Path]:
        """Batch files left by processes that are gone (crashed, killed, or exited while the
        backend was down), oldest first."""
        out = []
        for p in self._batch_files():
            try:
                pid = int(p.name.split("-", 1)[0])
            except ValueError:
                continue
            if not pid_alive(pid):
                out.append(p)
        return sorted(out, key=lambda p: p.stat().st_mtime)

    def claim(self, path: Path) -> Path | None:
        """Take an orphan for replay by renaming it under our pid (atomic: one winner)."""
        with self._lock:
            self._counter += 1
            n = self._counter
        new = path.with_name(f"{os.getpid()}-r{n:07d}-{path.name.rsplit('-', 1)[-1]}")
        try:
            os.rename(path, new)
        except FileNotFoundError:
            return None
        return new


def read_batch(path: Path) -> list[TrajectoryRecord]:
    """One spool batch (a torn line from a crash mid-write is skipped, the rest kept)."""
    return list(read_jsonl(path))


def spool_folders(root: str) -> list[tuple[Path, dict[str, Any]]]:
    """Every backend folder under a spool root with its destination.json."""
    out: list[tuple[Path, dict[str, Any]]] = []
    base = Path(root)
    if not base.is_dir():
        return out
    for d in sorted(base.iterdir()):
        meta = d / DESTINATION_FILE
        if d.is_dir() and meta.exists():
            out.append((d, json.loads(meta.read_text())))
    return out


def _config_dict(config: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        out = {}
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            if callable(value):
                continue
            out[f.name] = value
        return out
    return {}
