"""Where a trace's CPU goes on the bulk path, in the writer and in PostgreSQL.

    python -m benchmarks.ingest_profile [--n 2048] [--batch 256]

One process, one throwaway PostgreSQL, the trajectories benchmarks/ingest.py makes (20 spans).
``--store N``: the PostgreSQL side writes into a store that already holds N traces (made and
written the same way first), as a store of a running job does: its id indexes no longer fit a
few pages.

- **writer**: what the export child does with a batch, stage by stage, in CPU microseconds a
  trace (``time.process_time``, the best of three rounds; the process's long-lived objects
  frozen out of the garbage collector's passes, and no automatic passes, as in the child): read
  the batch's JSON lines back into records, MLflow's view of them (``mlflow_view``), MLflow's
  rows (``RowBuilder.trace``; it says how many spans went through MLflow's own attribute
  translation), the COPY data, and the whole ``BulkWriter.write`` (rows, COPY data and the
  round trips);
- **the rollout process** (``--process``): the same trajectories traced for real by
  ``tracer.init`` with the MLflow backend into the same server (the export child on, as the
  default config runs it), flushed; the CPU of this process (the hot path, the processing
  thread, the export worker, and the garbage collector's passes over its heap, which is not
  frozen here, as a user's never is) and of its export child, a trace each;
- **PostgreSQL**: the CPU of the server's processes while the batches are written (the
  postmaster's tree, from /proc), the WAL it wrote, and per table the rows a trace adds, the
  foreign keys each row is checked against and the indexes each row updates; per statement
  its calls per batch and execution time a trace (``pg_stat_statements``);
- **where PostgreSQL's CPU goes** (``--perf``, as root with ``perf`` installed): as many
  traces again, written while ``perf record -a --call-graph dwarf`` samples the machine, and
  the server's samples shared out by what they were doing (foreign-key checks, index
  inserts, heap, TOAST, COPY parsing, commit, the background processes). Its own window:
  sampling stacks costs CPU that the figure above must not include.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

TABLES = ("trace_info", "trace_tags", "trace_request_metadata", "spans", "assessments")


def _records(n: int) -> list[Any]:
    import tracer
    from benchmarks.ingest import trace_one
    from tracer.testing import InMemoryExporter

    tracer.init(backend="memory", token2text=False)

    ids = list(range(300))
    for i in range(n):
        trace_one(i, ids)
    assert tracer.flush(120)
    records = list(InMemoryExporter.latest().records)
    tracer.reset()
    return records


def _prefill(writer: Any, n: int, batch: int) -> int:
    """``n`` traces made and written as the measured ones are, 2,048 at a time (their records
    are not kept); returns how many the store holds."""
    from tracer.backends.mlflow_backend import mlflow_view

    done = 0
    while done < n:
        views = [mlflow_view(r) for r in _records(min(2048, n - done))]
        for i in range(0, len(views), batch):
            writer.write(views[i : i + batch])
        done += len(views)
    [(held,)] = _sql(writer.store.db_uri, "SELECT count(*) FROM trace_info")
    return int(held)


def _cpu_us(n: int, work: Callable[[], Any], rounds: int = 3) -> float:
    """The best of ``rounds``: CPU microseconds a trace (a shared machine adds, never takes)."""
    best = float("inf")
    for _ in range(rounds):
        c0 = time.process_time()
        work()
        best = min(best, time.process_time() - c0)
    return best / n * 1e6


def _writer(writer: Any, records: list[Any], batch: int) -> dict[str, float]:
    from tracer.backends.export_process import _record
    from tracer.backends.mlflow_backend import mlflow_view
    from tracer.backends.mlflow_bulk import _table_rows
    from tracer.backends.mlflow_bulk_copy import binary_columns, copy_binary
    from tracer.encode import encode_record

    n = len(records)
    lines = [encode_record(r) for r in records]
    out = {"read the lines": _cpu_us(n, lambda: [_record(line) for line in lines])}
    out["mlflow_view"] = _cpu_us(n, lambda: [mlflow_view(r) for r in records])
    views = [mlflow_view(r) for r in records]
    out["rows"] = _cpu_us(n, lambda: [writer.rows.trace(v) for v in views])
    translated = []
    m = writer.m
    own = m.translate_span_when_storing
    m.translate_span_when_storing = lambda span: translated.append(1) or own(span)
    try:
        traces = [writer.rows.trace(v) for v in views]
    finally:
        m.translate_span_when_storing = own
    out["spans through MLflow's translation"] = len(translated) / n
    rows = _table_rows(traces, traces)
    with writer.store.ManagedSessionMaker() as session:
        cursor = session.connection().connection.cursor()
        packs = {t: binary_columns(cursor, t, list(rows[k][0])) for k, t in
                 (("tags", "trace_tags"), ("spans", "spans"))}  # fmt: skip
    out["COPY data"] = _cpu_us(n, lambda: [
        copy_binary(rows[k], list(rows[k][0]), packs[t]) for k, t in
        (("tags", "trace_tags"), ("spans", "spans"))])  # fmt: skip
    c0 = time.process_time()
    for i in range(0, n, batch):
        writer.write(views[i : i + batch])
    out["write (rows, COPY data, round trips)"] = (time.process_time() - c0) / n * 1e6
    return out


def _process(uri: str, n: int) -> dict[str, float]:
    """``n`` trajectories traced into ``uri`` by this process, as a rollout worker does (after
    50 that start the export child and open the store): CPU us a trace of the process and of
    its export child."""
    import os

    import tracer
    from benchmarks.ingest import trace_one, writer_config
    from benchmarks.ingest_procs import tree_cpu_s

    gc.unfreeze()  # a user's process is never frozen: its collector walks everything,
    gc.enable()  # and runs as it will, from a full pass (as a process that ran a while: not
    gc.collect()  # with all that this one made so far pending for its first full pass)
    spool = tempfile.mkdtemp(prefix="ingest-spool-")
    tracer.init(writer_config(uri, "process", "w0", spool))
    try:
        ids = list(range(300))
        for i in range(50):
            trace_one(i, ids)
        assert tracer.flush(120)
        own0, tree0 = time.process_time(), tree_cpu_s(os.getpid())
        for i in range(50, 50 + n):
            trace_one(i, ids)
        assert tracer.flush(600)
        process, tree = time.process_time() - own0, tree_cpu_s(os.getpid()) - tree0
    finally:
        tracer.shutdown()
        shutil.rmtree(spool, ignore_errors=True)
    return {"the rollout process": process / n * 1e6,
            "its export child": (tree - process) / n * 1e6, "both": tree / n * 1e6}


def _sql(uri: str, query: str) -> list[Any]:
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            result = conn.execute(sqlalchemy.text(query))
            return list(result.all()) if result.returns_rows else []
    finally:
        engine.dispose()


def _schema(uri: str) -> dict[str, tuple[int, int]]:
    """Per table: (foreign keys, indexes)."""
    out = {}
    for table in TABLES:
        [(fks,)] = _sql(uri, f"SELECT count(*) FROM pg_constraint WHERE conrelid = "
                             f"'{table}'::regclass AND contype = 'f'")  # fmt: skip
        [(indexes,)] = _sql(uri, f"SELECT count(*) FROM pg_indexes WHERE tablename = '{table}'")
        out[table] = (int(fks), int(indexes))
    return out


# What a PostgreSQL backend's sample was doing: the first part here (outermost first) whose
# functions are on its stack. Names from the server binary's dynamic symbols (Debian strips
# the rest; a static function reads as an address and is counted under its caller).
_PARTS = (
    ("commit", ("CommitTransactionCommand",)),
    ("foreign-key checks (a query a row and key)", ("AfterTriggerEndQuery",)),
    ("index inserts", ("ExecInsertIndexTuples",)),
    ("TOAST (lz4 of large values)", ("heap_toast_insert_or_update",)),
    ("heap insert: relation extension", ("smgrextend",)),
    ("heap insert", ("heap_multi_insert", "heap_insert")),
    ("COPY parsing", ("NextCopyFrom",)),
    ("COPY's other work a row (generated column, slots)", ("CopyFrom",)),
    ("statements' other work (parse, plan, executor)", ("PostgresMain",)),
)
_BACKGROUND = "background processes (WAL writer, checkpointer, ...)"
# shares across the parts above: functions wherever they are on a stack
_ANYWHERE = (
    ("  of which executor start and end of foreign-key checks",
     ("AfterTriggerEndQuery",), ("standard_ExecutorStart", "standard_ExecutorEnd")),
    ("WAL insert (XLogInsert, anywhere)", (), ("XLogInsert",)),
    ("btree key compares (_bt_compare, anywhere)", (), ("_bt_compare",)),
)


def _perf_start(path: str) -> subprocess.Popen[bytes] | str:
    """``perf record`` of the whole machine with call stacks (dwarf: the server has no frame
    pointers), or why not."""
    if not shutil.which("perf"):
        return "perf is not installed"
    perf = subprocess.Popen(
        ["perf", "record", "-a", "-F", "499", "--call-graph", "dwarf,32768", "-o", path],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    time.sleep(1.5)  # perf is sampling from here
    if perf.poll() is not None:
        assert perf.stderr is not None
        return f"perf record failed: {perf.stderr.read().decode()[-300:]}"
    return perf


def _perf_shares(path: str, postmaster: int) -> list[tuple[str, float]]:
    """The server's samples in ``path`` by part (per cent of the server's samples); the
    processes are the postmaster's children (backends: those with ``PostgresMain`` on a
    stack)."""
    from benchmarks.ingest_procs import children

    pids = [postmaster, *children(postmaster)]
    out = subprocess.run(
        ["perf", "script", "-i", path, "-F", "pid,ip,sym", "--pid", ",".join(map(str, pids))],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    samples: list[tuple[int, list[str]]] = []
    for block in out.split("\n\n"):
        lines = block.strip("\n").split("\n")
        if lines and lines[0].strip().isdigit():
            frames = [line.split(None, 1)[1] if " " in line.strip() else "?" for line in lines[1:]]
            samples.append((int(lines[0]), [f.strip() for f in frames]))
    backends = {pid for pid, frames in samples if "PostgresMain" in frames}
    counts: collections.Counter[str] = collections.Counter()
    for pid, frames in samples:
        on_stack = set(frames)
        if pid not in backends:
            counts[_BACKGROUND] += 1
            continue
        part = next((name for name, fns in _PARTS if on_stack.intersection(fns)), "other")
        counts[part] += 1
        for name, within, fns in _ANYWHERE:
            if on_stack.issuperset(within) and on_stack.intersection(fns):
                counts[name] += 1
    parts = [name for name, _ in _PARTS] + ["other", _BACKGROUND]
    total = max(sum(counts[name] for name in parts), 1)
    return [(name, 100 * counts[name] / total) for name in parts + [n for n, _, _ in _ANYWHERE]]


def main(argv: list[str] | None = None) -> int:
    from benchmarks.ingest_procs import tree_cpu_s
    from benchmarks.postgres import postgres_available, temporary_cluster
    from tracer.backends.export_process import freeze_long_lived
    from tracer.backends.mlflow_backend import MlflowExporter, mlflow_view
    from tracer.config import TraceConfig

    p = argparse.ArgumentParser(prog="python -m benchmarks.ingest_profile", description=__doc__)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--process", action="store_true",
                   help="also trace the trajectories for real from this process (with its "
                        "export child) and print both processes' CPU a trace")
    p.add_argument("--store", type=int, default=0,
                   help="traces the PostgreSQL side's store holds before its measured window "
                        "(written the same way, in batches): a store that grew, not an empty one")
    p.add_argument("--perf", action="store_true",
                   help="also write as many traces again under perf record and print where "
                        "PostgreSQL's CPU went (root, perf installed)")
    a = p.parse_args(argv)
    if why := postgres_available():
        print(f"skipped: {why}")
        return 0
    with temporary_cluster("stages", "postgres_side", "process") as cluster:
        stages_uri, uri, process_uri = cluster.uris
        if a.store:
            config = TraceConfig(backend=None, tracking_uri=uri, project_name="profile")
            held = _prefill(MlflowExporter(config).bulk, a.store, a.batch)
            print(f"## the PostgreSQL side's store holds {held} traces before its window")
        records = _records(a.n * 2 if a.perf else a.n)  # made after those: newer ids
        config = TraceConfig(backend=None, tracking_uri=stages_uri, project_name="profile")
        writer = MlflowExporter(config).bulk
        assert writer is not None
        freeze_long_lived()  # as the export child does once its backend is made
        print(f"## writer: CPU us a trace of 20 spans ({a.n} traces, batches of {a.batch})")
        for stage, us in _writer(writer, records[: a.n], a.batch).items():
            print(f"  {stage:40s} {us:8.1f}")

        config = TraceConfig(backend=None, tracking_uri=uri, project_name="profile")
        writer = MlflowExporter(config).bulk
        assert writer is not None
        views = [mlflow_view(r) for r in records[: a.n]]
        _sql(uri, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        _sql(uri, "CHECKPOINT")
        [(lsn,)] = _sql(uri, "SELECT pg_current_wal_lsn()")
        _sql(uri, "SELECT pg_stat_statements_reset()")
        pg = cluster.postmaster_pid()
        cpu0 = tree_cpu_s(pg)
        for i in range(0, len(views), a.batch):
            writer.write(views[i : i + a.batch])
        time.sleep(2)  # the WAL writer's and background writer's share
        cpu = (tree_cpu_s(pg) - cpu0) / a.n * 1e6
        [(wal,)] = _sql(uri, f"SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '{lsn}')")
        batches = -(-a.n // a.batch)
        print(f"\n## PostgreSQL: CPU {cpu:.0f} us a trace (its processes), WAL "
              f"{float(wal) / a.n / 1024:.1f} KiB a trace; load average (1, 5, 15 min) "
              f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")  # fmt: skip
        print("  table                   rows a trace  foreign keys a row  indexes a row")
        for table, (fks, indexes) in _schema(uri).items():
            [(rows,)] = _sql(uri, f"SELECT count(*) FROM {table}")
            print(f"  {table:24s} {rows / a.n:12.2f} {fks:19d} {indexes:14d}")
        statements = _sql(uri, (
            "SELECT query, calls, total_exec_time FROM pg_stat_statements WHERE dbid = (SELECT "
            "oid FROM pg_database WHERE datname = current_database()) "
            "ORDER BY total_exec_time DESC LIMIT 10"))  # fmt: skip
        print("  us a trace  calls a batch  statement (pg_stat_statements)")
        for query, calls, total in statements:
            print(f"  {total / a.n * 1000:10.1f} {calls / batches:14.1f}  "
                  f"{' '.join(query.split())[:90]}")  # fmt: skip
        if a.perf:
            with tempfile.TemporaryDirectory(prefix="rt-perf-") as folder:
                path = os.path.join(folder, "perf.data")
                perf = _perf_start(path)
                if isinstance(perf, str):
                    print(f"\n## where PostgreSQL's CPU goes: skipped: {perf}")
                else:
                    views = [mlflow_view(r) for r in records[a.n :]]
                    for i in range(0, len(views), a.batch):
                        writer.write(views[i : i + a.batch])
                    time.sleep(1)
                    perf.send_signal(signal.SIGINT)
                    perf.wait(timeout=120)
                    print(f"\n## where PostgreSQL's CPU goes: per cent of its samples ({a.n} "
                          "more traces, perf record -a --call-graph dwarf)")  # fmt: skip
                    for part, share in _perf_shares(path, pg):
                        print(f"  {share:5.1f}  {part}")
        if a.process:
            print(f"\n## traced for real: CPU us a trace ({a.n} traces, the export child on)")
            for side, us in _process(process_uri, a.n).items():
                print(f"  {side:40s} {us:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
