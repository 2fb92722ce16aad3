"""A retried sample is a new trajectory, never an overwrite; annotations wait for their trace.

Every case runs on a real store read back with that store's own client: the JSONL file through
``read_jsonl``, sqlite MLflow through both writers (the bulk writer and MLflow's own
``log_spans``) and a real ``mlflow server``, read with ``MlflowClient``."""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests._forward import Outage
from tests._servers import MlflowServer
from tests.conftest import search_traces
from tracer.ids import derived_trace_id
from tracer.readers.sources import iter_jsonl
from tracer.record import read_jsonl
from tracer.testing import InMemoryExporter

SALT = "5a17" * 8
EXP = "identity"
UNTESTED_VERSION = "3.17.99"  # an MLflow release the bulk writer was never run on


def _two_attempts(exp: str = EXP, **config: Any) -> None:
    """One identity run twice (a retried sample), rewards 0.25 then 0.75; then another."""
    tracer.init(project_name=exp, experiment_name="run", run_salt=SALT,
                raise_internal_errors=True, **config)  # fmt: skip

    @tracer.trace_op(kind="reward")
    def reward(x: float) -> float:
        return x

    for value in (0.25, 0.75):
        with tracer.trace_attr(step=3, sample_index=7, rollout_n=1):
            reward(value)
    with tracer.trace_attr(step=3, sample_index=8, rollout_n=1):
        reward(1.0)
    assert tracer.flush(60), tracer.metrics()


def _first_id(sample_index: int = 7) -> str:
    # attempt 0 keeps the id a trajectory had before attempts were counted
    return derived_trace_id(SALT, EXP, "run", 3, sample_index, 1, False)


def test_a_retried_sample_is_two_lines_in_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    _two_attempts(backend="jsonl", jsonl_path=str(path))
    for _ in range(2):  # the same attempt named twice: one id, two trajectories
        with tracer.trace_attr(step=3, sample_index=9, rollout_n=1, attempt=2):
            pass
    # JSONL cannot look traces up: the latest attempt is the one this process traced last
    tracer.annotate(step=3, sample_index=7, rollout_n=1, values={"advantage": 0.5})
    assert tracer.flush(60)
    [page] = iter_jsonl(str(path))
    annotated = [r.attempt for r in page if any(s.kind == "annotation" for s in r.spans)]
    assert annotated == [1]
    m = tracer.metrics()
    records = list(read_jsonl(path))
    assert m["tracer/jsonl/exported"] == len(records) == 5  # each export counted is a line
    assert len({r.trace_id for r in records if r.sample_index == 9}) == 1
    retried = sorted((r for r in records if r.sample_index == 7), key=lambda r: r.attempt)
    assert [(r.attempt, r.reward) for r in retried] == [(0, 0.25), (1, 0.75)]
    assert retried[0].trace_id == _first_id() != retried[1].trace_id
    assert retried[1].tags()["attempt"] == "1"


def _mlflow_rewards(uri: str, exp: str = EXP) -> dict[tuple[str, str], list[float]]:
    """(sample_index, attempt) -> its reward assessments, read with MLflow's client."""
    out: dict[tuple[str, str], list[float]] = {}
    for t in search_traces(uri, exp):
        key = (t.info.tags["sample_index"], t.info.tags["attempt"])
        assert key not in out, key
        out[key] = [a.value for a in t.info.assessments if a.name == "reward"]
    return out


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "log_spans"])
def test_a_retried_sample_is_two_traces_in_sqlite_mlflow(
    mlflow_uri: str, monkeypatch: pytest.MonkeyPatch, bulk: bool
) -> None:
    pytest.importorskip("mlflow")
    from tracer.backends import mlflow_bulk

    if not bulk:  # an MLflow release the bulk writer was not tested on: its log_spans path
        monkeypatch.setattr(mlflow_bulk, "mlflow_version", lambda: UNTESTED_VERSION)
    # in this process: both writers are checked here (the version is patched here), and the
    # exporter is looked at (by default MLflow's export runs the same code in a child)
    _two_attempts(backend="mlflow", tracking_uri=mlflow_uri, export_in_subprocess=False)
    exporter = tracer.current.tracer.pipeline.workers[0].exporter
    assert (exporter.bulk is not None) is bulk
    assert _mlflow_rewards(mlflow_uri) == {
        ("7", "0"): [0.25], ("7", "1"): [0.75], ("8", "0"): [1.0]}  # fmt: skip
    assert len(search_traces(mlflow_uri, EXP, "tags.attempt = '1'")) == 1
    # the export's trajectories table tells the attempts apart
    from tracer.readers.export import read_tables

    table = read_tables("mlflow", experiment=EXP, tracking_uri=mlflow_uri).trajectories
    got = sorted(zip(table["sample_index"], table["attempt"], table["reward"], strict=True))
    assert got == [(7, 0, 0.25), (7, 1, 0.75), (8, 0, 1.0)]


