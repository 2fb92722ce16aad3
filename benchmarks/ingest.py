"""Ingest capacity of PostgreSQL-backed MLflow: traces of 20 spans per second, many writers.

    python -m benchmarks.ingest --quick                       # ~3 min: bulk curve, a short run
    python -m benchmarks.ingest --output ingest.md --json ingest.json   # quiet machine, ~30 min
    python -m benchmarks.ingest --only sustain,fault --sustain 60 --pin  # the 60 s run, a restart
    python -m benchmarks.ingest --only held --pin         # 1,100 traces/s offered for 60 s

Each writer is its own process (a rollout worker) running the tracer as a worker does: it makes
trajectories of 20 spans (a root, 6 x generate/parse/tool, a reward) as fast as it can, ``n`` of
them or for ``--sustain`` seconds, and waits until they are durable. Writers start together;
the figure is all their trajectories over the wall time from the first start to the last
durable one, checked against the store with MLflow's client. Paths:

- **server1**, **server2**: every writer posts to one ``mlflow server`` (1 or 2 workers);
- **bulk**: every writer writes straight to PostgreSQL with the tracer's bulk writer (one INSERT
  of the traces, then one COPY per table per batch), no server on the write path.

CPU seconds per 1,000 traces are counted per side: the writers (each writer process and its
export child), the server (its process tree), PostgreSQL (the postmaster's tree: live backends
and the ones that ended). ``--pin`` runs the writers on CPU 0 and PostgreSQL on CPU 1
(``taskset``). ``fault`` runs 8 writers for ``--sustain`` seconds and restarts PostgreSQL
(``pg_ctl restart -m fast``) half-way: every trace must still be stored, once.

``--rate R`` holds the sustained run at R traces/s offered, all writers together (each writer
makes its share on a fixed schedule: trajectory i at i / rate seconds from its start). The run
says whether the rate was held (``made_per_s`` against ``offered_per_s``) and how long after
the last trace was made the last one was durable (``drain_s``): "sustained" then means a held
rate, not a backlog drained at the end. The **held** run (in the default set) is that run at
``--held-rate`` (1,100 traces/s: 512 nodes at full sampling) for ``--sustain`` seconds, with
the store's lag behind the rollout sampled in each writer every half second (``lag_s``).
The **trickle** run is a job's writers as they are: 16, each making ``--trickle-rate`` (2)
trajectories a second for ``--sustain`` seconds, so each processing wake spools a batch of one
or two. It runs twice: each batch its own export call (``export_interval_s=0``, as the tracer
did before that setting) and the default (5 s: a batch waits in the spool for others to share
its call, one store transaction). The **alone** run (``--only alone``, not in the default set)
is one such writer by itself, as on a node: its core idle between trajectories, which makes a
trajectory several times dearer than on the trickle's busy core; its CPU a trace is a node's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import tracer
from benchmarks.common import count_traces, machine_info
from benchmarks.ingest_held import Lags, lag_summary
from benchmarks.ingest_procs import leftovers, run_writers, stat_cpu_s, tree_cpu_s
from benchmarks.ingest_report import TARGETS, render


# the ops of a benchmark trajectory, decorated once (benchmarks/ingest_profile.py uses them too)
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


def trace_one(i: int, ids: list[int]) -> None:
    """One trajectory of 20 spans as a rollout makes it: the root, 6 x (generate, parse, tool),
    a reward."""
    with tracer.trace_attr(step=i // 64, sample_index=i % 64, rollout_n=0):
        for turn in range(6):  # 1 root + 6 x 3 + 1 reward = 20 spans
            generate(ids, turn)
            parse("<tool_call>calculator</tool_call>")
            tool("calculator", {"expression": f"12 * {turn}"})
        reward("84")


def writer_config(uri: str, project: str, worker: str, spool_dir: str) -> dict[str, Any]:
    """The tracer's config in a benchmark writer (benchmarks/ingest_profile.py's too): the
    MLflow backend and its default export child, no token text, a spool of its own (in a
    folder the caller removes: ~3,400 left in /tmp by earlier rounds had made creating a
    file there ~15x dearer, each spooled batch's among them)."""
    return {"backend": "mlflow", "tracking_uri": uri, "project_name": project,
            "worker_id": worker, "token2text": False, "export_timeout_s": 120,
            "spool_dir": spool_dir}  # fmt: skip


def writer(uri: str, project: str, n: int, worker: str, seconds: float, rate: float = 0.0,
           export_interval_s: float | None = None) -> dict[str, Any]:  # fmt: skip
    """One writer process: ``n`` trajectories (or as many as ``seconds`` allow), then flush.
    ``rate``: this writer's trajectories a second (0: as fast as it can);
    ``export_interval_s``: the tracer's (None: its default)."""
    import gc

    # in its working folder, which run_writers made for it and removes (the tracer's default
    # spool, ./.rollout-tracer/spool, is under the working folder too)
    config = writer_config(uri, project, worker, os.path.abspath("spool"))
    if export_interval_s is not None:
        config["export_interval_s"] = export_interval_s
    tracer.init(config)

    ids = list(range(300))
    # the steady state of a long job: one trajectory made and stored before the clock starts,
    # so the connection's first use (PostgreSQL's catalog caches in its new backend, the
    # column types the COPY asks once) is not charged to the measured trajectories; a writer
    # of a real job pays it once in hours. ``--cold`` counts it.
    warmup = 0 if os.environ.get("RT_INGEST_COLD") else 1
    if warmup:
        trace_one(-1, ids)  # step -1: apart from the measured steps
        if not tracer.flush(timeout_s=300):
            raise RuntimeError("the warm-up trajectory was not stored in 300 s")
    # as a process that ran a while: what its start made (imports, MLflow's modules) is past
    # its first full garbage-collector pass, a one-time ~0.2 CPU-s that is not per trace
    gc.collect()
    print("ready", flush=True)  # every writer started (imports, export child): then all go
    sys.stdin.readline()
    cpu0 = tree_cpu_s(os.getpid())  # this process and its export child, past their start
    own0 = stat_cpu_s(os.getpid(), reaped=False)  # this process alone: the rollout's side
    made_at: list[float] = []  # when each trajectory was made
    lags = Lags(made_at, stored_before=warmup)
    t0 = time.time()
    i = 0
    while (i < n) if seconds <= 0 else (time.time() - t0 < seconds):
        if rate > 0 and (wait := t0 + i / rate - time.time()) > 0:
            time.sleep(wait)  # the schedule: trajectory i at t0 + i / rate, late ones at once
        trace_one(i, ids)
        made_at.append(time.time())
        i += 1
    made = time.time()
    ok = tracer.flush(timeout_s=1800)
    durable = time.time()
    lags.stop()
    cpu = tree_cpu_s(os.getpid()) - cpu0
    own = stat_cpu_s(os.getpid(), reaped=False) - own0
    m = tracer.metrics()
    tracer.shutdown()
    return {"n": i, "start": t0, "made": made, "durable": durable, "flush_ok": ok,
            "dropped": m.get("tracer/mlflow/dropped", 0), "cpu_s": cpu, "own_cpu_s": own,
            "lags": lags.samples(made), "warmup": warmup}  # fmt: skip


def measure(uri: str, project: str, count: int, n: int, *, seconds: float = 0,
            rate: float = 0, pin: str | None = None, pg_pid: int | None = None,
            server_pid: int | None = None, during: Any = None,
            export_interval_s: float | None = None) -> dict[str, Any]:  # fmt: skip
    """``count`` writers at once; traces/s over the whole wall time, CPU by side (the
    server's and PostgreSQL's from when every writer is ready: their start, MLflow's store
    opened in each, is not ingest), checked."""
    before: dict[str, float] = {}

    def ready() -> None:
        before.update(pg=tree_cpu_s(pg_pid) if pg_pid else 0.0,
                      server=tree_cpu_s(server_pid) if server_pid else 0.0)  # fmt: skip

    extra = [] if export_interval_s is None else [str(export_interval_s)]
    args = [[uri, project, str(n), f"w{i}", str(seconds), str(rate / count), *extra]
            for i in range(count)]  # fmt: skip
    timer = threading.Timer(0, during) if during else None
    if timer:
        timer.start()
    try:
        results = run_writers(args, pin=pin, timeout_s=1800 + seconds, on_ready=ready)
    finally:
        if timer:
            timer.cancel()
    # read before the check below: MLflow's client reading every trace back is not ingest
    after = {"pg": tree_cpu_s(pg_pid) if pg_pid else 0.0,
             "server": tree_cpu_s(server_pid) if server_pid else 0.0}  # fmt: skip
    total = sum(r["n"] for r in results)
    start = min(r["start"] for r in results)
    wall = max(r["durable"] for r in results) - start
    made = max(r["made"] for r in results) - start
    k = 1000 / max(total, 1)
    out = {"writers": count, "total": total, "stored": count_traces(uri, project),
           "warmup": sum(r.get("warmup", 0) for r in results),
           "traces_per_s": round(total / wall, 1), "wall_s": round(wall, 1),
           "rollout_traj_per_s": round(total / made, 1),
           "drain_s": round(wall - made, 1),
           "flush_ok": all(r["flush_ok"] for r in results),
           "dropped": sum(r["dropped"] for r in results),
           "writer_cpu_s_per_1k": round(sum(r["cpu_s"] for r in results) * k, 2),
           # of which the rollout processes' own (hot path, processing, export worker); the
           # rest is their export children's
           "rollout_cpu_s_per_1k": round(sum(r["own_cpu_s"] for r in results) * k, 2),
           "down_lines": [r["stderr"].count("is down") for r in results],
           "back_lines": [r["stderr"].count(" is back;") for r in results],
           "stderr_first_writer": results[0]["stderr"][-3000:]}  # fmt: skip
    if rate:
        out["offered_per_s"], out["made_per_s"] = rate, round(total / made, 1)
        out["lag_s"] = lag_summary([r["lags"] for r in results], start)
    if pg_pid and not during:
        out["pg_cpu_s_per_1k"] = round((after["pg"] - before["pg"]) * k, 2)
    if server_pid:
        out["server_cpu_s_per_1k"] = round((after["server"] - before["server"]) * k, 2)
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    from benchmarks.postgres import (
        pgbouncer,
        pgbouncer_available,
        postgres_available,
        temporary_cluster,
    )
    from tests._servers import start_mlflow_server

    if why := postgres_available():
        return {"skipped": why}
    only = set(a.only.split(","))
    counts = tuple(int(x) for x in a.writers.split(","))
    out: dict[str, Any] = {"n": a.n, "curve": {}, "runs": {}, "pin": a.pin,
                           "warm": not a.cold}
    names = ["server1", "server2", "bulk", "sustain", "held", "fault", "trickle0", "trickle5",
             "alone"]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="ingest-") as tmp, \
            temporary_cluster(*names) as cluster, contextlib.ExitStack() as stack:  # fmt: skip
        db = dict(zip(names, cluster.uris, strict=True))
        pg = cluster.postmaster_pid()
        pooler = None  # --pgbouncer: the bulk paths' writers go through it
        if a.pgbouncer:
            if why := pgbouncer_available():
                return {"skipped": why}
            bouncer = stack.enter_context(pgbouncer(cluster.uris, pool_size=a.pgbouncer))
            db.update((n, u) for n, u in zip(names, bouncer.uris, strict=True)
                      if not n.startswith("server"))  # fmt: skip
            pooler, out["pgbouncer"] = bouncer.pid, a.pgbouncer
        if a.pin:
            for pid in (pg, pooler):
                if pid:
                    subprocess.run(["taskset", "-a", "-cp", "1", str(pid)], check=True,
                                   capture_output=True)  # fmt: skip
        pin = "0" if a.pin else None

        def record(key: str, r: dict[str, Any]) -> None:
            print(f"[ingest] {key}: {r}", file=sys.stderr, flush=True)

        for path in ("server1", "server2"):
            if path not in only:
                continue
            root = Path(tmp) / path
            root.mkdir()
            server = start_mlflow_server(root, backend_store_uri=db[path], workers=int(path[-1]))
            try:
                for count in (
                    a.server_writers and tuple(int(x) for x in a.server_writers.split(","))
                ) or counts:
                    r = measure(server.url, f"w{count}", count, a.server_n or a.n, pin=pin,
                                pg_pid=pg, server_pid=server.proc.pid)  # fmt: skip
                    out["curve"][f"{path}/{count}"] = r
                    record(f"{path} writers={count}", r)
            finally:
                server.stop()
        if "bulk" in only:
            for count in counts:
                r = measure(db["bulk"], f"w{count}", count, a.n, pin=pin, pg_pid=pg,
                            server_pid=pooler)  # fmt: skip
                out["curve"][f"bulk/{count}"] = r
                record(f"bulk writers={count}", r)
        if "sustain" in only:
            r = measure(db["sustain"], "sustain", 8, 0, seconds=a.sustain, rate=a.rate, pin=pin,
                        pg_pid=pg, server_pid=pooler)  # fmt: skip
            out["runs"]["sustain"] = r
            record(f"bulk sustained {a.sustain} s, 8 writers", r)
        if "held" in only:
            r = measure(db["held"], "held", 8, 0, seconds=a.sustain, rate=a.held_rate, pin=pin,
                        pg_pid=pg, server_pid=pooler)  # fmt: skip
            out["runs"]["held"] = r
            record(f"bulk held at {a.held_rate:g} traces/s offered, {a.sustain} s, 8 writers", r)
        if "trickle" in only:  # a job's many writers, each a trajectory or two a second
            for interval in (0.0, 5.0):  # each batch its own call, as before; the default
                r = measure(db[f"trickle{interval:.0f}"], "trickle", 16, 0, seconds=a.sustain,
                            rate=16 * a.trickle_rate, pin=pin, pg_pid=pg, server_pid=pooler,
                            export_interval_s=interval)  # fmt: skip
                r["export_interval_s"] = interval
                out["runs"][f"trickle, export_interval_s={interval:g}"] = r
                record(f"bulk, 16 writers at {a.trickle_rate:g} traces/s each, "
                       f"export_interval_s={interval:g}", r)
        if "alone" in only:  # one writer at a job's rate, its core idle between trajectories
            r = measure(db["alone"], "alone", 1, 0, seconds=a.sustain, rate=a.trickle_rate,
                        pin=pin, pg_pid=pg, server_pid=pooler)  # fmt: skip
            out["runs"]["alone"] = r
            record(f"bulk, 1 writer alone at {a.trickle_rate:g} traces/s", r)
        if "fault" in only:
            restarted: list[float] = []

            def restart() -> None:  # half-way through the writing: after the first trace
                _wait_for_traces(db["fault"])
                time.sleep(a.sustain / 2)
                restarted.append(time.time())
                cluster.restart()

            r = measure(db["fault"], "fault", 8, 0, seconds=a.sustain, pin=pin, during=restart)
            r["restarted"] = bool(restarted)
            out["runs"]["fault"] = r
            record(f"bulk, 8 writers, PostgreSQL restarted at {a.sustain / 2:.0f} s", r)
    out["left_behind"] = leftovers()
    return out


