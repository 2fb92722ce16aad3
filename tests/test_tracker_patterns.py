"""The top behaviour pattern of a step as text in every tracker that takes text (an MLflow
artifact, a W&B HTML panel, a SwanLab text, a Trackio Markdown panel), each read back from
that tracker's own files or store (rollout/step_patterns.py)."""

from __future__ import annotations

import glob
from html import escape
from pathlib import Path

from rollout.step_patterns import TEXT_KEY, log_top_pattern
from rollout.trackers import Tracking
from tests.test_trackers import (
    _need,
    _swanlab_series,
    _wandb_history,
    trackers_env,  # noqa: F401  (the fixture)
)

PROJECT = "patterns-test"
EXPERIMENT = "habits"
TEXT = '36.5% of step 3: tools: calculator! | finish: stop | answer: "<q>" is #### <n> & more'


def test_top_pattern_text_in_every_tracker(trackers_env: Path) -> None:  # noqa: F811
    for name, extra in (("mlflow", "rollout-tracer[mlflow]"), ("wandb", "rollout-tracer[wandb]"),
                        ("swanlab", "swanlab[dashboard]"), ("swanboard", "swanlab[dashboard]"),
                        ("trackio", "rollout-tracer[trackio]")):  # fmt: skip
        _need(name, extra)
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{trackers_env / 'mlflow.db'}"
    tracking = Tracking(["console", "mlflow", "wandb", "swanlab", "trackio"], project=PROJECT,
                        experiment=EXPERIMENT, tracking_uri=uri)  # fmt: skip
    run_id = tracking.mlflow_run_id
    assert log_top_pattern(tracking, 3, TEXT) == ["mlflow", "wandb", "swanlab", "trackio"]
    tracking.finish()

    client = MlflowClient(tracking_uri=uri)
    local = client.download_artifacts(run_id, "patterns/step_000003.txt", str(trackers_env))
    assert Path(local).read_text("utf-8") == TEXT

    (run_dir,) = glob.glob(str(trackers_env / "wandb" / "wandb" / "offline-run-*"))
    row = _wandb_history(Path(run_dir))[3]
    assert row[f"{TEXT_KEY}/_type"] == "html-file"
    html = (Path(run_dir) / "files" / row[f"{TEXT_KEY}/path"]).read_text("utf-8")
    assert html == f"<pre>{escape(TEXT)}</pre>"

    series, _ = _swanlab_series(trackers_env / "swanlog")
    assert series[TEXT_KEY][3] == [TEXT]

    from trackio.sqlite_storage import SQLiteStorage

    logs = {r["step"]: r for r in SQLiteStorage.get_logs(PROJECT, EXPERIMENT)}
    assert logs[3][TEXT_KEY] == {"_type": "trackio.markdown", "_value": TEXT}
