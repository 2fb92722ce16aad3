"""Export benchmark: N trajectories from JSONL (and from an MLflow sqlite store) to Parquet,
with wall time and peak memory (RSS high-water mark and Python allocations).

    python benchmarks/bench_export.py [--n 10000] [--mlflow-n 2000]

Writes --output (default benchmarks/RESULTS-export.md); `python -m benchmarks.run` puts it
into RESULTS.md as section 5. Each measurement runs in its own process so peak RSS is
that export's own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _prepare(tmp: Path, n: int, mlflow_n: int) -> None:
    import tracer
    from tests.test_export import _records
    from tracer.backends.jsonl_backend import JsonlExporter

    records = _records(n)
    writer = JsonlExporter(tracer.TraceConfig(backend="jsonl", jsonl_path=str(tmp / "t.jsonl")))
    for i in range(0, n, 2000):
        writer.export(records[i : i + 2000])
    if mlflow_n:
        from mlflow.tracing.client import TracingClient
        from mlflow.tracking import MlflowClient

        from benchmarks.common import mlflow_store
        from tracer.backends.mlflow_backend import mlflow_view, to_mlflow_spans

        uri = mlflow_store(tmp)
        exp_id = MlflowClient(uri).create_experiment("big")
        client = TracingClient(uri)
        for i in range(0, mlflow_n, 1000):
            chunk = records[i : i + 1000]
            client.log_spans(exp_id, [s for r in chunk for s in to_mlflow_spans(mlflow_view(r))])


def _measure(source: str, tmp: str) -> None:
    """Child process: one export, then print its figures as JSON."""
    import resource
    import tracemalloc

    from tracer.readers import export

    tracemalloc.start()
    t0 = time.perf_counter()
    kwargs = (
        {"path": f"{tmp}/t.jsonl"}
        if source == "jsonl"
        else {"experiment": "big", "tracking_uri": f"sqlite:///{tmp}/mlflow.db"}
    )
    summary = export(source, f"{tmp}/out-{source}", **kwargs)  # type: ignore[arg-type]
    wall = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    size = sum(os.path.getsize(p) for p in summary.files.values())
    print(json.dumps({"source": source, "trajectories": summary.rows["trajectories"],
                      "pages": summary.pages, "wall_s": round(wall, 2),
                      "peak_python_mb": round(peak / 2**20, 1), "peak_rss_mb": round(rss),
                      "parquet_mb": round(size / 2**20, 2)}))  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--mlflow-n", type=int, default=2_000)
    ap.add_argument("--output", default=str(ROOT / "benchmarks" / "RESULTS-export.md"))
    ap.add_argument("--child", nargs=2, metavar=("SOURCE", "TMP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _measure(*args.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        _prepare(Path(tmp), args.n, args.mlflow_n)
        rows = []
        for source in ["jsonl"] + (["mlflow"] if args.mlflow_n else []):
            out = subprocess.run(
                [sys.executable, __file__, "--child", source, tmp],
                capture_output=True, text=True, check=True, cwd=ROOT,
            )  # fmt: skip
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1])
    lines = [
        "# Export benchmark (benchmarks/bench_export.py)",
        "",
        f"Synthetic trajectories (1 generate + 1 tool span each); {os.cpu_count()} CPUs.",
        "",
        "| source | trajectories | pages | wall s | peak Python MB | peak RSS MB | Parquet MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['source']} | {r['trajectories']} | {r['pages']} | {r['wall_s']} | "
            f"{r['peak_python_mb']} | {r['peak_rss_mb']} | {r['parquet_mb']} |"
        )
    Path(args.output).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
