"""Run a backend's exports in a child process (``TraceConfig.export_in_subprocess``).

Export work (MLflow's ``log_spans`` is ~6 ms of Python per trajectory) holds the GIL; in the
rollout's process it competes with the rollout's own Python. The proxy keeps retries, spool
and replay in the parent's export worker and only moves the export into a child: the parent
sends the batch's JSON lines (the spool's bytes: nothing decoded or pickled record by record
in the rollout's process) onto the child's stdin and waits (without the GIL) for the answer;
the child reads them back as records, as a replay of the spool does.
A child that dies is a failed export (the batch stays in the spool) and is restarted on the
next one. The child is a plain ``python -m tracer.backends.subprocess_proxy``, not a
multiprocessing spawn, so the user's ``__main__`` is never re-imported.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import select
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any

import orjson

from tracer.backends.base import Exporter, ExportResult, as_exporter
from tracer.config import TraceConfig
from tracer.record import TrajectoryRecord

log = logging.getLogger("tracer")


def picklable(config: TraceConfig) -> TraceConfig:
    """The config without callables (the child never redacts: the parent already did)."""
    return dataclasses.replace(config, redact_callback=None)


class SubprocessExporter(Exporter):
    """An Exporter that forwards ``export`` to the same backend in a child process."""

    def __init__(self, name: str, config: TraceConfig, destination: str) -> None:
        self.name = name
        self.config = picklable(config)
        self.destination = destination  # the same spool folder as the in-process exporter
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._start()  # at init: a child that cannot start is an init error, like a backend

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _call(self, message: Any, timeout_s: float) -> Any:
        proc = self._proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        pickle.dump(message, proc.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready:
            raise TimeoutError(f"no answer in {timeout_s:.0f} s")
        return pickle.load(proc.stdout)

    def _start(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # same imports as here
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tracer.backends.subprocess_proxy"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
        )  # fmt: skip
        status, detail = self._call((self.name, self.config), max(60.0,
                                                                   self.config.export_timeout_s))
        if status != "ready":
            self._stop(kill=True)
            raise RuntimeError(f"export process for {self.name} failed to start: {detail}")

    def export(
        self, batch: Sequence[TrajectoryRecord], *, replay: bool = False
    ) -> ExportResult:
        return self._send(("records", list(batch), replay))

    def export_encoded(
        self, batch: Sequence[TrajectoryRecord], lines: Sequence[bytes], *, replay: bool = False
    ) -> ExportResult:
        return self._send(("lines", list(lines), replay))

    def _send(self, message: tuple[str, list[Any], bool]) -> ExportResult:
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._start()
                status, detail = self._call(message, self.config.export_timeout_s * 4 + 30)
            except (EOFError, OSError, TimeoutError, pickle.UnpicklingError) as exc:
                self._stop(kill=True)
                raise RuntimeError(f"export process for {self.name} died: {exc}") from exc
        if status != ExportResult.SUCCESS.value and detail:
            log.warning("rollout-tracer: export to %s (in its process) failed: %s",
                        self.name, detail)
        try:
            return ExportResult(status)
        except ValueError:
            return ExportResult.FAILURE

    def _stop(self, kill: bool = False, timeout_s: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if not kill and proc.poll() is None:
            try:
                assert proc.stdin is not None
                pickle.dump(None, proc.stdin)
                proc.stdin.flush()
                proc.wait(timeout_s)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        with self._lock:
            self._stop(timeout_s=timeout_s)


def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    from tracer.backends import create_exporter

    def answer(message: Any) -> None:
        pickle.dump(message, out, protocol=pickle.HIGHEST_PROTOCOL)
        out.flush()

    name, config = pickle.load(inp)
    try:
        exporter = as_exporter(create_exporter(name, config))
    except Exception as exc:
        answer(("error", f"{type(exc).__name__}: {exc}"))
        return
    answer(("ready", None))
    while True:
        try:
            message = pickle.load(inp)
        except EOFError:  # the parent is gone
            break
        if message is None:
            break
        kind, batch, replay = message
        try:
            if kind == "lines":
                lines, batch = batch, [_record(line) for line in batch]
                result = exporter.export_encoded(batch, lines, replay=replay)
            else:
                result = exporter.export(batch, replay=replay)
            answer((result.value, None))
        except Exception as exc:
            answer((ExportResult.FAILURE.value, f"{type(exc).__name__}: {exc}"))
    exporter.shutdown()


def _record(line: bytes) -> TrajectoryRecord:
    data = orjson.loads(line)
    return TrajectoryRecord.from_dict(data)


if __name__ == "__main__":
    # Our channel is the original stdout; anything the backend prints goes to stderr.
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(sys.stdin.buffer, channel)