def test_a_retried_sample_is_two_traces_on_a_tracking_server(
    tmp_path: Path, mlflow_server: MlflowServer
) -> None:
    exp = f"{EXP}-{tmp_path.name}"  # the session's server: an experiment of our own
    _two_attempts(exp, backend="mlflow", tracking_uri=mlflow_server.url,
                  spool_dir=str(tmp_path / "s"))  # fmt: skip
    assert _mlflow_rewards(mlflow_server.url, exp) == {
        ("7", "0"): [0.25], ("7", "1"): [0.75], ("8", "0"): [1.0]}  # fmt: skip


def test_attempts_can_be_named_and_count_on_from_there(tmp_path: Path) -> None:
    """A retry run on another worker names its attempt; this process counts on above it, and
    forgets old steps (bounded memory)."""
    tracer.init(backend="memory", run_salt=SALT, project_name=EXP, experiment_name="run",
                raise_internal_errors=True)  # fmt: skip
    for attempt in (None, 3, None):
        with tracer.trace_attr(step=3, sample_index=7, rollout_n=1, attempt=attempt):
            pass
    with tracer.trace_attr(step=3, sample_index=7, rollout_n=2):  # another identity
        pass
    assert tracer.flush(10)
    records = InMemoryExporter.latest().records
    assert [r.attempt for r in records] == [0, 3, 4, 0]
    assert len({r.trace_id for r in records}) == 4
    with pytest.raises(ValueError, match="attempt"):
        tracer.trace_attr(step=1, sample_index=0, rollout_n=0, attempt=-1)
    counter = tracer.current.tracer.attempts
    for step in range(100):
        counter.take(step, ("0", "0", False))
    assert len(counter._steps) == counter.kept_steps


