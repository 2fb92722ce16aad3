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
import threading
from collections.abc import Iterator
from typing import Any

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


def _open_in_thread(uri: str) -> tuple[threading.Thread, threading.Event]:
    """A thread that goes into ``store_init_lock(uri)``, and the event it sets there."""
    from tracer.backends.mlflow_store_init import store_init_lock

    entered = threading.Event()

    def open_it() -> None:
        with store_init_lock(uri):
            entered.set()

    thread = threading.Thread(target=open_it, daemon=True)
    thread.start()
    return thread, entered


def test_the_schema_lock_is_waited_for_on_an_empty_store_only(fresh_database: str) -> None:  # noqa: F811
    """Another process holds the schema lock. On the empty database an open waits for it (it
    would run MLflow's migrations); once MLflow's schema is at its head revision an open goes
    in at once (MLflow creates nothing then): a job's workers starting again on their store
    do not open it one at a time, and a pool of 1 behind PgBouncer can open it."""
    import sqlalchemy
    from mlflow.tracking import MlflowClient

    from tracer.backends.mlflow_store_init import SCHEMA_LOCK_KEY

    engine = sqlalchemy.create_engine(fresh_database)
    lock = sqlalchemy.text("SELECT pg_advisory_xact_lock(:k)")
    try:
        with engine.connect() as holder:
            holder.execute(lock, {"k": SCHEMA_LOCK_KEY})
            thread, entered = _open_in_thread(fresh_database)
            assert not entered.wait(2.0)  # the empty database: it waits
            holder.rollback()  # the lock is let go
        assert entered.wait(30)
        thread.join(30)
        MlflowClient(tracking_uri=fresh_database).search_experiments()  # MLflow's schema
        with engine.connect() as holder:
            holder.execute(lock, {"k": SCHEMA_LOCK_KEY})
            thread, entered = _open_in_thread(fresh_database)
            assert entered.wait(30)  # the schema is current: no wait
            holder.rollback()
        thread.join(30)
    finally:
        engine.dispose()


@pytest.mark.slow(seconds=15)
def test_a_pool_of_one_opens_a_store_that_has_its_schema(fresh_database: str) -> None:  # noqa: F811
    """Through PgBouncer with 1 server connection: a store whose schema is made opens (the
    bulk writer on), and a trace goes in; an empty one needs 2 (docs/scale-out.md)."""
    from benchmarks.postgres import pgbouncer, pgbouncer_available

    if why := pgbouncer_available():
        pytest.skip(why)
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=fresh_database).search_experiments()  # MLflow's schema
    done: list[list[Any]] = []
    with pgbouncer([fresh_database], pool_size=1) as bouncer:
        writer = threading.Thread(target=lambda: done.append(
            _bulk_writer(bouncer.uris[0], "pool-of-one", threading.Barrier(1))), daemon=True)
        writer.start()
        writer.join(120)  # bounded: before, its open waited for a second server connection
    assert done, "the writer did not open the store through a pool of 1 in 120 s"
    assert len(done[0]) == TRAJECTORIES_PER_WRITER
    assert len(_stored(fresh_database)) == TRAJECTORIES_PER_WRITER
