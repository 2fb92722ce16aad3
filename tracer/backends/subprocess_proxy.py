"""Run a backend's exports in a child process (``TraceConfig.export_in_subprocess``).

Export work (MLflow's ``log_spans`` is ~2 ms of Python per trajectory) holds the GIL; in the
rollout's process it competes with the rollout's own Python. The proxy keeps retries, spool
and replay in the parent's export worker and only moves the export into a child: the parent
sends the batch's JSON lines (the spool's bytes: nothing decoded or pickled record by record
in the rollout's process) and waits (without the GIL) for the answer; the child reads them back
as records, as a replay of the spool does. The child is a plain interpreter running
``tracer.backends.export_process`` (started as ``tracer.backends.child_launch`` says: isolated
from the user's folder, by a thread that lives as long as the process), not a multiprocessing
spawn, so the user's ``__main__`` is never re-imported; what it does on its side is in that
module.

The child is the tracer's machinery, and a user should never notice it:
- it runs in a session of its own and ignores terminal signals, so the user's Ctrl-C does not
  reach it and the graceful shutdown that follows exports through it;
- it dies with its process (a parent-death signal, armed from a thread that lives as long as
  the process, and EOF on its stdin); a start that fails kills its whole process group;
- every call has a deadline (``tracer.backends.pipe_channel``: poll, any fd number), and any
  failure of a call counts as a dead child: it is killed and reaped, the batch stays in the
  spool (the export worker wrote it there first), and the next export starts another;
- a forked process closes its copies of the pipes (those of a start in progress too) and starts
  its own child at its first export, on its export worker's thread, under the same settings;
- at shutdown a child that does not answer in time is killed (``abort``);
- its libraries' log lines (MLflow's "SQLAlchemy database error") stay in it: an outage is one
  line in the parent's log (``tracer.outage``), not the child's tracebacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

from tracer.backends import child_launch
from tracer.backends.base import BackendStartError, Exporter, ExportResult, as_exporter
from tracer.backends.pipe_channel import Channel
from tracer.config import TraceConfig
from tracer.errors import log_every
from tracer.record import TrajectoryRecord

log = logging.getLogger("tracer")

START_TIMEOUT_S = 10.0  # for the child to say hello: the interpreter runs our module
STOP_TIMEOUT_S = 5.0  # for the child to end after the parent's goodbye
HELLO_MAX_BYTES = 1 << 10  # a hello is a few bytes: anything else is not our child talking

_live: weakref.WeakSet[SubprocessExporter] = weakref.WeakSet()


class ExportProcessError(RuntimeError):
    """The backend's export raised in the export process: its type and text."""


class ExportProcessOutage(ConnectionError):
    """The same, for an error that says the backend is out of reach now (``tracer.outage``)."""


class ExportProcessLost(ConnectionError):
    """The export process died, missed its deadline or could not start: it was killed, and the
    next export starts another."""


def picklable(config: TraceConfig) -> TraceConfig:
    """The config without callables (the child neither redacts nor keeps: the parent did)."""
    return dataclasses.replace(config, redact_callback=None, keep_predicate=None)


def python_executable() -> str:
    """The Python to start the child with: ``sys.executable``, else ``multiprocessing``'s
    (``multiprocessing.set_executable`` names one in an embedding host), when its file name
    says it is a Python. Another host's binary (uWSGI) is never started with ``-m``."""
    import multiprocessing.spawn

    for path in (sys.executable, multiprocessing.spawn.get_executable()):
        if not path:
            continue
        path = os.fsdecode(path)
        name = os.path.basename(path).lower()
        if name.startswith(("python", "pypy")) and os.access(path, os.X_OK):
            return path
    raise RuntimeError(
        f"sys.executable ({sys.executable!r}) is not a Python interpreter (an embedding host?); "
        "multiprocessing.set_executable(path) can name one"
    )