def _wait_for_traces(uri: str, timeout_s: float = 300) -> None:
    """Until the first trace is in the store (the writers are past their start)."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                with engine.connect() as conn:
                    if conn.execute(sqlalchemy.text("SELECT count(*) FROM trace_info")).scalar():
                        return
            except sqlalchemy.exc.SQLAlchemyError:  # no schema yet
                pass
            time.sleep(0.5)
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--writer":
        uri, project, n, worker, seconds = argv[1:6]
        extra = argv[6:-1]  # the last one is run_writers' tag
        rate = float(extra[0]) if extra else 0.0
        interval = float(extra[1]) if len(extra) > 1 else None
        print(json.dumps(writer(uri, project, int(n), worker, float(seconds), rate, interval)),
              flush=True)  # fmt: skip
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.ingest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--n", type=int, default=300, help="trajectories per writer (the curve)")
    p.add_argument("--writers", default="1,2,4,8,16", help="writer counts of the curve")
    p.add_argument("--server-writers", default="", help="writer counts for the server paths")
    p.add_argument("--server-n", type=int, default=0, help="trajectories per server writer")
    p.add_argument("--only", default="server1,server2,bulk,sustain,held,trickle,fault")
    p.add_argument("--trickle-rate", type=float, default=2.0,
                   help="the trickle run: traces/s of each of its 16 writers")
    p.add_argument("--sustain", type=float, default=60.0, help="seconds of the sustained run")
    p.add_argument("--rate", type=float, default=0.0,
                   help="the sustained run: traces/s offered, all writers together (0: flat out)")
    p.add_argument("--held-rate", type=float, default=float(TARGETS[2]),
                   help="the held run: traces/s offered, all writers together")
    p.add_argument("--pin", action="store_true", help="writers on CPU 0, PostgreSQL on CPU 1")
    p.add_argument("--pgbouncer", type=int, default=0, metavar="N",
                   help="the bulk paths' writers through PgBouncer (transaction mode, N server "
                   "connections a database), pinned with PostgreSQL; its CPU in the server column")
    p.add_argument("--cold", action="store_true",
                   help="no warm-up trajectory per writer: its connection's first use counts")
    p.add_argument("--quick", action="store_true",
                   help="minutes: small n, server at 1 and 4 writers, 5 s runs")  # fmt: skip
    p.add_argument("--output", help="write the Markdown section here (default: print it)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.pgbouncer == 1:  # the schema lock's holder needs a second one (docs/scale-out.md)
        p.error("--pgbouncer 1: the pool needs at least 2 server connections")
    if a.quick:
        a.n, a.server_n, a.server_writers, a.sustain = 30, 10, "1,4", 5.0
        a.only = a.only.replace("server2,", "")
    if a.cold:  # read by the writer processes (benchmarks.ingest --writer)
        os.environ["RT_INGEST_COLD"] = "1"
    machine = machine_info()
    result = run(a)
    result["machine"] = machine
    text = render(result)
    if a.output:
        Path(a.output).write_text(text)
    else:
        print(text)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1, default=str))
    return 0 if "skipped" in result or not result["left_behind"] else 1


if __name__ == "__main__":
    sys.exit(main())