def _mlflow_store(uri: str, exp: str = EXP) -> dict[str, Any]:
    """What MLflow's client reads back: per trace id, its spans, duration and rewards."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out = {}
    for found in search_traces(uri, exp):
        trace = client.get_trace(found.info.trace_id)
        out[trace.info.trace_id] = (
            sorted((s.span_id, s.name, s.start_time_ns, s.end_time_ns) for s in trace.data.spans),
            trace.info.execution_duration,
            trace.info.tags["step"],
            sorted(a.value for a in trace.info.assessments if a.name == "reward"),
        )
    return out


@pytest.mark.parametrize(
    "target", ["sqlite", pytest.param("server", marks=pytest.mark.xdist_group("servers"))]
)
def test_both_writers_keep_the_first_record_of_a_trace_id(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, target: str
) -> None:
    """Re-sent ids: a replayed batch, a retry not flagged as one, and a different trajectory
    carrying a stored id (the same attempt named twice). Every writer keeps the first record
    stored: no span set merged into it, no second duration, no second reward."""
    pytest.importorskip("mlflow")
    from tracer.backends import mlflow_bulk
    from tracer.backends.mlflow_backend import MlflowExporter
    from tracer.config import TraceConfig

    tracer.init(backend="memory", run_salt=SALT, project_name=EXP, experiment_name="run")

    @tracer.trace_op(kind="reward")
    def reward(x: float) -> float:
        time.sleep(x / 100)
        return x

    for i, value in enumerate((0.25, 0.75, 1.0)):
        with tracer.trace_attr(step=3, sample_index=i, rollout_n=1):
            reward(value)
    assert tracer.flush(10)
    first, second, third = InMemoryExporter.latest().records
    # another process runs sample 0 again without naming the attempt: it counts from 0 too
    tracer.init(backend="memory", run_salt=SALT, project_name=EXP, experiment_name="run")
    with tracer.trace_attr(step=3, sample_index=0, rollout_n=1):
        reward(0.5)
        reward(0.5)
    assert tracer.flush(10)
    [clash] = InMemoryExporter.latest().records
    tracer.reset()
    assert clash.trace_id == first.trace_id and len(clash.spans) == 3
    clash_with_step = dataclasses.replace(clash, step=9)
    stores = {}
    exp = EXP
    if target == "server":  # the session's server (tests/conftest.py): an experiment of our own
        exp = f"{EXP}-{tmp_path.name}"
        paths = {"server": request.getfixturevalue("mlflow_server").url}
    else:
        paths = {w: f"sqlite:///{tmp_path / w}.db" for w in ("bulk", "log_spans")}
    for writer, uri in paths.items():
        with monkeypatch.context() as m:
            if writer == "log_spans":
                m.setattr(mlflow_bulk, "mlflow_version", lambda: UNTESTED_VERSION)
            exporter = MlflowExporter(TraceConfig(backend=None, tracking_uri=uri, project_name=exp))
        assert (exporter.bulk is not None) is (writer == "bulk")
        exporter.export([first, second])
        once = _mlflow_store(uri, exp)
        exporter.export([first, second], replay=True)  # a replayed batch
        exporter.export([second, third])  # a retry not flagged as one, and a new trace
        exporter.export([clash_with_step, first])  # another trajectory with a stored id
        exporter.export([third, clash], replay=True)
        stores[writer] = _mlflow_store(uri, exp)
        for trace_id, stored in once.items():
            assert stores[writer][trace_id] == stored, (writer, trace_id)
        assert len(stores[writer]) == 3
        assert stores[writer][f"tr-{first.trace_id}"][2] == "3"  # the first's tags
        assert sorted(v[3] for v in stores[writer].values()) == [[0.25], [0.75], [1.0]]
    if target == "sqlite":
        assert stores["bulk"] == stores["log_spans"]


def test_annotate_right_after_the_trajectory_waits_for_the_backend(
    tmp_path: Path, mlflow_server: MlflowServer
) -> None:
    """``annotate`` as the trajectory ends, the tracking server down for ~3 s: the annotation
    is pending (``flush`` says False), then applied once the server is back."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    server = Outage(mlflow_server.url)  # the session's server, behind a port that goes away
    project = f"{EXP}-{uuid.uuid4().hex[:8]}"  # the server is shared: a project of its own
    try:
        tracer.init(backend="mlflow", tracking_uri=server.url, project_name=project,
                    experiment_name="run", run_salt=SALT, spool_dir=str(tmp_path / "spool"),
                    flush_interval_s=0.1, export_max_retries=0, replay_interval_s=0.3,
                    export_timeout_s=5, annotation_timeout_s=120,
                    raise_internal_errors=True)  # fmt: skip

        @tracer.trace_op(kind="reward")
        def reward(x: float) -> float:
            return x

        # the step before: traced and annotated while the server is up
        with tracer.trace_attr(step=2, sample_index=7, rollout_n=1):
            reward(0.5)
        assert tracer.annotate(step=2, sample_index=7, rollout_n=1, values={"advantage": 0.1})
        assert tracer.flush(60), tracer.metrics()
        server.down()
        down = time.monotonic()
        with tracer.trace_attr(step=3, sample_index=7, rollout_n=1):
            reward(0.5)
        assert tracer.annotate(step=3, sample_index=7, rollout_n=1, values={"advantage": 0.7})
        assert tracer.flush(1) is False  # pending: neither trace nor backend is there
        m = tracer.metrics()
        assert m["tracer/annotations/pending"] == 1, m
        time.sleep(max(0.0, 3 - (time.monotonic() - down)))
        assert tracer.flush(1) is False
        server.up()
        assert tracer.flush(120), tracer.metrics()
        m = tracer.metrics()
        assert m["tracer/annotations/mlflow/applied"] == 2, m
        assert m["tracer/annotations/pending"] == 0, m
        assert not m.get("tracer/annotations/mlflow/annotation_lost")
        assert not m.get("tracer/annotations/mlflow/skipped")
        [found] = search_traces(server.url, project, "tags.step = '3'")
        trace = MlflowClient(tracking_uri=server.url).get_trace(found.info.trace_id)
        assert trace.info.tags["advantage"] == "0.7"
        assert [s.name for s in trace.data.spans].count("annotation") == 1
    finally:
        tracer.reset()
        server.down()


