"""Where a trace's time goes on the bulk path, in the writer and in PostgreSQL.

    python -m benchmarks.ingest_profile [--n 1024] [--batch 256]

One process, one throwaway PostgreSQL. The same trajectories (20 spans, as benchmarks/ingest.py
makes them) are written twice into two fresh databases, side by side:

- **values**: the rows as multi-row ``INSERT ... VALUES ... ON CONFLICT DO NOTHING`` pages
  through SQLAlchemy (the bulk writer's PostgreSQL path before COPY);
- **copy**: the bulk writer as it is (COPY into staging tables, INSERT ... SELECT).

It prints the writer's CPU per trace by stage (MLflow's view of a record, building the rows,
of which MLflow's ``translate_span_when_storing``, writing them), PostgreSQL's own execution
time per statement from ``pg_stat_statements``, and the indexes MLflow's schema puts on
``spans``.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

# cProfile's names of the calls that wait on the server
WAITS = tuple(
    f"~:<method '{name}' of 'psycopg2.extensions.cursor' objects>"
    for name in ("execute", "copy_expert")
)


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


def _values_insert(writer: Any, batch: list[Any]) -> None:
    """The previous PostgreSQL path: one multi-row VALUES insert per table (SQLAlchemy pages
    an ON CONFLICT insert only with RETURNING), after looking up which traces are stored."""
    from sqlalchemy.dialects import postgresql

    from tracer.backends.mlflow_bulk import _table_rows

    m = writer.m
    traces = [writer.rows.trace(r) for r in batch]
    now = int(time.time() * 1000)
    with writer.store.ManagedSessionMaker(read_only=False) as session:
        stored = writer._stored(session, traces)
        new = [t for t in traces if t.trace_id not in stored]
        rows = _table_rows(new, traces)
        rows["assessments"] = [writer.rows.reward_row(t, now) for t in new if t.reward is not None]
        for name, model in (("info", m.SqlTraceInfo), ("tags", m.SqlTraceTag),
                            ("metadata", m.SqlTraceMetadata), ("spans", m.SqlSpan),
                            ("assessments", m.SqlAssessments)):  # fmt: skip
            if rows[name]:
                table = model.__table__
                stmt: Any = postgresql.insert(table).on_conflict_do_nothing()
                stmt = stmt.returning(next(iter(table.primary_key.columns)))
                session.connection().execute(stmt, rows[name])


def _pg_statements(uri: str) -> list[tuple[str, int, float, float]]:
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri)
    with engine.connect() as conn:
        rows = conn.execute(sqlalchemy.text(
            "SELECT query, calls, total_exec_time, rows FROM pg_stat_statements "
            "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "ORDER BY total_exec_time DESC LIMIT 8"
        )).all()  # fmt: skip
    engine.dispose()
    return [(q, c, t, r) for q, c, t, r in rows]


def _reset_statements(uri: str) -> None:
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text("CREATE EXTENSION IF NOT EXISTS pg_stat_statements"))
        conn.execute(sqlalchemy.text("SELECT pg_stat_statements_reset()"))
    engine.dispose()


def _indexes(uri: str) -> list[str]:
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri)
    with engine.connect() as conn:
        rows = conn.execute(sqlalchemy.text(
            "SELECT indexdef FROM pg_indexes WHERE tablename = 'spans'"
        )).scalars().all()  # fmt: skip
    engine.dispose()
    return list(rows)


def main(argv: list[str] | None = None) -> int:
    import cProfile
    import pstats

    from benchmarks.postgres import postgres_available, temporary_postgres
    from tracer.backends.mlflow_backend import MlflowExporter, mlflow_view
    from tracer.config import TraceConfig

    p = argparse.ArgumentParser(prog="python -m benchmarks.ingest_profile", description=__doc__)
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    a = p.parse_args(argv)
    if why := postgres_available():
        print(f"skipped: {why}")
        return 0
    records = _records(a.n)
    batches = [records[i : i + a.batch] for i in range(0, len(records), a.batch)]
    with temporary_postgres("values", "copy") as uris:
        for mode, uri in zip(("values", "copy"), uris, strict=True):
            exporter = MlflowExporter(TraceConfig(backend=None, tracking_uri=uri,
                                                  project_name="profile"))  # fmt: skip
            writer = exporter.bulk
            assert writer is not None
            _reset_statements(uri)
            profile = cProfile.Profile()
            c0, t0 = time.process_time(), time.perf_counter()
            profile.enable()
            for batch in batches:
                views = [mlflow_view(r) for r in batch]
                if mode == "copy":
                    writer.write(views)
                else:
                    _values_insert(writer, views)
            profile.disable()
            cpu, wall = time.process_time() - c0, time.perf_counter() - t0
            stats = pstats.Stats(profile)
            cum = {f"{k[0].rsplit('/', 1)[-1]}:{k[2]}": v[3] for k, v in stats.stats.items()}  # type: ignore[attr-defined]

            def ms(*names: str, cum: dict[str, float] = cum) -> str:
                s = sum(cum.get(n, 0.0) for n in names)
                return f"{s / len(records) * 1000:.2f}"

            print(f"\n## {mode}: {len(records)} traces of 20 spans, batches of {a.batch}")
            print(f"writer: wall {wall:.2f} s, CPU {cpu / len(records) * 1000:.2f} ms a trace "
                  "(under cProfile: compare the stages, not the totals)")  # fmt: skip
            print(f"  ms a trace: mlflow_view {ms('mlflow_backend.py:mlflow_view')}, rows "
                  f"{ms('mlflow_bulk_rows.py:trace')} (MLflow's translation "
                  f"{ms('__init__.py:translate_span_when_storing')}), COPY text "
                  f"{ms('mlflow_bulk_copy.py:copy_text')}, "
                  f"waiting on PostgreSQL {ms(*WAITS)}")  # fmt: skip
            print("PostgreSQL (pg_stat_statements), by total execution time:")
            for query, calls, total, rows in _pg_statements(uri):
                print(f"  {total / len(records) * 1000:8.1f} us a trace  {calls:5d} calls "
                      f"{rows:7d} rows  {' '.join(query.split())[:110]}")  # fmt: skip
        print("\nindexes on spans:")
        for index in _indexes(uris[1]):
            print(f"  {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
