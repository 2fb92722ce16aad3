"""Reader commands on a small store: what a user waits for after `rollout-tracer run`.

    python benchmarks/bench_readers.py [--repeats 3]

A 12-trajectory MLflow sqlite store (written by the tracer, as the default run writes it), then
`rollout-tracer export`, `report`, `flags` and `replay` (nothing waiting) each as the user runs
them: a fresh process, wall time from start to exit (median of --repeats), next to `import
mlflow` alone. Writes --output (default benchmarks/RESULTS-readers.md); `python -m
benchmarks.run` puts it into RESULTS.md as section 6.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

COMMANDS = {
    "export": ["export", "--from", "mlflow", "--out", "out", "--no-progress"],
    "report": ["report", "--from", "mlflow", "--out", "report.html"],
    "flags": ["flags", "--from", "mlflow"],
    "replay (nothing waiting)": ["replay"],
}


def _prepare(tmp: Path) -> None:
    import tracer
    from benchmarks.common import mlflow_store
    from tests import export_agent

    # the export in this process: the same rows as the default's export child, one MLflow
    # start fewer (~2.5 CPU-s; the store is the input here, the commands below the figures)
    tracer.init({"backend": "mlflow", "tracking_uri": mlflow_store(tmp),
                 "project_name": "rollout-tracer", "token2text": True,
                 "spool_dir": str(tmp / ".rollout-tracer" / "spool"),
                 "export_in_subprocess": False})  # fmt: skip
    tracer.register_tokenizer(export_agent.WordTokenizer())
    export_agent.run([1, 2])  # 2 steps x 3 samples x 2 rollouts = 12 trajectories
    assert tracer.flush(timeout_s=120)
    tracer.shutdown()


def _wall(argv: list[str], cwd: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": ""}
    env.pop("MLFLOW_TRACKING_URI")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *argv], cwd=cwd, env=env, check=True,
                   capture_output=True, timeout=600)  # fmt: skip
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default=str(ROOT / "benchmarks" / "RESULTS-readers.md"))
    ap.add_argument("--prepare", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.prepare:
        _prepare(Path(args.prepare))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-readers-") as name:
        tmp = Path(name)
        _wall([__file__, "--prepare", str(tmp)], ROOT)  # its own process: MLflow stays out
        runs = {"import mlflow (reference)": ["-c", "import mlflow"],
                **{k: ["-m", "rollout.cli", *v] for k, v in COMMANDS.items()}}  # fmt: skip
        for label, argv in runs.items():
            times = [_wall(argv, tmp) for _ in range(args.repeats)]
            rows.append((label, statistics.median(times), min(times)))
            print(label, rows[-1][1:], file=sys.stderr)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = [
        "# Reader commands (benchmarks/bench_readers.py)",
        "",
        f"`python benchmarks/bench_readers.py --repeats {args.repeats}`: a 12-trajectory MLflow "
        "sqlite store (bulk writer); each command in a fresh process, wall s from start to "
        f"exit; {os.cpu_count()} CPUs, load average {load} at the end. Goal: under 2 s each.",
        "",
        "| command | median s | min s |",
        "|---|---|---|",
        *(f"| {label} | {med:.2f} | {low:.2f} |" for label, med, low in rows),
    ]
    Path(args.output).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
