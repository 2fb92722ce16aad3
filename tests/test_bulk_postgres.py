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


TRAJECTORIES_PER_WRITER = 24
BATCH = 8


def _trajectories(worker: str) -> list[Any]:
    """A writer's trajectories (the memory backend keeps them): a root, 2 x generate/parse/tool
    and a reward, as a rollout worker makes them."""
    import tracer
    from tracer.testing import InMemoryExporter

    tracer.init(backend="memory", token2text=False, worker_id=worker)

    @tracer.trace_op(kind="generate")
    def generate(prompt_ids: list[int], turn: int) -> dict[str, Any]:
        return {"response_ids": prompt_ids[:8], "content": f"turn {turn}\ttab\nline \\ end"}

    @tracer.trace_op(kind="parse")
    def parse(text: str) -> list[dict[str, Any]]:
        return [{"name": "calculator", "arguments": {"expression": "2+3"}}]

    @tracer.trace_op(kind="tool")
    def calculator(expression: str) -> str:
        return "5"

    @tracer.trace_op(kind="reward")
    def reward(answer: str) -> float:
        return 1.0

    for i in range(TRAJECTORIES_PER_WRITER):
        with tracer.trace_attr(step=i // 8, sample_index=i % 8, rollout_n=0):
            for turn in range(2):
                generate(list(range(32)), turn)
                parse("CALL calculator")
                calculator("2+3")
            reward("5")
    assert tracer.flush(60)
    records = list(InMemoryExporter.latest().records)
    tracer.reset()
    return records


def _bulk_writer(uri: str, worker: str, barrier: Any) -> list[Any]:
    """One writer process: its trajectories through the bulk path, a batch at a time, started
    together with the others. Returns its records, for the replay."""
    from tracer.backends.mlflow_backend import MlflowExporter
    from tracer.config import TraceConfig

    records = _trajectories(worker)
    exporter = MlflowExporter(TraceConfig(backend=None, tracking_uri=uri, project_name="bulk4"))
    assert exporter.bulk is not None and exporter.bulk.copy
    barrier.wait(timeout=300)
    for i in range(0, len(records), BATCH):
        exporter.export(records[i : i + BATCH])
    return records


def _stored(uri: str) -> dict[str, tuple[Any, ...]]:
    """Per trace, as MLflow's client reads it: span names in start order, their parents' names,
    assessment names, the generate spans' outputs."""
    from mlflow.tracking import MlflowClient

    from tests.conftest import search_traces

    client = MlflowClient(tracking_uri=uri)
    out = {}
    for found in search_traces(uri, "bulk4"):
        trace = client.get_trace(found.info.trace_id)
        spans = sorted(trace.data.spans, key=lambda s: (s.start_time_ns, s.span_id))
        names = {s.span_id: s.name for s in spans}
        parents = [names.get(s.parent_id) if s.parent_id else None for s in spans]
        assessments = sorted(a.name for a in trace.info.assessments)
        assert found.info.trace_id not in out
        outputs = [s.outputs for s in spans if s.name == "generate"]
        out[found.info.trace_id] = ([s.name for s in spans], parents, assessments, outputs)
    return out


@pytest.mark.slow(seconds=40)
def test_four_writers_through_the_bulk_path_store_every_trace_once(
    fresh_database: str,
) -> None:
    """4 processes write batches at once by INSERT ... VALUES and COPY; MLflow's client reads every
    trace once, with its spans in order under the root and its reward; replaying every batch
    (from one process, then again split differently) adds nothing."""
    from tracer.backends.mlflow_backend import MlflowExporter
    from tracer.config import TraceConfig

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tracer.backends.mlflow_backend", "mlflow.store.db.utils"])
    barrier = ctx.Manager().Barrier(4)
    with ctx.Pool(4) as pool:
        per_writer = pool.starmap(
            _bulk_writer, [(fresh_database, f"w{i}", barrier) for i in range(4)]
        )
    records = [r for rs in per_writer for r in rs]
    stored = _stored(fresh_database)
    assert len(stored) == len(records) == 4 * TRAJECTORIES_PER_WRITER
    turn = ["generate", "parse", "calculator"]
    for names, parents, assessments, outputs in stored.values():
        assert names == ["trajectory", *turn, *turn, "reward"]
        assert parents == [None] + ["trajectory"] * 7
        assert assessments == ["reward"]
        # COPY's text format escapes tab, newline and backslash; they come back as they went
        assert [o["content"] for o in outputs] == [f"turn {t}\ttab\nline \\ end" for t in (0, 1)]
    first = _stored(fresh_database)

    exporter = MlflowExporter(
        TraceConfig(backend=None, tracking_uri=fresh_database, project_name="bulk4")
    )
    exporter.export(records, replay=True)
    exporter.export(records[5:17], replay=True)
    assert _stored(fresh_database) == first


def _long_replies(worker: str, n: int) -> list[Any]:
    """Trajectories whose generate span's content passes PostgreSQL's ~2 KB: it compresses it."""
    import tracer
    from tracer.testing import InMemoryExporter

    tracer.init(backend="memory", token2text=False, worker_id=worker)

    @tracer.trace_op(kind="generate")
    def generate(prompt: str) -> str:
        return " ".join(f"step {i}: the answer is {i * 7}." for i in range(200))

    for i in range(n):
        with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
            generate("What is 6 x 7?")
    assert tracer.flush(60)
    records = list(InMemoryExporter.latest().records)
    tracer.reset()
    return records


def _compression_of_generate_spans(uri: str) -> list[Any]:
    import sqlalchemy

    engine = sqlalchemy.create_engine(uri)
    try:
        with engine.connect() as conn:
            query = "SELECT pg_column_compression(content) FROM spans WHERE name = 'generate'"
            return sorted(row[0] for row in conn.execute(sqlalchemy.text(query)))
    finally:
        engine.dispose()


def test_large_values_go_in_lz4_unless_the_owner_chose_a_method(fresh_database: str) -> None:
    """A span's content past ~2 KB is compressed with lz4 (PostgreSQL's default, pglz, failed
    on token lists at a fifth of its CPU); MLflow reads the same text back. A method set for
    the database is the owner's choice: the writer keeps it."""
    import sqlalchemy
    from mlflow.tracking import MlflowClient

    from tests.conftest import search_traces
    from tracer.backends.mlflow_backend import MlflowExporter
    from tracer.config import TraceConfig

    engine = sqlalchemy.create_engine(fresh_database, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        query = "SELECT enumvals FROM pg_settings WHERE name = 'default_toast_compression'"
        if "lz4" not in (conn.execute(sqlalchemy.text(query)).scalar() or ()):
            pytest.skip("this PostgreSQL is built without lz4")
    config = TraceConfig(backend=None, tracking_uri=fresh_database, project_name="lz4")
    exporter = MlflowExporter(config)
    assert exporter.bulk is not None and exporter.bulk.copy
    exporter.export(_long_replies("w0", 3))
    assert _compression_of_generate_spans(fresh_database) == ["lz4"] * 3
    client = MlflowClient(tracking_uri=fresh_database)
    expected = " ".join(f"step {i}: the answer is {i * 7}." for i in range(200))
    for found in search_traces(fresh_database, "lz4"):
        spans = client.get_trace(found.info.trace_id).data.spans
        assert [s.outputs for s in spans if s.name == "generate"] == [expected]

    with engine.connect() as conn:
        name = fresh_database.rsplit("/", 1)[1]
        conn.execute(sqlalchemy.text(f"ALTER DATABASE {name} SET default_toast_compression = pglz"))
    engine.dispose()
    exporter.bulk.store.engine.dispose()  # MLflow keeps its store: new connections see the setting
    MlflowExporter(config).export(_long_replies("w1", 3))
    assert _compression_of_generate_spans(fresh_database) == ["lz4"] * 3 + ["pglz"] * 3
