"""A TCP port that forwards to a server, until it is closed: then the port refuses connections
and every connection through it is reset, as when the server behind it is SIGKILLed.

The multinode fault scenarios and the server-outage tests use it for a server that goes away:
the session's MLflow server stands behind it, so no test pays ~8 s of CPU for a server of its
own that it only starts in order to kill it (a real SIGKILL and restart: tests/test_chaos.py,
the multinode "server_restart" scenario).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading


class Forward:
    """``Forward(("127.0.0.1", 5000))``: ``url`` reaches that server until ``close()``;
    ``port``: listen there (a port an earlier, closed Forward had: the server is back)."""

    def __init__(self, target: tuple[str, int], port: int = 0) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", port))
        self.port = int(self.listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.open: list[socket.socket] = []
        self.closed = False
        self.acceptor = threading.Thread(target=self._accept, daemon=True)
        self.acceptor.start()

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
        # shutdown first: close() alone leaves a listener that a thread is blocked in accept()
        # on in LISTEN (the blocked call holds it), still taking connections and its port
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.acceptor.join(10)
        for s in conns:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)  # wakes the pump threads blocked in recv
            s.close()


class Outage:
    """A tracking server's address that goes away and comes back, in front of ``url`` (the
    session's server): ``down()`` closes the port (connections reset, new ones refused),
    ``up()`` listens on the same port again. ``url`` stays the same throughout."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
        self.target = (host, int(port))
        self.forward: Forward | None = Forward(self.target)
        self.port = self.forward.port
        self.url = self.forward.url

    def down(self) -> None:
        if self.forward is not None:
            self.forward.close()
            self.forward = None

    def up(self) -> None:
        assert self.forward is None, "already up"
        self.forward = Forward(self.target, port=self.port)
