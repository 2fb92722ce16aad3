"""MLflow on PostgreSQL behind PgBouncer in transaction mode, the pooler docs/scale-out.md tells a
job of many nodes to put in front of its store: a real PgBouncer (benchmarks/postgres.py) with 2
server connections, in front of the session's PostgreSQL server.

Behind it a session's state stays with the server connection, which the next client's
transaction gets. The tracer's schema lock was a session-level advisory lock: a second worker
then held it as well and its migrations failed (``UniqueViolation``), or the lock was never
released and every other worker waited for its timeout. And a writer that took a second
connection while its first was in a transaction could wait for ever on a pool of two.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("psycopg2")

from tests.test_bulk_postgres import (
    TRAJECTORIES_PER_WRITER,
    _bulk_writer,
    _open_store,
    _stored,
    fresh_database,  # noqa: F401  (a fixture)
)

AT_ONCE = 6
POOL = 2


@pytest.fixture
def bounced(fresh_database: str) -> Iterator[str]:  # noqa: F811
    """``fresh_database`` through PgBouncer (transaction mode, 2 server connections)."""
    from benchmarks.postgres import pgbouncer, pgbouncer_available

    if why := pgbouncer_available():
        pytest.skip(why)
    with pgbouncer([fresh_database], pool_size=POOL) as bouncer:
        yield bouncer.uris[0]


@pytest.mark.slow(seconds=40)
def test_behind_pgbouncer_writers_open_an_empty_store_at_once_and_store_every_trace_once(
    bounced: str, fresh_database: str  # noqa: F811
) -> None:
    """6 processes open the empty database through the pooler at the same instant: the schema is
    made once and each gets the bulk writer; then 4 write their batches at once through it,
    and MLflow's client, on a direct connection, reads every trace once. No session setting
    of the tracer's is left on the pooled server connections."""
    import sqlalchemy
    from mlflow.tracking import MlflowClient

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tracer.backends.mlflow_backend", "mlflow.store.db.utils"])
    manager = ctx.Manager()
    with ctx.Pool(AT_ONCE) as pool:
        # bounded: the session lock made the other workers wait 600 s
        together = manager.Barrier(AT_ONCE)  # held here: a proxy let go is gone in the manager
        opened = pool.starmap_async(_open_store, [(bounced, together)] * AT_ONCE)
        assert opened.get(timeout=240) == ["bulk"] * AT_ONCE
        experiments = MlflowClient(tracking_uri=fresh_database).search_experiments()
        assert sorted(e.name for e in experiments) == ["Default", "first-open"]

        barrier = manager.Barrier(4)
        written = pool.starmap_async(
            _bulk_writer, [(bounced, f"w{i}", barrier) for i in range(4)]
        ).get(timeout=240)
    assert sum(map(len, written)) == 4 * TRAJECTORIES_PER_WRITER
    assert len(_stored(fresh_database)) == 4 * TRAJECTORIES_PER_WRITER

    # both server connections at once (two transactions open): the server's own timeout
    engine = sqlalchemy.create_engine(bounced)
    with engine.connect() as one, engine.connect() as two:
        seen = [c.execute(sqlalchemy.text("SHOW lock_timeout")).scalar() for c in (one, two)]
        pids = {c.execute(sqlalchemy.text("SELECT pg_backend_pid()")).scalar() for c in (one, two)}
    engine.dispose()
    assert len(pids) == POOL and seen == ["0"] * POOL
