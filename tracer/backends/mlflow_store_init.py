"""The first open of an MLflow SQL store, once per database however many processes open it.

Opening an empty database makes MLflow create its schema (``_initialize_tables``: tables, then
alembic's migrations) and its default experiment. MLflow checks "do the tables exist?" and then
creates them, with nothing in between: every worker of a job started at once sees an empty
database and runs the migrations too, and all but one fail (``UniqueViolation`` on
``pg_type_typname_nsp_index``, "table _alembic_tmp_... already exists" on sqlite).

So a process opens the store holding a lock that every writer of the same database takes:

- PostgreSQL: a transaction-level advisory lock (``pg_try_advisory_xact_lock``, asked for
  again until it is free) in a transaction of its own, on a connection of its own, held open
  while MLflow opens the store and the experiment is looked up or created; so it works behind
  PgBouncer in transaction mode too (with at least 2 server connections: the holder's lock
  keeps one while MLflow opens the store on another). Advisory locks live in the database, so
  writers on different hosts wait for each other; one that dies releases it with its
  connection. A database whose schema is already at the installed MLflow's head revision is
  opened without the lock: MLflow migrates only a database that lacks tables (its default
  experiment's insert tolerates a second one, and the tracer's experiment creation a lost
  race), and the hundreds of workers of a job that starts again on its store would otherwise
  open it one at a time.
- sqlite: an exclusive ``flock`` on a file beside the database (one host by nature).

A database that cannot be reached for the lock is opened without it: MLflow's own retries and
errors then say what is wrong, as they would without this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Iterator
from typing import Any

try:
    import fcntl
except ImportError:  # Windows: no flock; concurrent first opens of a sqlite file are not serialized
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("tracer")

# One 64-bit key in PostgreSQL's advisory-lock space (per database), picked at random once.
# Another program using the same key only makes the two wait for each other.
SCHEMA_LOCK_KEY = 0x2D5A_6E31_0B7C_4F19
LOCK_WAIT_S = 600  # a first open that holds the lock longer than this is stuck, not slow
LOCK_POLL_S = (0.05, 1.0)  # a waiting process asks again after this, doubling up to the most


@contextlib.contextmanager
def store_init_lock(uri: str) -> Iterator[None]:
    """Hold the lock of the store at ``uri`` (an MLflow tracking URI) while the body opens it;
    a no-op for a tracking server or any other URI."""
    if uri.startswith("sqlite:///"):
        with _sqlite_lock(uri[len("sqlite:///") :]):
            yield
    elif uri.startswith("postgresql"):
        with _postgres_lock(uri):
            yield
    else:
        yield


@contextlib.contextmanager
def _sqlite_lock(path: str) -> Iterator[None]:
    if fcntl is None:
        yield
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(f"{path}.rollout-tracer.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _postgres_lock(uri: str) -> Iterator[None]:
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    engine = sqlalchemy.create_engine(uri, poolclass=NullPool)
    try:
        try:
            conn = engine.connect()
        except Exception as exc:  # MLflow's own open will retry and say what is wrong
            log.debug("rollout-tracer: no schema lock on %s: %s", engine.url, exc)
            yield
            return
        if _schema_is_current(conn):  # nothing to create: no lock, no connection held
            conn.close()
            yield
            return
        # The lock is a transaction's, held open while the body runs and ended by its rollback
        # (or the connection's end); a waiter asks again (LOCK_POLL_S, doubling) in short
        # transactions instead of waiting inside one. Behind PgBouncer in transaction mode a
        # session's lock stays with the server connection, which the next client gets: it was
        # never released, and every other worker waited LOCK_WAIT_S. A waiter holding its
        # server connection while it waited would take the one the holder's open needs.
        with conn:
            deadline = time.monotonic() + LOCK_WAIT_S
            wait, jitter = LOCK_POLL_S[0], random.Random()  # its own generator: not the user's
            while not conn.execute(
                sqlalchemy.text("SELECT pg_try_advisory_xact_lock(:k)"), {"k": SCHEMA_LOCK_KEY}
            ).scalar():
                conn.rollback()
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the schema lock of {engine.url!r} was held by another process for "
                        f"{LOCK_WAIT_S} s (pg_advisory_xact_lock key {SCHEMA_LOCK_KEY})"
                    )
                # thousands of workers of a job wait at its first start: spread their asks
                time.sleep(wait * (0.5 + jitter.random()))
                wait = min(wait * 2, LOCK_POLL_S[1])
            try:
                yield
            finally:
                with contextlib.suppress(Exception):  # the connection's end releases it too
                    conn.rollback()
    finally:
        engine.dispose()


def schema_revision(conn: Any) -> str | None:
    """The alembic revision MLflow's schema is at, read with ``conn`` (a SQLAlchemy
    connection or session); raises when the database has no schema yet."""
    import sqlalchemy

    found = conn.execute(sqlalchemy.text("SELECT version_num FROM alembic_version")).scalar()
    return None if found is None else str(found)


def _schema_is_current(conn: Any) -> bool:
    """Whether the database's MLflow schema is at the installed MLflow's head revision (all
    of its migrations done); False when there is none yet or it cannot be told."""
    try:
        from mlflow.store.db.utils import _get_latest_schema_revision

        found = schema_revision(conn)
        current = found is not None and found == _get_latest_schema_revision()
    except Exception:  # no alembic_version table yet (an empty database), or MLflow moved it
        current = False
    with contextlib.suppress(Exception):
        conn.rollback()
    return current
