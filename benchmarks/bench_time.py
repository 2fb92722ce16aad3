"""The explorer's Time tab at scale: ``GET /api/timing?step=`` over N generated trajectories
(benchmarks/explore_data.py, with its timing columns and steps table), from the export's own
files and from the compacted copy the explorer builds (its steady state), through the API's
dispatch (``Explorer.handle``: the query and the JSON it returns; no HTTP). The first request
reads the steps table (curves, then cached); the others are random steps.

    python -m benchmarks.bench_time --n 1000000 --data /tmp/explore-1m   # the 200 ms p95 goal
    python -m benchmarks.bench_time --n 50000                            # a busy 2-core machine
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from typing import Any


def _p(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def measure(folder: str, requests: int, compact: bool, cache: str) -> dict[str, Any]:
    import orjson

    from tracer.readers.explore.server import Explorer
    from tracer.readers.explore.store import Run, Store

    store = Store([Run("run", folder, set())])
    t0 = time.perf_counter()
    if compact:
        store.compact("run", cache)
    compact_s = time.perf_counter() - t0
    explorer = Explorer(store)
    t0 = time.perf_counter()
    first = explorer.handle("/api/timing", {})
    first_s = time.perf_counter() - t0
    steps = sorted({c["step"] for c in first["curves"] if not c["validate"]})
    rng = random.Random(0)
    times = []
    for _ in range(requests):
        t0 = time.perf_counter()
        body = explorer.handle("/api/timing", {"step": [str(rng.choice(steps))]})
        orjson.dumps(body)  # what the server sends
        times.append(time.perf_counter() - t0)
    store.close()
    return {
        "compacted": compact,
        "compact_s": round(compact_s, 1),
        "first_ms": round(first_s * 1e3, 1),
        "p50_ms": round(_p(times, 0.5) * 1e3, 1),
        "p95_ms": round(_p(times, 0.95) * 1e3, 1),
        "max_ms": round(max(times) * 1e3, 1),
        "trajectories_per_step": first["count"],
        "spans_per_answer": len(body["spans"]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=50_000)
    p.add_argument("--data", default=None, help="reuse or keep the generated export here")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from benchmarks.explore_data import generate

    tmp = tempfile.mkdtemp(prefix="bench-time-")
    data = args.data or os.path.join(tmp, "data")
    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(data, "steps.parquet")):
        generate(data, args.n, short_text=True)
    gen_s = time.perf_counter() - t0
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    out: dict[str, Any] = {"n": args.n, "generate_s": round(gen_s, 1), "load_before": load,
                           "runs": [measure(data, args.requests, c, os.path.join(tmp, "cache"))
                                    for c in (False, True)]}  # fmt: skip
    with open("/proc/loadavg") as f:
        out["load_after"] = f.read().split()[:3]
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
