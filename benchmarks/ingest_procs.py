"""The processes of the ingest benchmark: writer processes started together, each in a process
group of its own, all stopped when one fails; CPU seconds of process trees from /proc.

A writer that exits non-zero, or does not finish in time, stops the others (SIGTERM to each
group, SIGKILL after a grace period) and raises; nothing it started is left behind (the
tracer's export child dies with its parent). ``leftovers`` says which writer processes are
still alive, so the benchmark can show that none is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import QUIET_ENV, ROOT

MARKER = "benchmarks.ingest --writer"
_TICK = os.sysconf("SC_CLK_TCK")


class WriterFailed(RuntimeError):
    pass


def run_writers(
    args: list[list[str]],
    *,
    pin: str | None,
    timeout_s: float,
    on_start: Callable[[int], object] = lambda pid: None,
    on_ready: Callable[[], object] = lambda: None,
) -> list[dict[str, Any]]:
    """One writer process per argument list (``python -m benchmarks.ingest --writer ARGS``);
    their JSON results. Each says "ready" once started (imports, tracer, export child): the
    work begins when all are, on one "go" line to each. ``pin``: a CPU list for ``taskset``."""
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(ROOT)}
    prefix = ["taskset", "-c", pin] if pin else []
    procs: list[subprocess.Popen[str]] = []
    tag = f"run{os.getpid()}"  # in every writer's command line: how leftovers() finds them
    work = tempfile.mkdtemp(prefix="ingest-")  # each writer's working folder (and spool) in it
    try:
        for a in args:
            procs.append(
                subprocess.Popen(
                    [*prefix, sys.executable, "-m", "benchmarks.ingest", "--writer", *a, tag],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                    cwd=tempfile.mkdtemp(prefix="writer-", dir=work),
                    start_new_session=True,  # its own group: stopped as a whole
                )
            )
            on_start(procs[-1].pid)
        for i, p in enumerate(procs):
            assert p.stdout is not None and p.stdin is not None
            if p.stdout.readline().strip() != "ready":  # it exited before its start
                p.wait()
                err = p.stderr.read() if p.stderr else ""
                raise WriterFailed(f"writer {i} failed to start ({p.returncode}): {err[-2000:]}")
        on_ready()  # every writer started: the measured work begins
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        deadline = time.monotonic() + timeout_s
        results: list[dict[str, Any]] = []
        for i, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise WriterFailed(f"writer {i} did not finish in {timeout_s:.0f} s") from None
            if p.returncode != 0:
                raise WriterFailed(f"writer {i} exited {p.returncode}: {err[-2000:]}")
            result = json.loads(out.strip().splitlines()[-1])
            result["stderr"] = err
            results.append(result)
        return results
    finally:
        stop_groups(procs)
        shutil.rmtree(work, ignore_errors=True)


def stop_groups(procs: list[subprocess.Popen[str]], grace_s: float = 5.0) -> None:
    """SIGTERM to every writer's group still running, SIGKILL to what is left after ``grace_s``."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def leftovers() -> list[int]:
    """Process ids of writer processes still alive (any user), by their command line."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if MARKER in cmd and f"run{os.getpid()}" in cmd:
                found.append(int(entry.name))
    return found


def stat_cpu_s(pid: int, reaped: bool = True) -> float:
    """CPU seconds of one process by ``/proc/PID/stat``'s tick counts: its own, and with
    ``reaped`` its reaped children's (the kernel adds them to cutime/cstime). OSError when
    it is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # after the command: state(0) ... utime(11) stime(12) cutime(13) cstime(14)
    return sum(int(x) for x in fields[11 : 15 if reaped else 13]) / _TICK


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its descendants: its own, its reaped children's, and
    those of its live children, recursively."""
    try:
        total = stat_cpu_s(pid)
    except OSError:
        return 0.0
    return total + sum(tree_cpu_s(child) for child in children(pid))


def children(pid: int) -> list[int]:
    """The live children of ``pid``, those of every thread: the export child is started by
    the tracer's launcher thread, so it is listed under that thread's task, not the main
    thread's."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found
