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

from benchmarks.common import QUIET_ENV, ROOT, machine_info, run_section, share_store_template
from benchmarks.report import render

SECTIONS = {
    "hotpath": 600,
    "e2e": 900,
    "throughput": 1200,
    "memory": 300,
    "cpu": 600,  # benchmarks/cpu.py: ours vs the OpenTelemetry SDK, whole-process CPU
    "export": 900,  # benchmarks/bench_export.py, appended as section 5
    "readers": 600,  # benchmarks/bench_readers.py, appended as section 6
    "otlp_attrs": 600,  # benchmarks/otlp_attrs.py, appended as section 7
    "ingest": 3600,  # benchmarks/ingest.py, appended as section 8 (not in --quick: servers)
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
        # One empty, migrated MLflow store, copied by every section (migrations take seconds),
        # made by the first section that needs one
        share_store_template(tmp)
        for name in names:
            if name in ("export", "readers", "otlp_attrs", "ingest"):
                continue  # their own scripts, run after the others (sections 5 to 8)
            print(f"[benchmarks] {name} ...", file=sys.stderr, flush=True)
            args = ["--quick"] if a.quick else []
            results[name] = run_section(name, args, SECTIONS[name])
            err = results[name].get("error")  # type: ignore[attr-defined]
            status = f"error: {str(err)[-300:]}" if err else "ok"
            print(f"[benchmarks] {name}: {status}", file=sys.stderr, flush=True)
        results["total_s"] = round(time.perf_counter() - t0, 1)
        text = render(results)
        if "export" in names:  # these copy the template too: still inside its folder's life
            text += _export_section(a.quick)
        if "readers" in names:
            text += _readers_section(a.quick)
        if "otlp_attrs" in names:
            text += _otlp_attrs_section(a.quick)
        if "ingest" in names:
            text += _ingest_section(a.quick)
    out = Path(a.output)
    out.parent.mkdir(parents=True, exist_ok=True)
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

    n, mlflow_n = (200, 10) if quick else (10_000, 2000)
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


def _readers_section(quick: bool) -> str:
    """Section 6: reader commands on a 12-trajectory store, from bench_readers.py."""
    import subprocess

    print("[benchmarks] readers ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-readers-") as tmp:
        md = Path(tmp) / "readers.md"
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "bench_readers.py"), "--repeats",
             "1" if quick else "3", "--output", str(md)],
            capture_output=True, text=True, cwd=ROOT, timeout=SECTIONS["readers"],
        )  # fmt: skip
        if proc.returncode != 0:
            return f"\n## 6. Reader commands\n\nfailed: {proc.stderr[-1000:]}\n"
        body = md.read_text().split("\n", 1)[1]
    return "\n## 6. Reader commands (`export`, `report`, `flags`, `replay`)\n" + body


def _otlp_attrs_section(quick: bool) -> str:
    """Section 7: what the OTLP semantic-convention attributes cost, from otlp_attrs.py."""
    import subprocess

    from benchmarks.otlp_attrs import markdown

    print("[benchmarks] otlp_attrs ...", file=sys.stderr, flush=True)
    title = "\n## 7. OTLP attributes per trajectory (`python -m benchmarks.otlp_attrs`)\n\n"
    with tempfile.TemporaryDirectory(prefix="bench-otlp-") as tmp:
        out = Path(tmp) / "otlp.json"
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.otlp_attrs", "--json", str(out)]
            + (["--quick"] if quick else []),
            capture_output=True, text=True, cwd=ROOT, timeout=SECTIONS["otlp_attrs"],
        )  # fmt: skip
        if proc.returncode != 0:
            return f"{title}Section failed: {proc.stderr[-1000:]}\n"
        result = json.loads(out.read_text())
    return (
        f"{title}{result['n']} trajectories (8 spans each, the workload of benchmarks/cpu.py) "
        f"turned into OTLP protobuf bytes; CPU time per trajectory, median of {result['reps']} "
        "repeats.\n\n" + markdown(result)
    )


def _ingest_section(quick: bool) -> str:
    """Section 6: what one PostgreSQL-backed MLflow server ingests (benchmarks/ingest.py).
    Skipped in --quick: it starts PostgreSQL and five servers (minutes on 2 cores)."""
    import subprocess

    if quick:
        return ("\n## 8. Ingest capacity\n\nnot run with --quick (PostgreSQL and several "
                "servers); `python -m benchmarks.run --sections ingest`\n")
    print("[benchmarks] ingest ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        md = Path(tmp) / "ingest.md"
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "benchmarks.ingest", "--output", str(md)],
                capture_output=True, text=True, cwd=ROOT, timeout=SECTIONS["ingest"],
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return f"\n## 8. Ingest capacity\n\ntimed out after {SECTIONS['ingest']} s\n"
        if proc.returncode != 0 or not md.exists():
            return f"\n## 8. Ingest capacity\n\nfailed: {proc.stderr[-1000:]}\n"
        return "\n" + md.read_text()


if __name__ == "__main__":
    sys.exit(main())
