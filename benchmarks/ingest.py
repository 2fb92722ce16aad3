"""Ingest capacity of one PostgreSQL-backed MLflow server: traces per second of 20 spans.

    python -m benchmarks.ingest --output ingest.md [--n 300] [--load-n 2000]

Each writer is its own process (a rollout worker), running the tracer as a worker does: it
makes ``n`` trajectories of 20 spans (a root and 6 x generate/parse/tool, plus a reward) as fast
as it can and waits until they are durable. Writers start together; the figure is all their
trajectories over the wall time from the first start to the last durable one. Two paths:

- **server**: every writer posts to one ``mlflow server`` (``--workers`` 1 or 2) on PostgreSQL;
- **bulk**: every writer writes straight to PostgreSQL with the tracer's bulk writer (one
  transaction per batch), no server on the write path.

The load run: 4 writers x ``load-n`` trajectories into a PostgreSQL-backed server and into a
sqlite-backed server, the rollout's own throughput (trajectories made per second) next to the
time until all were durable. Every figure is checked against the store (MLflow's client).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import QUIET_ENV, ROOT, count_traces, machine_info

TARGETS = (68, 137)  # traces/s: 64 nodes x 8 workers, one step a minute, 8x8 traced; 100 %


def writer(uri: str, project: str, n: int, worker: str) -> dict[str, Any]:
    """One writer process: ``n`` trajectories of 20 spans, then flush; times since import."""
    import tracer

    tracer.init({"backend": "mlflow", "tracking_uri": uri, "project_name": project,
                 "worker_id": worker, "token2text": False, "export_timeout_s": 120,
                 "spool_dir": tempfile.mkdtemp(prefix="ingest-spool-")})  # fmt: skip

    @tracer.trace_op(kind="generate")
    def generate(prompt_ids: list[int], turn: int) -> dict[str, Any]:
        return {"response_ids": prompt_ids[:64], "finish_reason": "stop", "turn": turn}

    @tracer.trace_op(kind="parse")
    def parse(text: str) -> dict[str, Any]:
        return {"content": text, "tool_calls": [{"name": "calculator"}]}

    @tracer.trace_op(kind="tool")
    def tool(name: str, arguments: dict[str, Any]) -> str:
        return "84"

    @tracer.trace_op(kind="reward")
    def reward(answer: str) -> dict[str, float]:
        return {"score": 1.0}

    ids = list(range(300))
    t0 = time.time()
    for i in range(n):
        with tracer.trace_attr(step=i // 64, sample_index=i % 64, rollout_n=0):
            for turn in range(6):  # 1 root + 6 x 3 + 1 reward = 20 spans
                generate(ids, turn)
                parse("<tool_call>calculator</tool_call>")
                tool("calculator", {"expression": f"12 * {turn}"})
            reward("84")
    made = time.time()
    ok = tracer.flush(timeout_s=1800)
    durable = time.time()
    m = tracer.metrics()
    tracer.shutdown()
    return {"start": t0, "made": made, "durable": durable, "flush_ok": ok,
            "dropped": m.get("tracer/mlflow/dropped", 0)}  # fmt: skip


def _writers(uri: str, project: str, count: int, n: int) -> dict[str, Any]:
    """``count`` writer processes at once; traces/s over the whole wall time, checked."""
    env = {**QUIET_ENV, "PYTHONPATH": str(ROOT)}
    import os

    env = {**os.environ, **env}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.ingest", "--writer", uri,
                               project, str(n), f"w{i}"], stdout=subprocess.PIPE, text=True,
                              env=env, cwd=tempfile.mkdtemp(prefix="ingest-"))
             for i in range(count)]  # fmt: skip
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=3600)
        results.append(json.loads(out.strip().splitlines()[-1]))
    start = min(r["start"] for r in results)
    wall = max(r["durable"] for r in results) - start
    made = max(r["made"] for r in results) - start
    stored = count_traces(uri, project)
    return {"writers": count, "n": n, "total": count * n, "stored": stored,
            "traces_per_s": round(count * n / wall, 1), "wall_s": round(wall, 1),
            "rollout_traj_per_s": round(count * n / made, 1),
            "flush_ok": all(r["flush_ok"] for r in results),
            "dropped": sum(r["dropped"] for r in results)}  # fmt: skip


def run(n: int, load_n: int, writer_counts: tuple[int, ...]) -> dict[str, Any]:
    from benchmarks.postgres import postgres_available, temporary_postgres
    from tests._servers import start_mlflow_server

    if why := postgres_available():
        return {"skipped": why}
    out: dict[str, Any] = {"n": n, "load_n": load_n, "server": {}, "bulk": {}, "load": {}}
    names = [f"s{w}" for w in (1, 2)] + ["bulk", "load"]
    with tempfile.TemporaryDirectory(prefix="ingest-") as tmp, \
            temporary_postgres(*names) as uris:  # fmt: skip
        db = dict(zip(names, uris, strict=True))
        for workers in (1, 2):
            root = Path(tmp) / f"s{workers}"
            root.mkdir()
            server = start_mlflow_server(root, backend_store_uri=db[f"s{workers}"],
                                         workers=workers)  # fmt: skip
            try:
                for count in writer_counts:
                    r = _writers(server.url, f"w{count}", count, n)
                    out["server"][f"{workers}x{count}"] = r
                    print(f"[ingest] server workers={workers} writers={count}: {r}",
                          file=sys.stderr, flush=True)  # fmt: skip
            finally:
                server.stop()
        for count in writer_counts:
            r = _writers(db["bulk"], f"w{count}", count, n)
            out["bulk"][str(count)] = r
            print(f"[ingest] bulk writers={count}: {r}", file=sys.stderr, flush=True)
        for store in ("postgresql", "sqlite"):
            root = Path(tmp) / f"load-{store}"
            root.mkdir()
            uri = db["load"] if store == "postgresql" else None
            server = start_mlflow_server(root, backend_store_uri=uri)
            try:
                r = _writers(server.url, "load", 4, load_n)
                out["load"][store] = r
                print(f"[ingest] load {store}: {r}", file=sys.stderr, flush=True)
            finally:
                server.stop()
    return out


def render(r: dict[str, Any]) -> str:
    """The section of RESULTS.md."""
    lines = ["## 8. Ingest capacity: one PostgreSQL-backed MLflow server", ""]
    if "skipped" in r:
        return "\n".join([*lines, f"skipped: {r['skipped']}", ""])
    lines += [f"Traces of 20 spans per second, all writers together ({r['n']} per writer; each "
              "writer its own process; checked against the store). Needed: "
              f"{TARGETS[0]} traces/s (64 nodes x 8 workers, 8 x n=8 traced per step a minute) "
              f"and {TARGETS[1]} at 100 % sampling.", "",
              "| writers | server, 1 worker | server, 2 workers | bulk to PostgreSQL, no server |",
              "|---|---|---|---|"]  # fmt: skip
    for count in sorted({int(k) for k in r["bulk"]}):
        cells = []
        for key in (f"1x{count}", f"2x{count}"):
            s = r["server"].get(key)
            cells.append(_cell(s))
        cells.append(_cell(r["bulk"].get(str(count))))
        lines.append(f"| {count} | " + " | ".join(cells) + " |")
    lines += ["", f"Load: 4 writers x {r['load_n']} trajectories into one server (1 worker):", "",
              "| store behind the server | rollout made (traj/s) | durable (traces/s) | stored |",
              "|---|---|---|---|"]  # fmt: skip
    for store, s in r["load"].items():
        lines.append(f"| {store} | {s['rollout_traj_per_s']} | {s['traces_per_s']} "
                     f"({s['wall_s']} s) | {s['stored']}/{s['total']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _cell(s: dict[str, Any] | None) -> str:
    if s is None:
        return "-"
    ok = "" if s["stored"] == s["total"] else f" (stored {s['stored']}/{s['total']})"
    return f"{s['traces_per_s']}{ok}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--writer":
        uri, project, n, worker = argv[1:5]
        print(json.dumps(writer(uri, project, int(n), worker)), flush=True)
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.ingest", description=__doc__)
    p.add_argument("--n", type=int, default=300, help="trajectories per writer")
    p.add_argument("--load-n", type=int, default=2000, help="trajectories per load writer")
    p.add_argument("--writers", default="1,2,4")
    p.add_argument("--output", help="write the Markdown section here (default: print it)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    counts = tuple(int(x) for x in a.writers.split(","))
    result = run(a.n, a.load_n, counts)
    result["machine"] = machine_info()
    if a.output:
        Path(a.output).write_text(render(result))
    else:
        print(render(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
