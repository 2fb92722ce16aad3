"""What counts as an outage (one line down, one back, spool) and what stays an unexpected error
(its traceback logged): PostgreSQL restarting under the bulk writer is an outage (#50)."""

from __future__ import annotations

import pytest

from tracer.outage import is_outage


class MlflowException(Exception):  # the name MLflow's wrapper has; is_outage reads text and names
    pass


@pytest.mark.parametrize(
    "text",
    [
        "(psycopg2.OperationalError) FATAL:  the database system is shutting down",
        "(psycopg2.OperationalError) FATAL:  the database system is starting up",
        "server closed the connection unexpectedly\n\tThis probably means the server terminated",
        'connection to server at "127.0.0.1", port 5433 failed: Connection refused',
    ],
)
def test_postgresql_going_away_is_an_outage(text: str) -> None:
    try:
        try:
            raise RuntimeError(text)
        except RuntimeError as inner:
            raise MlflowException("SQLAlchemy database error") from inner
    except MlflowException as exc:
        assert is_outage(exc)


def test_a_bug_is_not_an_outage() -> None:
    assert not is_outage(KeyError("trace_id"))
    assert not is_outage(ValueError("duplicate key value violates unique constraint"))