class SubprocessExporter(Exporter):
    """An Exporter that forwards ``export`` to the same backend in a child process. With
    ``start=False`` (a forked process) the child starts at the first export; if it cannot,
    that process exports in-process, with one warning, unless ``export_in_subprocess=True``.
    The child gets the lines; the records are read only to export in this process."""

    lines_suffice = True

    def __init__(
        self, name: str, config: TraceConfig, destination: str, *, start: bool = True,
        required: bool | None = None,
    ) -> None:
        self.name = name
        self.config = picklable(config)
        self.destination = destination  # the same spool folder as the in-process exporter
        self.starts = 0  # children started
        self.losses = 0  # children killed or found dead
        # ``required``: the parent's resolved export_in_subprocess (the field, or the variable
        # ROLLOUT_TRACER_EXPORT_IN_SUBPROCESS), so a fork honours what its parent was told
        if required is None:
            required = bool(config.export_in_subprocess)
        self._may_fall_back = not start and not required
        self._local: Exporter | None = None  # the in-process exporter, after a fall back
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: Channel | None = None
        self._aborted = False  # abort() killed it and said so
        # how the child makes the backend; a callable it cannot import is refused here, at init
        self._target = _import_path(name)
        _live.add(self)
        if start:
            self._start()  # at init: a child that cannot start is an init error, like a backend

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return proc.pid if proc is not None else None

    # the export calls ---------------------------------------------------------------------
    def export(
        self, batch: Sequence[TrajectoryRecord], *, replay: bool = False
    ) -> ExportResult:
        return self._send(("records", list(batch), replay), batch)

    def export_encoded(
        self, batch: Sequence[TrajectoryRecord], lines: Sequence[bytes], *, replay: bool = False
    ) -> ExportResult:
        return self._send(("lines", list(lines), replay), batch)

    def _send(self, message: tuple[str, list[Any], bool],
              batch: Sequence[TrajectoryRecord]) -> ExportResult:  # fmt: skip
        with self._lock:
            if self._aborted:  # a call that began after shutdown's abort starts no new child
                raise ExportProcessLost(f"the export process for {self.name} was stopped at "
                                        "shutdown")  # fmt: skip
            if self._local is None and not self._running():
                self._start_or_fall_back()
            if self._local is not None:
                return self._local.export([r.materialize() for r in batch], replay=message[2])
            channel = self._channel
            assert channel is not None
            deadline = time.monotonic() + self.config.export_timeout_s * 4 + 30
            try:
                channel.send(message, deadline)
                status, detail, outage = channel.recv(deadline)
            except BaseException as exc:  # whatever it was, this child is done
                why = "missed its deadline" if isinstance(exc, TimeoutError) else (
                    f"failed ({type(exc).__name__}: {exc})")  # fmt: skip
                self._lose(why)
                if not isinstance(exc, Exception):
                    raise
                raise ExportProcessLost(f"the export process for {self.name} {why}") from exc
        if detail:
            raise (ExportProcessOutage if outage else ExportProcessError)(detail)
        try:
            return ExportResult(status)
        except ValueError:
            return ExportResult.FAILURE

    def _running(self) -> bool:
        """Whether the child is there to call; one that died while idle is reaped and said."""
        proc = self._proc
        if proc is None:
            return False
        if proc.poll() is None:
            return True
        self._lose(_exit_reason(proc.returncode))
        return False

    def _start_or_fall_back(self) -> None:
        try:
            self._start()
        except Exception as exc:
            if not self._may_fall_back:
                raise ExportProcessLost(
                    f"the export process for {self.name} could not start: {exc}") from exc
            from tracer.backends import create_exporter

            self._local = as_exporter(create_exporter(self.name, self.config))
            log.warning("rollout-tracer: %s exports from this process: its export process "
                        "did not start (%s: %s)", self.name, type(exc).__name__, exc)  # fmt: skip
        self._may_fall_back = False

    # the child's life -----------------------------------------------------------------------
    def _start(self) -> None:
        exe = python_executable()
        from_child, to_parent, from_parent, to_child = child_launch.pipes()
        try:
            proc = child_launch.popen(
                child_launch.command(exe, os.getpid()), START_TIMEOUT_S,
                stdin=from_parent, stdout=to_parent, start_new_session=True,
            )  # fmt: skip
        except BaseException:
            child_launch.release(from_child, to_child, close=True)
            raise
        finally:
            child_launch.release(from_parent, to_parent, close=True)
        self._proc, self._channel = proc, Channel(from_child, to_child)
        child_launch.release(from_child, to_child, close=False)  # the channel's now
        self.starts += 1
        not_ours = (f"{exe} did not start the export process: no Python answered as its own "
                    "child (a wrapper script that runs Python without `exec`?); name a Python "
                    "interpreter with multiprocessing.set_executable(path)")  # fmt: skip
        try:
            try:
                hello = self._channel.recv(time.monotonic() + START_TIMEOUT_S, HELLO_MAX_BYTES)
            except TimeoutError:
                raise TimeoutError(f"{exe} did not start the export process within "
                                   f"{START_TIMEOUT_S:.0f} s") from None  # fmt: skip
            except (EOFError, OSError, ValueError) as exc:  # it ended, or wrote something else
                raise RuntimeError(f"{not_ours} ({type(exc).__name__}: {exc})") from None
            if hello != ("hello", proc.pid):
                raise RuntimeError(not_ours)
            # the backend's own start (MLflow's import): as long as it may take in process
            deadline = time.monotonic() + max(60.0, 2 * self.config.export_timeout_s)
            self._channel.send((self.name, self._target, self.config), deadline)
            status, detail, _ = self._channel.recv(deadline)
            if status != "ready":
                raise BackendStartError(detail)
            if not self.destination and isinstance(detail, str):  # made there only: its name
                self.destination = detail
        except BaseException:
            self._kill()
            raise

    def _lose(self, why: str) -> None:
        """The child died or failed a call: kill and reap it, one line in the log."""
        pid = self.pid
        self._kill()
        self.losses += 1
        if not self._aborted and log_every(self.losses):
            log.warning("rollout-tracer: the export process for %s (pid %s) %s; the batch stays "
                        "in the spool and the next export starts another [%d so far]",
                        self.name, pid, why, self.losses)  # fmt: skip

    def _kill(self) -> None:
        proc, channel = self._proc, self._channel
        self._proc = self._channel = None
        try:
            if proc is not None:
                child_launch.kill_group(proc)  # a no-op once it is reaped
                # stuck in the kernel past this: Popen reaps it later
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(STOP_TIMEOUT_S)
        finally:
            if channel is not None:
                channel.close()

    def _forget_after_fork(self) -> None:
        """In a forked process: the child is the parent's. Close this process's copies of its
        pipes (the child sees EOF when its parent is gone) and never signal it."""
        self._lock = threading.Lock()
        channel, self._channel, self._proc = self._channel, None, None
        if channel is not None:
            channel.close()

    # control ------------------------------------------------------------------------------
    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        with self._lock:
            if self._local is not None:
                self._local.shutdown(timeout_s)
            proc, channel = self._proc, self._channel
            if proc is None or channel is None:
                return
            deadline = time.monotonic() + min(timeout_s, STOP_TIMEOUT_S)
            try:
                if proc.poll() is None:
                    channel.send(None, deadline)  # goodbye: the child shuts its backend down
                    proc.wait(max(0.0, deadline - time.monotonic()))
            except (OSError, TimeoutError, subprocess.TimeoutExpired):
                pass
            finally:
                self._kill()  # still there after the deadline: killed

    def abort(self) -> bool:
        """Shutdown's deadline passed during an export call (another thread's): kill the child
        so that the call ends; its batch stays in the spool. No call starts another child
        after this (the worker may be just about to call: it must not export after shutdown
        said its batches wait in the spool)."""
        self._aborted = True
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return False
        log.warning("rollout-tracer: the export process for %s (pid %d) did not answer before "
                    "the shutdown deadline; it was killed", self.name, proc.pid)  # fmt: skip
        child_launch.kill_group(proc)
        return True


