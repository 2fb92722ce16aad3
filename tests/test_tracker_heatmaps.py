"""trainer.kl_heatmap_freq: the step's per-token KL heatmap as each tracker's own image type (a
W&B image, an MLflow artifact, a SwanLab image, a Trackio image), each read back from that
tracker's files or store and compared pixel for pixel; masked positions drawn grey."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import Any

import pytest

from rollout.heatmap import (
    CELL_H,
    CELL_W,
    IMAGE_KEY,
    MASKED,
    TITLE_H,
    kl_matrix,
    log_heatmap,
    render,
)
from rollout.trackers import Tracking
from tests.test_trackers import (
    _need,
    _swanlab_series,
    _wandb_history,
    trackers_env,  # noqa: F401  (the fixture)
)

PROJECT = "heatmap-test"
EXPERIMENT = "kl"


def _pixels(image: Any) -> bytes:
    return bytes(image.convert("RGB").tobytes())


def _rows() -> list[list[float | None]]:
    """Two trajectories: a tool response (loss_mask 0) between two turns, one token far off."""
    masks = [[1, 1, 0, 0, 1, 1], [1, 1, 1]]
    rollout = [[-0.1, -0.2, -0.3, -0.4], [-1.0, -1.0, -1.0]]
    train = [[-0.1, -0.25, -0.3, -3.0], [-1.1, -0.9, -1.0]]
    return kl_matrix(masks, rollout, train)


def test_kl_matrix_masks_as_the_report() -> None:
    rows = _rows()
    assert rows[0][2] is None and rows[0][3] is None  # tool tokens: masked, not zero
    assert rows[0][0] == 0.0 and rows[0][5] > 1.0  # k3 of -2.6: e^-2.6 - 1 + 2.6
    image = render(rows, "step 3")
    assert image.size == (240, TITLE_H + 2 * CELL_H)
    grey = image.getpixel((2 * CELL_W + 1, TITLE_H + 1))  # row 0, position 2 (tool token)
    past_end = image.getpixel((4 * CELL_W + 1, TITLE_H + CELL_H + 1))  # row 1 is 3 long
    assert grey == MASKED and past_end == MASKED
    dark = image.getpixel((5 * CELL_W + 1, TITLE_H + 1))
    assert dark[1] < 50 and dark[0] > 100  # the far-off token: dark red


@pytest.mark.slow(seconds=7)
def test_heatmap_in_every_tracker(trackers_env: Path) -> None:  # noqa: F811
    for name, extra in (("mlflow", "rollout-tracer[mlflow]"), ("wandb", "rollout-tracer[wandb]"),
                        ("swanlab", "swanlab[dashboard]"), ("swanboard", "swanlab[dashboard]"),
                        ("trackio", "rollout-tracer[trackio]")):  # fmt: skip
        _need(name, extra)
    from mlflow.tracking import MlflowClient
    from PIL import Image

    uri = f"sqlite:///{trackers_env / 'mlflow.db'}"
    tracking = Tracking(["console", "mlflow", "wandb", "swanlab", "trackio"], project=PROJECT,
                        experiment=EXPERIMENT, tracking_uri=uri)  # fmt: skip
    image = render(_rows(), "step 3: mismatch KL")
    run_id = tracking.mlflow_run_id
    assert log_heatmap(tracking, 3, image, "step 3") == ["mlflow", "wandb", "swanlab", "trackio"]
    tracking.finish()
    want = _pixels(image)

    client = MlflowClient(tracking_uri=uri)
    local = client.download_artifacts(run_id, "kl_heatmap/step_000003.png", str(trackers_env))
    with Image.open(local) as got:
        assert _pixels(got) == want

    (run_dir,) = glob.glob(str(trackers_env / "wandb" / "wandb" / "offline-run-*"))
    row = _wandb_history(Path(run_dir))[3]
    assert row[f"{IMAGE_KEY}/_type"] == "image-file"
    with Image.open(Path(run_dir) / "files" / row[f"{IMAGE_KEY}/path"]) as got:
        assert _pixels(got) == want

    series, _ = _swanlab_series(trackers_env / "swanlog")
    [entry] = series[IMAGE_KEY][3]  # the file name under the run's media/image/
    [path] = (trackers_env / "swanlog").rglob(f"media/image/{entry}")
    with Image.open(path) as got:
        assert _pixels(got) == want

    import trackio.utils
    from trackio.sqlite_storage import SQLiteStorage

    logs = {r["step"]: r for r in SQLiteStorage.get_logs(PROJECT, EXPERIMENT)}
    value = logs[3][IMAGE_KEY]
    assert value["_type"] == "trackio.image"
    with Image.open(trackio.utils.MEDIA_DIR / value["file_path"]) as got:
        assert _pixels(got) == want
