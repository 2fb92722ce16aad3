"""PostgreSQL's CPU a trace by two clocks: the kernel's tick counts and its scheduler's run time.

The ingest benchmark reads PostgreSQL's CPU from ``/proc/PID/stat`` (utime and stime, in
clock ticks; ``benchmarks.ingest_procs.tree_cpu_s``). This reads, beside them, each process's
scheduler run time (``/proc/PID/schedstat``, nanoseconds), for runs of 1 writer and of N
writers at once into a throwaway cluster: if the two clocks agree, the tick counts are
PostgreSQL's own work, and a difference between 1 writer and N is PostgreSQL's.

A backend ends with its writer's connection, and its counts go with it (into the
postmaster's counts of reaped children, which have no run-time twin), so a sampler thread
reads every PostgreSQL process every 10 ms and keeps each one's first and last readings.

    python -m benchmarks.pg_counts [--plan 1x2400,8x300,8x300e,1x2400,8x300,8x300e]

``--plan``: runs in order, each ``WRITERSxTRACES`` (traces a writer) into one experiment, as a
job's workers write, or with an ``e`` after it each writer into its own experiment; writers
pinned to CPU 0, PostgreSQL to CPU 1, as ``benchmarks.ingest --pin`` does. It also prints the
multixacts PostgreSQL made (``pg_stat_slru``'s MultiXactOffset blocks hit): several
transactions that share-lock one row at once (every foreign-key check of a ``trace_info``,
``spans`` or ``assessments`` row share-locks its experiment's row) make one.
"""

from __future__ import annotations

import argparse
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from benchmarks.ingest_procs import children, run_writers, stat_cpu_s


def cpu_clocks(pid: int) -> tuple[float, float]:
    """(its own utime + stime from ``/proc/PID/stat``, its run time from ``schedstat``) of one
    process, in seconds; OSError when it is gone."""
    run_ns = int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    return stat_cpu_s(pid, reaped=False), run_ns / 1e9


class Sampler:
    """Reads ``cpu_clocks`` of the processes ``pids()`` names every ``every_s`` from
    ``start()`` to ``stop()``, keeping each one's first and last readings (a process that
    exits keeps its last)."""

    def __init__(self, pids: Callable[[], list[int]], every_s: float = 0.01) -> None:
        self.pids = pids
        self.every_s = every_s
        self.first: dict[int, tuple[float, float]] = {}
        self.last: dict[int, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pg-counts", daemon=True)

    def start(self) -> None:
        self._read()
        self._thread.start()

    def stop(self) -> tuple[float, float]:
        """Stop; (CPU seconds by ticks, by run time) summed over every process seen."""
        self._stop.set()
        self._thread.join()
        self._read()
        ticks = sum(self.last[p][0] - self.first[p][0] for p in self.last)
        run = sum(self.last[p][1] - self.first[p][1] for p in self.last)
        return ticks, run

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._read()

    def _read(self) -> None:
        for pid in self.pids():
            try:
                reading = cpu_clocks(pid)
            except (OSError, ValueError, IndexError):
                continue
            self.first.setdefault(pid, reading)
            self.last[pid] = reading


def _multixact_blocks(uri: str) -> int:
    from benchmarks.ingest_profile import _sql

    [(hit,)] = _sql(uri, "SELECT blks_hit FROM pg_stat_slru WHERE name = 'MultiXactOffset'")
    return int(hit)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.postgres import postgres_available, temporary_cluster

    p = argparse.ArgumentParser(prog="python -m benchmarks.pg_counts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default="1x2400,8x300,8x300e,1x2400,8x300,8x300e")
    a = p.parse_args(argv)
    if why := postgres_available():
        print(f"skipped: {why}")
        return 0
    plan = a.plan.split(",")
    with temporary_cluster(*[f"counts{i}" for i in range(len(plan))]) as cluster:
        pg = cluster.postmaster_pid()
        subprocess.run(["taskset", "-a", "-cp", "1", str(pg)], check=True, capture_output=True)
        print("run        ms a trace: /proc ticks   run time   processes   multixact blocks")
        for i, run in enumerate(plan):
            own = run.endswith("e")
            count, n = (int(x) for x in run.rstrip("e").split("x"))
            sampler = Sampler(lambda: [pg, *children(pg)])
            args = [[cluster.uris[i], f"counts{k}" if own else "counts", str(n), f"w{k}", "0",
                     "0"] for k in range(count)]  # fmt: skip
            blocks = _multixact_blocks(cluster.uris[i])
            run_writers(args, pin="0", timeout_s=600, on_ready=sampler.start)
            ticks, cpu = sampler.stop()
            blocks = _multixact_blocks(cluster.uris[i]) - blocks
            traces = count * n
            print(f"{run:10s} {ticks * 1e3 / traces:21.3f} {cpu * 1e3 / traces:10.3f}"
                  f" {len(sampler.last):11d} {blocks:18d}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
