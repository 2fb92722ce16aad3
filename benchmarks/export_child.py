"""The MLflow export child against the export in the rollout's process: what each costs the
rollout's process (docs/backends.md#the-export-child).

Each run is a fresh interpreter (the child's `init` includes its imports, the in-process one
the parent's), tracing N trajectories of 4 ops into an MLflow sqlite store, then
``tracer.shutdown()``. Per mode: `init`'s wall time; the parent's CPU (its own threads, not the
child's) from the first op until durable, per 1,000 trajectories; the wall time from the first
op until durable (the child's stop included); the export child's peak RSS.

    python -m benchmarks.export_child --n 1000 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {"child": None, "in process": False}  # export_in_subprocess: None is the default


def one_run(in_subprocess: bool | None, n: int, folder: str) -> dict[str, float]:
    """In this interpreter: init, N trajectories, shutdown; the figures of one run."""
    import tracer

    t0 = time.perf_counter()
    tracer.init({"backend": "mlflow", "tracking_uri": f"sqlite:///{folder}/mlflow.db",
                 "export_in_subprocess": in_subprocess, "flush_interval_s": 0.2})  # fmt: skip
    init_s = time.perf_counter() - t0

    @tracer.trace_op(kind="generate")
    def generate(prompt: str) -> dict[str, str]:
        return {"response_text": f"<tool_call>add(2, 3)</tool_call> {prompt}"}

    @tracer.trace_op(kind="tool")
    def add(a: int, b: int) -> str:
        return str(a + b)

    @tracer.trace_op(kind="reward")
    def reward(answer: str, truth: str) -> float:
        return float(answer == truth)

    cpu0, first = time.process_time(), time.perf_counter()
    for i in range(n):
        with tracer.trace_attr(step=i // 64, sample_index=i % 64):
            generate(f"What is 2 + 3? ({i})")
            reward(add(2, 3), "5")
            generate("and then?")
    assert tracer.shutdown(120), "not durable within 120 s"
    return {"init_s": init_s, "durable_s": time.perf_counter() - first,
            "parent_cpu_per_1000_s": (time.process_time() - cpu0) * 1000 / n,
            # the largest child this process waited for: the export child, once it has ended
            "child_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.export_child", description=__doc__)
    ap.add_argument("--n", type=int, default=1000, help="trajectories a run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode, interleaved")
    ap.add_argument("--one", choices=list(MODES), help=argparse.SUPPRESS)  # a run, in a child
    args = ap.parse_args(argv)
    if args.one:
        with tempfile.TemporaryDirectory() as folder:
            print(json.dumps(one_run(MODES[args.one], args.n, folder)))
        return 0
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root}
    for _ in range(args.repeats):
        for mode in MODES:  # interleaved: the machine's noise hits both
            out = subprocess.run([sys.executable, "-m", "benchmarks.export_child", "--one", mode,
                                  "--n", str(args.n)], env=env, cwd=root, capture_output=True,
                                 text=True, check=True)  # fmt: skip
            runs[mode].append(json.loads(out.stdout.splitlines()[-1]))
    print(f"{args.n} trajectories of 4 ops a run, {args.repeats} runs a mode; load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| | " + " | ".join(MODES) + " |\n|---|" + "---|" * len(MODES))
    for key in ("init_s", "parent_cpu_per_1000_s", "durable_s", "child_peak_rss_mib"):
        cells = []
        for mode in MODES:
            values = [r[key] for r in runs[mode]]
            # in process there is no export child: what it waited for is MLflow's own
            no_child = key == "child_peak_rss_mib" and MODES[mode] is False
            cells.append("none" if no_child else f"{min(values):.2f}-{max(values):.2f}")
        print(f"| {key} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
