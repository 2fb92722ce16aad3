"""A TCP port that forwards to a server, until it is closed: then the port refuses connections
and every connection through it is reset, as when the server behind it is SIGKILLed.

The multinode fault scenarios use it for a server that goes away: the session's PostgreSQL-
backed MLflow server stands behind it, so no scenario pays ~8 s for a server of its own that it
only starts in order to kill it.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class Forward:
    """``Forward(("127.0.0.1", 5000))``: ``url`` reaches that server until ``close()``."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.open: list[socket.socket] = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self.lock:
                if self.closed:
                    client.close()
                    upstream.close()
                    return
                self.open += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """The port stops listening; open connections are reset (SO_LINGER 0), not drained."""
        with self.lock:
            self.closed = True
            conns, self.open = self.open, []
        self.listener.close()
        for s in conns:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)  # wakes the pump threads blocked in recv
            s.close()
