"""The first open of an MLflow SQL store, once per database however many processes open it.

Opening an empty database makes MLflow create its schema (``_initialize_tables``: tables, then
alembic's migrations) and its default experiment. MLflow checks "do the tables exist?" and then
creates them, with nothing in between: every worker of a job started at once sees an empty
database and runs the migrations too, and all but one fail (``UniqueViolation`` on
``pg_type_typname_nsp_index``, "table _alembic_tmp_... already exists" on sqlite).

So a process opens the store holding a lock that every writer of the same database takes:

- PostgreSQL: a session-level advisory lock (``pg_advisory_lock``) on a connection of its own,
  held while MLflow opens the store and the experiment is looked up or created. Advisory locks
  live in the database, so writers on different hosts wait for each other; one that dies
  releases it with its connection. Once the schema is there, the wait is MLflow's check only.
- sqlite: an exclusive ``flock`` on a file beside the database (one host by nature).

A database that cannot be reached for the lock is opened without it: MLflow's own retries and
errors then say what is wrong, as they would without this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

try:
    import fcntl
except ImportError:  # Windows: no flock; concurrent first opens of a sqlite file are not serialized
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("tracer")

# One 64-bit key in PostgreSQL's advisory-lock space (per database), picked at random once.
# Another program using the same key only makes the two wait for each other.
SCHEMA_LOCK_KEY = 0x2D5A_6E31_0B7C_4F19
LOCK_WAIT_S = 600  # a first open that holds the lock longer than this is stuck, not slow


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
        with conn:
            conn.execute(sqlalchemy.text(f"SET lock_timeout = '{LOCK_WAIT_S}s'"))
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": SCHEMA_LOCK_KEY})
            conn.commit()  # the lock is the session's, not the transaction's
            try:
                yield
            finally:
                with contextlib.suppress(Exception):  # closing the connection releases it too
                    conn.execute(
                        sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": SCHEMA_LOCK_KEY}
                    )
                    conn.commit()
    finally:
        engine.dispose()
