"""The sqlite reader (tracer/readers/mlflow_sqlite.py) gives exactly the records MLflow's own
client gives, for a store written by the bulk writer and one written by MLflow's own path; it
falls back to the client on a schema it does not know."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tracer
from tests import export_agent

pytest.importorskip("mlflow")

from tracer.backends import mlflow_bulk
from tracer.readers import mlflow_sqlite
from tracer.readers.mlflow_source import iter_mlflow
from tracer.readers.selection import NoTrajectories, Selection

PROJECT = "sqlite-reader"


def _records(uri: str, selection: Selection | None = None) -> list[dict[str, Any]]:
    out = [r.to_dict() for page in iter_mlflow(uri, PROJECT, selection, 5) for r in page]
    for record in out:  # span order within a trace is not part of the contract
        first, *rest = record["spans"]
        record["spans"] = [first, *sorted(rest, key=lambda s: (s["start_ns"], s["span_id"]))]
    return sorted(out, key=lambda r: r["trace_id"])


@pytest.mark.parametrize("writer", ["bulk", "mlflow"])
def test_the_sqlite_reader_reads_what_mlflows_client_reads(
    writer: str, tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    options = {}
    if writer == "mlflow":  # the writer falls back to MLflow's log_spans
        monkeypatch.setattr(mlflow_bulk, "mlflow_version", lambda: "3.17.99")  # untested
        options["export_in_subprocess"] = False  # where the patch is seen
    export_agent.init(str(tmp_path), mlflow_uri, PROJECT, **options)
    export_agent.run([1, 2])
    export_agent.run([2], validate=True)
    assert tracer.flush(timeout_s=60)
    tracer.reset()
    monkeypatch.undo()

    def no_client(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the sqlite reader used MLflow's client")

    monkeypatch.setattr("mlflow.tracking.MlflowClient", no_client)
    fast = {name: _records(mlflow_uri, sel) for name, sel in
            [("all", None), ("step 2 training", Selection([2], False))]}  # fmt: skip
    with pytest.raises(NoTrajectories, match="steps there: 1,2"):
        _records(mlflow_uri, Selection([9]))
    monkeypatch.undo()
    monkeypatch.setattr(mlflow_sqlite, "TESTED_SCHEMA_REVISIONS", frozenset())  # the client
    slow = {name: _records(mlflow_uri, sel) for name, sel in
            [("all", None), ("step 2 training", Selection([2], False))]}  # fmt: skip
    assert len(fast["all"]) == 18 and len(fast["step 2 training"]) == 6
    assert fast == slow
    errors = [s for r in fast["all"] for s in r["spans"] if s["error"]]
    assert errors and all(r["reward"] is not None for r in fast["all"])
