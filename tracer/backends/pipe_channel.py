"""Length-prefixed pickles over a pair of pipes, with a deadline on every read and write.

The export process and its parent talk through this (``tracer.backends.subprocess_proxy``).
It waits with ``poll()``, never ``select()``, so any file descriptor number works (``select``
raises ValueError from 1,024 on, and a trainer often has that many open). Both ends are
non-blocking: a peer that stops reading or answering (hung, stopped) costs at most the
deadline (TimeoutError), and one that is gone reads as EOFError or writes as BrokenPipeError.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import select
import struct
import time
from typing import Any

_HEADER = struct.Struct("!Q")  # the pickle's length
_CHUNK = 1 << 20


class Channel:
    """One end of a connection: it reads ``read_fd`` and writes ``write_fd``, and owns both.
    ``deadline`` is a ``time.monotonic()`` time, or None to wait as long as it takes."""

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd = read_fd
        self.write_fd = write_fd
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)

    def send(self, message: Any, deadline: float | None) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self._write(_HEADER.pack(len(data)), deadline)
        self._write(data, deadline)

    def recv(self, deadline: float | None, max_bytes: int | None = None) -> Any:
        (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
        if max_bytes is not None and size > max_bytes:
            raise ValueError(f"a message of {size} bytes, expected at most {max_bytes}")
        return pickle.loads(self._read(size, deadline))

    def close(self) -> None:
        """Close both ends, once (a second call does nothing: the numbers may be reused)."""
        fds, self.read_fd, self.write_fd = (self.read_fd, self.write_fd), -1, -1
        for fd in fds:
            if fd >= 0:
                # EBADF: already closed (a fork's handlers close the pipes the start had made)
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _write(self, data: bytes, deadline: float | None) -> None:
        view = memoryview(data)
        while view:
            _wait(self.write_fd, select.POLLOUT, deadline)
            try:
                n = os.write(self.write_fd, view[:_CHUNK])
            except BlockingIOError:  # woken, but another writer's bytes filled the pipe
                continue
            view = view[n:]

    def _read(self, size: int, deadline: float | None) -> bytes:
        buf = bytearray()
        while len(buf) < size:
            _wait(self.read_fd, select.POLLIN, deadline)
            try:
                chunk = os.read(self.read_fd, min(size - len(buf), _CHUNK))
            except BlockingIOError:
                continue
            if not chunk:
                raise EOFError("the other end closed the connection")
            buf += chunk
        return bytes(buf)


def _wait(fd: int, event: int, deadline: float | None) -> None:
    if fd < 0:
        raise OSError("the channel is closed")
    poller = select.poll()
    poller.register(fd, event)  # POLLHUP and POLLERR are reported too: read/write then says
    timeout_ms = None if deadline is None else max(0.0, deadline - time.monotonic()) * 1000
    if not poller.poll(timeout_ms):
        raise TimeoutError("no answer before the deadline")