def test_annotations_reach_the_latest_attempt_or_the_one_named(mlflow_uri: str) -> None:
    """In the process that traced it, and from one that did not (a driver: the store is
    asked for the latest attempt)."""
    pytest.importorskip("mlflow")

    config = {"backend": "mlflow", "tracking_uri": mlflow_uri, "project_name": EXP,
              "experiment_name": "run", "run_salt": SALT, "raise_internal_errors": True}
    tracer.init(config)
    for _ in range(6):  # attempts 0..5: past the 4 a driver looks up at once
        with tracer.trace_attr(step=3, sample_index=7, rollout_n=1):
            pass
    tracer.annotate(step=3, sample_index=7, rollout_n=1, values={"local": 1.0})
    assert tracer.flush(60)
    tracer.init(config)  # a driver: it traced nothing, knows no attempt
    tracer.annotate(step=3, sample_index=7, rollout_n=1, values={"driver": 2.0})
    tracer.annotate(step=3, sample_index=7, rollout_n=1, values={"named": 3.0}, attempt=1)
    assert tracer.flush(60), tracer.metrics()
    tags = {t.info.tags["attempt"]: t.info.tags for t in search_traces(mlflow_uri, EXP)}
    assert sorted(tags) == ["0", "1", "2", "3", "4", "5"]
    assert [a for a, t in tags.items() if "local" in t] == ["5"]
    assert [a for a, t in tags.items() if "driver" in t] == ["5"]
    assert [a for a, t in tags.items() if "named" in t] == ["1"]


def test_skipped_only_when_this_process_left_the_sample_out(mlflow_uri: str) -> None:
    """This process's sampler turned the sample down: skipped at once. A sample it never saw
    may be stored by another process: it waits, then is counted lost, and flush says so."""
    pytest.importorskip("mlflow")
    tracer.init(backend="mlflow", tracking_uri=mlflow_uri, project_name=EXP, run_salt=SALT,
                max_samples_per_step_per_worker=1, annotation_timeout_s=1,
                raise_internal_errors=True)  # fmt: skip
    for i in range(3):
        with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
            pass
    assert tracer.flush(60)
    traced = {int(t.info.tags["sample_index"]) for t in search_traces(mlflow_uri, EXP)}
    [left_out, *_] = sorted({0, 1, 2} - traced)
    tracer.annotate(step=0, sample_index=left_out, rollout_n=0, values={"a": 1.0})
    assert tracer.flush(10)
    m = tracer.metrics()
    assert m["tracer/annotations/mlflow/skipped"] == 1 and m["tracer/annotations/pending"] == 0
    tracer.annotate(step=0, sample_index=50, rollout_n=0, values={"a": 1.0})  # never seen
    assert tracer.flush(10) is False
    m = tracer.metrics()
    assert m["tracer/annotations/mlflow/annotation_lost"] == 1, m
    assert m["tracer/annotations/mlflow/skipped"] == 1
    assert tracer.flush(10)  # the loss was reported once
