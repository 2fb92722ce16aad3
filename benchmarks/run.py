"""Run every benchmark section side by side and write ``benchmarks/RESULTS.md``.

    python -m benchmarks.run            # full suite (a few minutes)
    python -m benchmarks.run --quick    # CI: fewer repeats, smaller N (about a minute)

Each section runs in its own fresh interpreter (MLflow's fluent API and the tracer keep
process-global state; peak RSS must be per section). All figures that are compared are
compared within this one run, as ratios: the machine is shared and absolute times drift.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import QUIET_ENV, ROOT, machine_info, mlflow_store, run_section
from benchmarks.report import render

SECTIONS = {
    "hotpath": 600,
    "e2e": 900,
    "throughput": 1200,
    "memory": 300,
    "cpu": 600,  # benchmarks/cpu.py: ours vs the OpenTelemetry SDK, whole-process CPU
    "export": 900,  # benchmarks/bench_export.py, appended as section 5
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    p.add_argument("--quick", action="store_true", help="fewer repeats, smaller N (CI)")
    p.add_argument("--output", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    p.add_argument("--json", help="also write the raw results here")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset")
    a = p.parse_args(argv)
    names = [s.strip() for s in a.sections.split(",") if s.strip()]
    bad = [s for s in names if s not in SECTIONS]
    if bad:
        p.error(f"unknown section(s) {bad}; valid: {', '.join(SECTIONS)}")
    os.environ.update(QUIET_ENV)
    t0 = time.perf_counter()
    results: dict[str, object] = {
        "quick": a.quick,
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": "python -m benchmarks.run" + (" --quick" if a.quick else ""),
        "machine": machine_info(),
    }
    with tempfile.TemporaryDirectory(prefix="bench-template-") as tmp:
        # One empty, migrated MLflow store, copied by every section (migrations take seconds).
        mlflow_store(tmp, "template-source.db")
        for name in names:
            if name == "export":
                continue  # its own script, run by _export_section after the others
            print(f"[benchmarks] {name} ...", file=sys.stderr, flush=True)
            args = ["--quick"] if a.quick else []
            results[name] = run_section(name, args, SECTIONS[name])
            err = results[name].get("error")  # type: ignore[attr-defined]
            status = f"error: {str(err)[-300:]}" if err else "ok"
            print(f"[benchmarks] {name}: {status}", file=sys.stderr, flush=True)
    results["total_s"] = round(time.perf_counter() - t0, 1)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = render(results)
    if "export" in names:
        text += _export_section(a.quick)
    kept = ROOT / "benchmarks" / "RESULTS-explore.md"
    if kept.exists():  # `python -m benchmarks.explore` (minutes to hours): kept, not rerun
        text += "\n" + kept.read_text()
    out.write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1, default=str))
    print(f"[benchmarks] wrote {out} in {results['total_s']} s", file=sys.stderr)
    return 0


def _export_section(quick: bool) -> str:
    """Section 5: export to Parquet (time and peak memory), from bench_export.py."""
    import subprocess

    n, mlflow_n = (1000, 100) if quick else (10_000, 2000)
    print(f"[benchmarks] export ({n} from JSONL, {mlflow_n} from MLflow) ...", file=sys.stderr,
          flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-export-") as tmp:
        md = Path(tmp) / "export.md"
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "bench_export.py"), "--n", str(n),
             "--mlflow-n", str(mlflow_n), "--output", str(md)],
            capture_output=True, text=True, cwd=ROOT, timeout=SECTIONS["export"],
        )  # fmt: skip
        if proc.returncode != 0:
            return f"\n## 5. Export to Parquet\n\nfailed: {proc.stderr[-1000:]}\n"
        body = md.read_text().split("\n", 1)[1]  # drop its own title
    return "\n## 5. Export to Parquet (`rollout-tracer export`)\n" + body


if __name__ == "__main__":
    sys.exit(main())
