"""What the stuck-trajectory watchdog costs: whole-process CPU per durable trajectory with it
and without it, on benchmarks/cpu.py's workload (7 ops a trajectory into JSONL), each mode in
its own interpreter, its 1-trajectory run subtracted, minus the same loop untraced.

- ``off``: ``stuck_after_s=0`` (no watchdog; trace_attr still adds and removes the trajectory
  from the open set: two C calls);
- ``on``: the default ``stuck_after_s=600`` (a tick a second);
- ``on_fast``: ``stuck_after_s=0.5`` (a tick every 50 ms: the most it ever ticks).

    python -m benchmarks.bench_watchdog [--quick] [--json out.json]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from typing import Any

from benchmarks import cpu
from benchmarks.common import QUIET_ENV, ROOT, section_main


def _traced(stuck_after_s: float) -> Any:
    def mode(n: int, tmp: str) -> None:
        import tracer

        tracer.init(backend="jsonl", jsonl_path=f"{tmp}/ours.jsonl", spool_dir=f"{tmp}/spool",
                    stuck_after_s=stuck_after_s)  # fmt: skip
        generate, tool, reward = cpu.ours_ops()
        cpu._workload(n, generate, tool, reward,
                      lambda i: tracer.trace_attr(step=0, sample_index=i, rollout_n=0))  # fmt: skip
        assert tracer.flush(600)
        assert (tracer.get_tracer().watchdog is not None) == (stuck_after_s > 0)

    return mode


MODES = {"untraced": cpu.mode_untraced, "off": _traced(0.0), "on": _traced(600.0),
         "on_fast": _traced(0.5)}  # fmt: skip


def _child(mode: str, n: int) -> float:
    code = (
        "import time, tempfile, json; from benchmarks import bench_watchdog as b; "
        "tmp = tempfile.mkdtemp(); t0 = time.process_time(); "
        f"b.MODES[{mode!r}]({n}, tmp); print(json.dumps(time.process_time() - t0))"
    )
    env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=900, check=True)  # fmt: skip
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def run(quick: bool) -> dict[str, Any]:
    n = 300 if quick else 2000
    repeats = 2 if quick else 5
    per: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(repeats):  # interleaved: drift on a shared machine hits every mode alike
        for mode in MODES:
            per[mode].append(_child(mode, n) - _child(mode, 1))
    med = {m: statistics.median(v) for m, v in per.items()}
    us = {m: (med[m] - med["untraced"]) / n * 1e6 for m in ("off", "on", "on_fast")}
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    return {
        "n": n,
        "repeats": repeats,
        "load_average": float(load),
        "cpu_s": {m: [round(x, 3) for x in v] for m, v in per.items()},
        "us_per_durable_trajectory": {m: round(v, 1) for m, v in us.items()},
        "watchdog_extra_pct": round(100 * (us["on"] / us["off"] - 1), 2),
        "watchdog_fast_extra_pct": round(100 * (us["on_fast"] / us["off"] - 1), 2),
    }


if __name__ == "__main__":
    section_main(run)
