"""Where the test suite's CPU goes, test by test (issue #58: the suite under 10 minutes on 2 cores
is bounded by its CPU-seconds over 2, not by how the tests are spread over the workers).

As a pytest plugin it appends one JSON line per test to ``$SUITE_CPU_OUT`` (default
``suite-cpu.jsonl``): the test's id, its xdist worker, its wall seconds and the CPU-seconds of
the worker process (``self``) and of the children it reaped during the test (``children``),
and when it began (``start``, seconds since the epoch: the workers' timelines). The process
that runs the session (xdist's controller, or pytest itself with ``-n 0``) also appends, every
``SUITE_CPU_EVERY`` seconds (default 2), how busy the whole machine was (``/proc/stat``:
``busy`` and ``total`` jiffies since the last line). The machine's view counts what the tests'
process trees never reap (servers a fixture started and killed, daemons such as PostgreSQL's):
on 2026-12-06 the pytest tree was 153-157 % busy, the machine 189-192 %.
A fixture's setup counts for the first test that needs it; a server a fixture started counts
where it is stopped (reaped)::

    SUITE_CPU_OUT=/tmp/cpu.jsonl python -m pytest -p scripts.suite_cpu
    python scripts/suite_cpu.py /tmp/cpu.jsonl [--top 30]   # per file, costliest first
    python scripts/suite_cpu.py /tmp/cpu.jsonl --timeline 30  # the machine, 30 s at a time

CPU-seconds on a shared or throttled machine drift with its speed (a Python loop's time moved
1.4x within one session of 2026-12-06): compare two versions back to back, not across hours.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest


def _out() -> str:
    return os.environ.get("SUITE_CPU_OUT", "suite-cpu.jsonl")


def _write(row: dict[str, Any]) -> None:
    # one write per line, O_APPEND: the processes' lines do not interleave
    with open(_out(), "a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")


def _jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine so far; None without /proc/stat."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


class _Machine:
    """Samples the machine's busy jiffies every ``every`` seconds on a daemon thread of the
    session's process, until stopped (one last sample then)."""

    def __init__(self, every: float) -> None:
        self.every = every
        self.stop = threading.Event()
        self.last = _jiffies()
        self.since = time.time()
        self.thread = threading.Thread(target=self._run, name="suite-cpu-machine", daemon=True)

    def sample(self) -> None:
        now = _jiffies()
        if now is None or self.last is None:
            return
        busy, total = now[0] - self.last[0], now[1] - self.last[1]
        t = time.time()
        since, self.last, self.since = self.since, now, t
        if total > 0:
            _write({"machine": round(t, 3), "seconds": round(t - since, 3), "busy": busy,
                    "total": total, "cores": os.cpu_count() or 1})  # fmt: skip

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            self.sample()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sample()


_machine: _Machine | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _machine
    # an xdist worker has ``workerinput`` (its environment variable would also be set in a
    # pytest that a test of the suite starts): the controller samples for the session
    if hasattr(config, "workerinput") or _jiffies() is None:
        return
    _machine = _Machine(float(os.environ.get("SUITE_CPU_EVERY", "2")))
    _machine.thread.start()


def pytest_unconfigure(config: pytest.Config) -> None:
    global _machine
    if _machine is not None:
        _machine.close()
        _machine = None


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, reaped.ru_utime + reaped.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    own0, reaped0 = _cpu()
    began = time.time()
    start = time.monotonic()
    yield
    own1, reaped1 = _cpu()
    row = {"id": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
           "start": round(began, 3), "wall": round(time.monotonic() - start, 3),
           "self": round(own1 - own0, 3), "children": round(reaped1 - reaped0, 3)}  # fmt: skip
    _write(row)


def per_file(rows: list[dict[str, Any]]) -> list[tuple[str, float, float, float]]:
    """(file, CPU-s of the worker, CPU-s of reaped children, wall-s), costliest first."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for row in rows:
        s = sums[row["id"].split("::")[0]]
        s[0] += row["self"]
        s[1] += row["children"]
        s[2] += row["wall"]
    files = [(f, own, reaped, wall) for f, (own, reaped, wall) in sums.items()]
    return sorted(files, key=lambda r: -(r[1] + r[2]))


def timeline(rows: list[dict[str, Any]], width: float) -> list[tuple[float, float, list[str]]]:
    """Per ``width`` seconds from the first sample: (start, the machine's busy % of one core
    times the cores, i.e. 200 = both of 2 cores busy, the files of the tests running then)."""
    samples = [r for r in rows if "machine" in r]
    tests = [r for r in rows if "id" in r and "start" in r]
    if not samples:
        return []
    t0 = samples[0]["machine"] - samples[0]["seconds"]  # a sample closes its interval
    cores = samples[0]["cores"]
    buckets: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    for r in samples:
        b = buckets[int((r["machine"] - t0) // width)]
        b[0] += r["busy"]
        b[1] += r["total"]
    out = []
    for k in sorted(buckets):
        busy, total = buckets[k]
        lo, hi = t0 + k * width, t0 + (k + 1) * width
        running = sorted({r["id"].split("::")[0] for r in tests
                          if r["start"] < hi and r["start"] + r["wall"] > lo})  # fmt: skip
        out.append((k * width, 100 * cores * busy / total, running))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("jsonl", help="the file the plugin wrote")
    p.add_argument("--top", type=int, default=30, help="files to print (default 30)")
    p.add_argument("--timeline", type=float, metavar="SECONDS",
                   help="instead: the machine's busy %% per SECONDS and the files running")
    a = p.parse_args(argv)
    with open(a.jsonl, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if a.timeline:
        cores = next((r["cores"] for r in rows if "machine" in r), 1)
        print(f"the machine's busy % ({100 * cores} = all {cores} cores), per {a.timeline:g} s")
        for start, busy, running in timeline(rows, a.timeline):
            print(f"{start:7.0f} s {busy:5.0f} %  {' '.join(running)}")
        return 0
    tests = [r for r in rows if "id" in r]
    files = per_file(tests)
    total = sum(own + reaped for _, own, reaped, _ in files)
    print(f"{len(tests)} tests, {total:.0f} CPU-s inside tests (not the workers' starts)")
    print(f"{'CPU-s':>7} {'worker':>7} {'reaped':>7} {'wall-s':>7}  file")
    for name, own, reaped, wall in files[: a.top]:
        print(f"{own + reaped:7.1f} {own:7.1f} {reaped:7.1f} {wall:7.1f}  {name}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # no second error at exit's flush
        raise SystemExit(0) from None
