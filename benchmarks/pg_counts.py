"""PostgreSQL's CPU a trace by two clocks: the kernel's tick counts and its scheduler's run time.

The ingest benchmark reads PostgreSQL's CPU from ``/proc/PID/stat`` (utime and stime, in
clock ticks; ``benchmarks.ingest_procs.tree_cpu_s``). This reads, beside them, each process's
scheduler run time (``/proc/PID/schedstat``, nanoseconds), for runs of 1 writer and of N
writers at once into a throwaway cluster: if the two clocks agree, the tick counts are
PostgreSQL's own work, and a difference between 1 writer and N is PostgreSQL's.

A backend ends with its writer's connection, and its counts go with it (into the
postmaster's counts of reaped children, which have no run-time twin), so a sampler thread
reads every PostgreSQL process every 10 ms and keeps each one's first and last readings.

    python -m benchmarks.pg_counts [--plan 1x2400,8x300,1x2400,8x300]

``--plan``: runs in order, each ``WRITERSxTRACES`` (traces a writer); writers pinned to CPU 0,
PostgreSQL to CPU 1, as ``benchmarks.ingest --pin`` does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import threading
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_clocks(pid: int) -> tuple[float, float]:
    """(utime + stime from ``/proc/PID/stat`` in seconds, run time from ``schedstat`` in
    seconds) of one process; OSError when it is gone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    run_ns = int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    return (int(fields[11]) + int(fields[12])) / _TICK, run_ns / 1e9


class Sampler:
    """Reads ``cpu_clocks`` of the processes ``pids()`` names every ``every_s`` while armed,
    keeping each one's first and last readings (a process that exits keeps its last)."""

    def __init__(self, pids: object, every_s: float = 0.01) -> None:
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
        for pid in self.pids():  # type: ignore[operator]
            try:
                reading = cpu_clocks(pid)
            except (OSError, ValueError, IndexError):
                continue
            self.first.setdefault(pid, reading)
            self.last[pid] = reading


def main(argv: list[str] | None = None) -> int:
    from benchmarks.ingest_procs import children, run_writers
    from benchmarks.postgres import postgres_available, temporary_cluster

    p = argparse.ArgumentParser(prog="python -m benchmarks.pg_counts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", default="1x2400,8x300,1x2400,8x300")
    a = p.parse_args(argv)
    if why := postgres_available():
        print(f"skipped: {why}")
        return 0
    plan = [tuple(int(x) for x in run.split("x")) for run in a.plan.split(",")]
    with temporary_cluster(*[f"counts{i}" for i in range(len(plan))]) as cluster:
        pg = cluster.postmaster_pid()
        subprocess.run(["taskset", "-a", "-cp", "1", str(pg)], check=True, capture_output=True)
        print("writers x traces   ms a trace: /proc ticks   scheduler run time   processes")
        for i, (count, n) in enumerate(plan):
            sampler = Sampler(lambda: [pg, *children(pg)])
            args = [[cluster.uris[i], f"counts{count}", str(n), f"w{k}", "0", "0"]
                    for k in range(count)]  # fmt: skip
            run_writers(args, pin="0", timeout_s=600, on_ready=sampler.start)
            ticks, run = sampler.stop()
            traces = count * n
            print(f"{count:7d} x {n:<6d} {ticks * 1e3 / traces:21.3f} {run * 1e3 / traces:20.3f}"
                  f" {len(sampler.last):11d}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
