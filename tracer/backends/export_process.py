"""What runs in the export process: this module as ``__main__`` with the parent's pid, in an
isolated interpreter (``tracer.backends.child_launch``).

The parent (``tracer.backends.subprocess_proxy``) starts it in a session of its own and talks
to it over its stdin and stdout (``tracer.backends.pipe_channel``). It is the tracer's
machinery, not the user's, so:

- terminal signals are not for it: it is in no terminal's process group, and it ignores
  SIGINT, SIGTERM and SIGQUIT besides (a job manager that signals every process of a job), so it
  lives through the user's Ctrl-C and the parent's graceful shutdown exports through it;
- it dies with its parent: a parent-death signal (Linux; checked right after against the race
  with the parent's death), and EOF on its stdin when the parent closes it or is gone;
- it writes at most one line per event to stderr, never a traceback, and only the tracer's own
  lines: its libraries' logging (MLflow's "SQLAlchemy database error" with a traceback, urllib3's
  retries, alembic) stays here; an export's error reaches the parent as one detail string, and
  the parent's log says an outage once when it begins and once when it ends.

This module is the process's own: here it may set its signal dispositions and logging.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import signal
import sys
import threading
from typing import Any

from tracer.backends.base import ExportResult, as_exporter
from tracer.backends.pipe_channel import Channel
from tracer.record import TrajectoryRecord

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DETAIL_CHARS = 2000  # an error's text, as the parent gets it


def main(parent_pid: int) -> None:
    _ignore_terminal_signals()
    _die_with(parent_pid)
    _one_line_output(f"rollout-tracer export process (pid {os.getpid()})")
    # the channel is the original stdout; anything a backend prints goes to stderr instead
    channel = Channel(0, os.dup(1))
    os.dup2(2, 1)
    channel.send(("hello", os.getpid()), None)
    with contextlib.suppress(EOFError, OSError):  # the parent is gone: nobody to answer
        _serve(channel)


def _ignore_terminal_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)


def _die_with(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no libc prctl: EOF on stdin still ends us
            pass
    if os.getppid() != parent_pid:  # it died before the signal was armed
        os._exit(0)


def _serve(channel: Channel) -> None:
    from tracer.backends import create_exporter

    name, target, config = channel.recv(None)
    try:
        exporter = as_exporter(_make(name, target, config, create_exporter))
    except Exception as exc:
        channel.send(("error", _detail(exc), False), None)
        return
    # again: a library the backend imported may have set its own (polars, under MLflow, sets
    # a SIGINT handler in C)
    _ignore_terminal_signals()
    freeze_long_lived()
    _one_line_output(f"rollout-tracer export process for {name} (pid {os.getpid()})")
    channel.send(("ready", exporter.spool_key, False), None)  # names the parent's spool
    while True:
        message = channel.recv(None)
        if message is None:  # the parent's shutdown
            break
        answer = _export(exporter, message)
        _one_line_output.again()  # a library may have made a logger (and handler) just now
        channel.send(answer, None)
        gc.collect()  # the call's cycles, if any: its objects are gone, so this pass is short
    exporter.shutdown()


def freeze_long_lived() -> None:
    """Leave what the backend's start made (MLflow's and SQLAlchemy's modules: ~300,000
    objects) out of the garbage collector's passes: a batch makes enough containers to start a
    full pass every batch or two, and each pass walked all of them, for nothing: they live as
    long as the process. ``gc.freeze``, after one collection, is the standard library's tool
    for this.

    Then no automatic passes at all: the objects a call makes live until it ends (a batch's
    records, views and rows, ~100 containers a trace) and die with it by reference counting,
    but the automatic passes walked them over and over while the call ran (a pass every 700
    containers, a longer one every ten: ~45 us a trace of a 20-span batch, a twelfth of this
    process's time). One pass after each call collects whatever cycles the call left, when
    little is alive. This process is the tracer's own: the user's process is never frozen, and
    its collector is never switched off."""
    gc.collect()
    gc.freeze()
    gc.disable()


def _make(name: str, target: str | None, config: Any, create: Any) -> Any:
    """The backend the parent has, from its import path when the parent registered one."""
    if target is None:
        return create(name, config)
    import importlib

    module, _, qualname = target.partition(":")
    factory: Any = importlib.import_module(module)
    for attr in qualname.split("."):  # a class inside a class: "module:Outer.Inner"
        factory = getattr(factory, attr)
    return factory(config)


def _export(exporter: Any, message: tuple[str, list[Any], bool]) -> tuple[str, Any, bool]:
    """(result, the error's text or None, whether the error says the backend is out of reach)."""
    from tracer.outage import is_outage

    kind, batch, replay = message
    try:
        if kind == "lines":
            lines, batch = batch, [_record(line) for line in batch]
            result = exporter.export_encoded(batch, lines, replay=replay)
        else:
            result = exporter.export(batch, replay=replay)
        return result.value, None, False
    except Exception as exc:
        return ExportResult.FAILURE.value, _detail(exc), is_outage(exc) or store_unavailable(exc)


def store_unavailable(exc: BaseException) -> bool:
    """Whether the store behind the backend said "not now": MLflow turns a database's
    OperationalError (a dropped or refused connection, a cancelled statement) into an
    MlflowException with error code TEMPORARILY_UNAVAILABLE. An outage, as a server's 503."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain is short; a cycle must not hang us
        if seen is None:
            return False
        if getattr(seen, "error_code", None) == "TEMPORARILY_UNAVAILABLE":
            return True
        if type(seen).__name__ == "OperationalError":  # sqlalchemy.exc, psycopg2, sqlite3
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _record(line: bytes) -> TrajectoryRecord:
    from tracer.encode import decode_record

    return decode_record(line)


def _detail(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return text[:DETAIL_CHARS]


class OneLine(logging.Formatter):
    """A record as one line: the message's first line and, for an exception, its last line."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        text = " ".join(record.getMessage().split())
        if record.exc_info and record.exc_info[1] is not None:
            text += f" ({_detail(record.exc_info[1])})"
        return f"{self.prefix}: {record.levelname} {record.name}: {text}"[:DETAIL_CHARS]


def ours(record: logging.LogRecord) -> bool:
    """Whether a log record is the tracer's own (the only ones this process lets through)."""
    return record.name == "tracer" or record.name.startswith("tracer.")


class _OneLineOutput:
    """Every logger's handlers write the tracer's own records only, one line each, at WARNING
    and above (a backend's import adds its own handlers, and a library may add one later:
    :meth:`again` looks once more, before any record is handled, when the number of loggers
    changed); an uncaught exception or a warning is one line too. This process is the
    tracer's own: its logging is set here, never the user's."""

    def __init__(self) -> None:
        self.formatter: OneLine | None = None
        self.seen = 0

    def __call__(self, prefix: str) -> None:
        self.formatter = OneLine(prefix)
        logging.basicConfig(level=logging.WARNING, force=True)
        self.seen = -1
        self.again()
        logging.captureWarnings(True)

        def excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
            print(f"{prefix}: {_detail(exc)}", file=sys.stderr, flush=True)

        def thread_excepthook(args: Any) -> None:
            if args.exc_value is not None:
                excepthook(args.exc_type, args.exc_value, args.exc_traceback)

        def unraisablehook(args: Any) -> None:
            if args.exc_value is not None:
                excepthook(type(args.exc_value), args.exc_value, None)

        sys.excepthook = excepthook
        threading.excepthook = thread_excepthook
        sys.unraisablehook = unraisablehook
        # a record of a logger made since the last look (a backend's import, then its first
        # lines: MLflow's "Creating initial MLflow database tables...") passes the filter first
        handle = logging.Logger.handle

        def handle_ours(logger: logging.Logger, record: logging.LogRecord) -> None:
            self.again()
            handle(logger, record)

        logging.Logger.handle = handle_ours  # type: ignore[method-assign,assignment]

    def again(self) -> None:
        loggers = logging.root.manager.loggerDict
        if self.formatter is None or len(loggers) == self.seen:
            return
        self.seen = len(loggers)
        for logger in [logging.getLogger(), *loggers.values()]:
            if not isinstance(logger, logging.Logger):
                continue
            for handler in logger.handlers:
                handler.setFormatter(self.formatter)
                handler.setLevel(max(handler.level, logging.WARNING))
                if ours not in handler.filters:
                    handler.addFilter(ours)


_one_line_output = _OneLineOutput()


if __name__ == "__main__":
    main(int(sys.argv[1]))
