"""Bounds for what the explorer keeps: an in-memory LRU cache with an entry and a byte limit,
and the pruning of the cache folder's per-export copies (compacted tables, search indexes,
MLflow/JSONL exports), which would otherwise grow by one export's size on every refresh."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import orjson


def json_size(value: Any) -> int:
    """Bytes of ``value`` as JSON: what the explorer would send, a fair measure of its size."""
    return len(orjson.dumps(value, default=str))


class LRU:
    """Least recently used entries are dropped beyond ``max_entries`` or ``max_bytes``
    (``size(value)`` each); a value larger than ``max_bytes`` on its own is not kept."""

    def __init__(self, max_entries: int, max_bytes: int,
                 size: Callable[[Any], int] = json_size) -> None:  # fmt: skip
        self.max_entries, self.max_bytes, self._size = max_entries, max_bytes, size
        self._data: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: Any, make: Callable[[], Any]) -> Any:
        """The cached value of ``key``, or ``make()`` (kept if it fits)."""
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key][0]
        value = make()  # outside the lock: two requests may compute it twice, never block
        self.put(key, value)
        return value

    def put(self, key: Any, value: Any) -> None:
        n = self._size(value)
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if n > self.max_bytes:
                return
            self._data[key] = (value, n)
            self.bytes += n
            while len(self._data) > self.max_entries or self.bytes > self.max_bytes:
                _, (_, dropped) = self._data.popitem(last=False)
                self.bytes -= dropped
                self.evicted += 1

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.bytes = 0


def prune_folder(folder: str, keep: Iterable[str], max_entries: int) -> list[str]:
    """Delete the least recently modified entries of ``folder`` beyond ``max_entries``, never
    one named in ``keep`` (those in use) and never one still being written (``.building``,
    ``.part``: another process may be at work); returns the names deleted."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    keep = set(keep)
    done = [n for n in names if not n.endswith((".building", ".part"))]
    done.sort(key=lambda n: _mtime(os.path.join(folder, n)), reverse=True)
    spare = max(0, max_entries - len([n for n in done if n in keep]))
    deleted = []
    for name in done:
        if name in keep:
            continue
        if spare > 0:
            spare -= 1
            continue
        shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
        deleted.append(name)
    return deleted


def touch(path: str) -> None:
    """Mark a cache entry as used now (the pruning keeps the most recently used)."""
    with contextlib.suppress(OSError):
        os.utime(path)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0
