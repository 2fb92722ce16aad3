"""Where the test suite's CPU goes, test by test (issue #58: the suite under 10 minutes on 2 cores
is bounded by its CPU-seconds over 2, not by how the tests are spread over the workers).

As a pytest plugin it appends one JSON line per test to ``$SUITE_CPU_OUT`` (default
``suite-cpu.jsonl``): the test's id, its xdist worker, its wall seconds and the CPU-seconds of
the worker process (``self``) and of the children it reaped during the test (``children``),
and when it began (``start``, seconds since the epoch: the workers' timelines).
A fixture's setup counts for the first test that needs it; a server a fixture started counts
where it is stopped (reaped)::

    SUITE_CPU_OUT=/tmp/cpu.jsonl python -m pytest -p scripts.suite_cpu
    python scripts/suite_cpu.py /tmp/cpu.jsonl [--top 30]   # per file, costliest first

CPU-seconds on a shared or throttled machine drift with its speed (a Python loop's time moved
1.4x within one session of 2026-12-06): compare two versions back to back, not across hours.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest


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
    # one write per line, O_APPEND: the workers' lines do not interleave
    with open(os.environ.get("SUITE_CPU_OUT", "suite-cpu.jsonl"), "a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("jsonl", help="the file the plugin wrote")
    p.add_argument("--top", type=int, default=30, help="files to print (default 30)")
    a = p.parse_args(argv)
    with open(a.jsonl, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    files = per_file(rows)
    total = sum(own + reaped for _, own, reaped, _ in files)
    print(f"{len(rows)} tests, {total:.0f} CPU-s inside tests (not the workers' starts)")
    print(f"{'CPU-s':>7} {'worker':>7} {'reaped':>7} {'wall-s':>7}  file")
    for name, own, reaped, wall in files[: a.top]:
        print(f"{own + reaped:7.1f} {own:7.1f} {reaped:7.1f} {wall:7.1f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
