"""Many writers on one PostgreSQL-backed MLflow store, as every node of a job is: the first open
of an empty database, the bulk path from several processes, replay. Real PostgreSQL (the
session's throwaway server, a fresh database per test), read back with MLflow's client."""

from __future__ import annotations

import multiprocessing
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("psycopg2")

WRITERS_AT_ONCE = 16


@pytest.fixture
def fresh_database(postgres_uri: str) -> Iterator[str]:
    """An empty database on the session's PostgreSQL server (no MLflow schema yet)."""
    import sqlalchemy

    name = f"fresh_{uuid.uuid4().hex[:12]}"
    admin = sqlalchemy.create_engine(postgres_uri, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
    try:
        yield postgres_uri.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(sqlalchemy.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


def _open_store(uri: str, barrier: Any) -> str:
    """One writer's init: wait for the others, then open the store as the tracer does."""
    from tracer.backends.mlflow_backend import MlflowExporter
    from tracer.config import TraceConfig

    barrier.wait(timeout=300)
    try:
        exporter = MlflowExporter(
            TraceConfig(backend=None, tracking_uri=uri, project_name="first-open")
        )
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return "bulk" if exporter.bulk is not None else "no bulk writer"


@pytest.mark.slow(seconds=40)
def test_writers_started_together_on_an_empty_database_all_open_it(fresh_database: str) -> None:
    """16 processes open one empty database at the same instant (a barrier): MLflow's schema
    is created once, every one of them gets the store, the experiment and the bulk writer."""
    # forkserver: MLflow is imported once, in the server, and each writer is a fork of it
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tracer.backends.mlflow_backend", "mlflow.store.db.utils"])
    barrier = ctx.Manager().Barrier(WRITERS_AT_ONCE)
    with ctx.Pool(WRITERS_AT_ONCE) as pool:
        outcomes = pool.starmap(_open_store, [(fresh_database, barrier)] * WRITERS_AT_ONCE)
    assert outcomes == ["bulk"] * WRITERS_AT_ONCE

    from mlflow.tracking import MlflowClient

    experiments = MlflowClient(tracking_uri=fresh_database).search_experiments()
    assert sorted(e.name for e in experiments) == ["Default", "first-open"]
