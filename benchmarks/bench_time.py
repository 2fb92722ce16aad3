"""The explorer's Time tab at scale: ``GET /api/timing?step=`` over N generated trajectories
(benchmarks/explore_data.py, with its timing columns and steps table), from the export's own
files and from the compacted copy the explorer builds (its steady state), through the API's
dispatch (``Explorer.handle``: the query and the JSON it returns; no HTTP). The first request
reads the steps table (curves, then cached); the others are random steps.

    python -m benchmarks.bench_time --n 1000000 --data /tmp/explore-1m   # the 200 ms p95 goal
    python -m benchmarks.bench_time --n 50000                            # a busy 2-core machine

``--spans N,...`` measures instead one trajectory's breakdown (``breakdown.breakdown``: its parts
and slow span) over N spans: turns of a helper span around a generate call and a tool call with
a parse inside, listed shuffled; the best of ``--repeat`` runs (the goal: 10,000 spans in under
0.1 s). ``--record`` stores the 10,000-span figure in benchmarks/figures.json.

    python -m benchmarks.bench_time --spans 500,1000,2000,10000 --record
"""

from __future__ import annotations

import argparse
import json
import math
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


def trajectory_spans(n: int, seed: int = 0) -> tuple[int, list[Any]]:
    """(end_ns, spans) of one trajectory of ``n`` spans (a multiple of 4), starting at 0."""
    from tracer.record import SpanRecord

    rng = random.Random(seed)
    spans: list[Any] = []
    t = 0
    for turn in range(n // 4):
        g, k = rng.randrange(1, 50) * 10**6, rng.randrange(1, 50) * 10**6
        h = f"h{turn}"
        spans += [SpanRecord(h, "root", "execute_tool_calls", "other", t, t + g + k + 10**6),
                  SpanRecord(f"g{turn}", h, "generate", "generate", t, t + g),
                  SpanRecord(f"t{turn}", h, "call_tool", "tool", t + g, t + g + k,
                             inputs={"name": "python", "arguments": {"turn": turn}}),
                  SpanRecord(f"p{turn}", f"t{turn}", "parse", "parse", t + g, t + g + 1)]
        t += g + k + 2 * 10**6
    rng.shuffle(spans)
    return t, spans


def span_cost(sizes: list[int], repeat: int) -> dict[str, dict[str, float]]:
    """Milliseconds (best of ``repeat``) of one trajectory's breakdown, by span count: the
    thread's CPU time (what the work costs; a shared machine's queue for the CPU is left out)
    and the wall time."""
    from tracer.readers.timing.breakdown import breakdown

    out = {}
    for n in sizes:
        end, spans = trajectory_spans(n)
        cpu = wall = math.inf
        for _ in range(repeat):
            c0, w0 = time.thread_time(), time.perf_counter()
            breakdown(0, end, spans)
            cpu = min(cpu, time.thread_time() - c0)
            wall = min(wall, time.perf_counter() - w0)
        out[str(n)] = {"cpu_ms": round(cpu * 1e3, 1), "wall_ms": round(wall * 1e3, 1)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spans", default=None, help="N,N,...: one trajectory's breakdown cost")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--record", action="store_true", help="--spans: store the 10,000 figure")
    p.add_argument("--n", type=int, default=50_000)
    p.add_argument("--data", default=None, help="reuse or keep the generated export here")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.spans:
        sizes = [int(x) for x in args.spans.split(",")]
        cost = span_cost(sizes, args.repeat)
        print(json.dumps({"ms_by_spans": cost}, indent=1))
        if args.record and "10000" in cost:
            from benchmarks.figures import record

            ten = cost["10000"]
            record("breakdown-10k-spans",
                   f"{ten['cpu_ms']:.0f} ms CPU ({ten['wall_ms']:.0f} ms wall) for one "
                   "trajectory of 10,000 spans",
                   figure="the time breakdown and slow span of one trajectory of 10,000 spans "
                   "(best of 5)", command="python -m benchmarks.bench_time --spans "
                   "500,1000,2000,10000 --record")  # fmt: skip
        return
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