def _import_path(name: str) -> str | None:
    """How the child makes the backend: its "module:Factory" path as registered here, or the
    import path of a callable registered here (a class or function at the top of a module the
    child can import); None for a name the registry does not hold (the child looks it up).
    Raises ``ConfigError`` for a callable the child cannot import."""
    from tracer.backends import available_backends

    target = available_backends().get(name)
    if target is None or isinstance(target, str):
        return target
    path = callable_import_path(target)
    if path is None:
        from tracer.config import ConfigError

        raise ConfigError(
            f"backend {name!r} is registered as {target!r}, which the export process cannot "
            "import (defined in __main__ or inside a function); register it as "
            "'module:Factory' from a module beside your script, or set "
            "export_in_subprocess=False")  # fmt: skip
    return path


def callable_import_path(target: Any) -> str | None:
    """``module:qualname`` of a class or function another interpreter can import to get the
    very same object; None for one defined in ``__main__`` (the child never runs the user's
    script), inside a function, or a lambda."""
    import importlib

    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    if module == "__main__" or "<" in qualname:
        return None
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if found is target else None


def _exit_reason(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        return f"was killed (signal {-returncode})"
    return f"exited (status {returncode})"


def _forget_children_after_fork() -> None:
    for exporter in list(_live):
        exporter._forget_after_fork()


os.register_at_fork(after_in_child=_forget_children_after_fork)
