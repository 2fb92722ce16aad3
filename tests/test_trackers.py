"""trainer.logger: step metrics and sample tables in console, MLflow, W&B (offline), SwanLab
(local), Trackio (local), each read back from the tracker's own files or API; the MLflow run's
traces found by ``mlflow.search_traces(run_id=...)``; clear errors for missing extras and keys;
robust value conversion; aggregation of several workers' raw numbers."""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import sqlite3
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from rollout.metrics import (
    SAMPLE_COLUMNS,
    StepInputs,
    aggregate,
    collect,
    compute_metrics,
    to_float,
)
from rollout.trackers import TrackerError, Tracking

CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
PROJECT = "trackers-test"
EXPERIMENT = "scripted-grpo"


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _need(name: str, extra: str) -> None:
    if not _installed(name):
        pytest.skip(f"{name} is not installed here (pip install '{extra}')")


@pytest.fixture
def trackers_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every tracker writes under tmp_path: W&B offline, SwanLab local, Trackio local."""
    for var in ("WANDB_API_KEY", "SWANLAB_API_KEY", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "wandb").mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("SWANLAB_MODE", "local")
    monkeypatch.setenv("SWANLAB_LOG_DIR", str(tmp_path / "swanlog"))
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "swanlab-root"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    trackio_dir = tmp_path / "trackio"
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    if _installed("trackio"):  # TRACKIO_DIR is read once, at trackio's import
        from tests.conftest import patch_trackio_dirs

        patch_trackio_dirs(monkeypatch, trackio_dir)
    if "wandb" in sys.modules:  # an earlier test's wandb settings (WANDB_DIR) are cached
        sys.modules["wandb"].teardown()
    return tmp_path


def _script(prompt: str, index: int) -> str:
    """Turn 1: a calculator call (every third one malformed); after the tool: an answer."""
    if "<tool_response>" in prompt or prompt.count("<|im_start|>assistant") > 1:
        return "The result is 4.\n#### 4"
    return f"Let me compute.\n{CALL.format('2+' if index % 3 == 0 else '2+2')}"


# ---------------------------------------------------------------- wandb's own record format
def _wandb_history(run_dir: Path) -> dict[int, dict[str, Any]]:
    """History rows of an offline run's ``.wandb`` file, parsed with wandb's own protobuf
    ``Record`` (the file is a LevelDB-style log of 32 KiB blocks after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
    rows: dict[int, dict[str, Any]] = {}
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        row = {
            (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
            for item in record.history.item
        }
        rows.setdefault(int(row["_step"]), {}).update(row)
    return rows


def _swanlab_series(log_dir: Path) -> tuple[dict[str, dict[int, Any]], Path]:
    """Every key's ``{step: value}`` from SwanLab's local store (runs.swanlab + run folder)."""
    db = sqlite3.connect(log_dir / "runs.swanlab")
    ((run_name,),) = db.execute("SELECT run_id FROM experiment").fetchall()
    run_dir = log_dir / run_name
    series: dict[str, dict[int, Any]] = {}
    for name, folder in db.execute("SELECT name, folder FROM tag"):
        points: dict[int, Any] = {}
        for log_file in (run_dir / "logs" / folder).glob("*.log"):
            for line in log_file.read_text("utf-8").splitlines():
                point = json.loads(line)
                points[int(point["index"])] = point["data"]
        series[name] = points
    db.close()
    return series, run_dir


@pytest.mark.slow(seconds=9)
def test_rollout_logs_to_every_tracker(
    trackers_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, extra in (("mlflow", "rollout-tracer[mlflow]"), ("wandb", "rollout-tracer[wandb]"),
                        ("swanlab", "swanlab[dashboard]"), ("swanboard", "swanlab[dashboard]"),
                        ("trackio", "rollout-tracer[trackio]")):  # fmt: skip
        _need(name, extra)
    import mlflow
    from mlflow.tracking import MlflowClient

    import rollout.engines
    from rollout.cli import main

    real_make_engine = rollout.engines.make_engine
    monkeypatch.setattr(
        rollout.engines, "make_engine", lambda config: real_make_engine(config, script=_script)
    )
    logged: dict[int, dict[str, float]] = {}
    samples: dict[int, list[dict[str, Any]]] = {}
    val_samples: dict[int, list[dict[str, Any]]] = {}
    real_log, real_samples = Tracking.log, Tracking.log_samples

    def spy_log(self: Tracking, metrics: Any, step: int) -> dict[str, float]:
        clean = real_log(self, metrics, step)
        if not any(k.startswith("val/") for k in clean):  # validation passes: below
            logged[step] = clean
        return clean

    def spy_samples(self: Tracking, rows: Any, step: int, key: str = "rollout/samples") -> None:
        (samples if key == "rollout/samples" else val_samples)[step] = [dict(r) for r in rows]
        real_samples(self, rows, step, key)

    monkeypatch.setattr(Tracking, "log", spy_log)
    monkeypatch.setattr(Tracking, "log_samples", spy_samples)
    uri = f"sqlite:///{trackers_env / 'mlflow.db'}"
    code = main([
        "run", "--no-progress", "actor_rollout_ref.rollout.name=scripted",
        "trainer.total_steps=2", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "trainer.logger=[console,mlflow,wandb,swanlab,trackio]",
        "trainer.log_rollout_generations=3", f"trainer.project_name={PROJECT}",
        "trainer.val_before_train=false", "trainer.test_freq=2", "trainer.log_val_generations=2",
        f"trainer.experiment_name={EXPERIMENT}",
        "actor_rollout_ref.rollout.trace.backend=mlflow",
        f"actor_rollout_ref.rollout.trace.tracking_uri={uri}",
    ])  # fmt: skip
    assert code == 0
    assert sorted(logged) == [1, 2] and sorted(samples) == [1, 2]
    assert sorted(val_samples) == [2] and len(val_samples[2]) == 2  # log_val_generations
    keys = set(logged[1])
    for key in ("rollout/reward/mean", "rollout/reward/std", "rollout/reward/min",
                "rollout/reward/max", "rollout/accuracy", "rollout/response_length/mean",
                "rollout/turns/mean", "rollout/tool_calls/mean", "rollout/tool_error_rate",
                "rollout/finish_reason/stop", "rollout/grpo/zero_std_group_frac",
                "perf/trajectories_per_s", "perf/tokens_per_s", "tracer/submitted",
                "tracer/mlflow/exported", "patterns/top_share", "patterns/rising"):  # fmt: skip
        assert key in keys, key
    assert logged[1]["rollout/num_trajectories"] == 4.0
    assert logged[1]["rollout/tool_calls/mean"] > 0
    assert all(len(rows) == 3 for rows in samples.values())
    assert all(set(r) == set(SAMPLE_COLUMNS) and r["prompt"] for r in samples[1])

    # console: one readable line per step
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 1", "step 2"]
    assert "reward" in lines[0] and "traj/s" in lines[0] and "tracer exported" in lines[0]

    # MLflow: the run, its params, every step's metrics, the samples tables, its traces
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(PROJECT)
    assert exp is not None
    (run,) = client.search_runs([exp.experiment_id])
    run_id = run.info.run_id
    assert run.info.run_name == EXPERIMENT and run.info.status == "FINISHED"
    assert run.data.params["actor_rollout_ref.rollout.n"] == "2"
    assert run.data.params["trainer.logger"] == str(
        ["console", "mlflow", "wandb", "swanlab", "trackio"]
    )
    for key in keys:
        history = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert history == {s: pytest.approx(logged[s][key]) for s in (1, 2)}, key
    for step in (1, 2):
        path = client.download_artifacts(run_id, f"samples/step_{step:06d}.json")
        table = json.loads(Path(path).read_text("utf-8"))
        assert table["columns"] == list(SAMPLE_COLUMNS)
        got = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
        assert [(r["prompt"], r["response"], r["reward"]) for r in got] == [
            (r["prompt"], r["response"], r["reward"]) for r in samples[step]
        ]
    mlflow.set_tracking_uri(uri)
    traces = mlflow.search_traces(run_id=run_id, locations=[exp.experiment_id],
                                  return_type="list")  # fmt: skip
    assert len(traces) == 8 + 2  # and the validation pass at step 2
    assert {t.info.tags["step"] for t in traces} == {"1", "2"}
    mlflow.set_experiment(PROJECT)
    assert len(mlflow.search_traces(run_id=run_id, return_type="list")) == 10
    path = client.download_artifacts(run_id, "val_generations/step_000002.json")
    table = json.loads(Path(path).read_text("utf-8"))
    assert [r[3] for r in table["data"]] == [r["prompt"] for r in val_samples[2]]
    assert client.get_metric_history(run_id, "val/reward/mean")[0].step == 2

    # W&B offline run: the .wandb records (wandb's protobuf) and the table files
    (run_dir,) = glob.glob(str(trackers_env / "wandb" / "wandb" / "offline-run-*"))
    history = _wandb_history(Path(run_dir))
    for step in (1, 2):
        row = history[step]
        for key in keys:
            assert row[key] == pytest.approx(logged[step][key]), key
        assert row["rollout/samples/_type"] == "table-file"
        table = json.loads((Path(run_dir) / "files" / row["rollout/samples/path"]).read_text())
        assert table["columns"] == list(SAMPLE_COLUMNS)
        assert [r[3] for r in table["data"]] == [r["prompt"] for r in samples[step]]
        assert [r[5] for r in table["data"]] == [r["reward"] for r in samples[step]]
    val_table = history[2]["val/generations/path"]
    table = json.loads((Path(run_dir) / "files" / val_table).read_text())
    assert [r[3] for r in table["data"]] == [r["prompt"] for r in val_samples[2]]

    # SwanLab local: the run's database and folder
    series, swan_run = _swanlab_series(trackers_env / "swanlog")
    for key in keys:
        assert series[key] == {s: pytest.approx(logged[s][key]) for s in (1, 2)}, key
    for step in (1, 2):
        texts = series["rollout/samples"][step]
        assert len(texts) == 3
        assert all(r["prompt"] in t and r["response"] in t
                   for r, t in zip(samples[step], texts, strict=True))  # fmt: skip
    assert len(series["val/generations"][2]) == 2
    assert (swan_run / "files" / "config.yaml").is_file()

    # Trackio local: its SQLite database, read with trackio's own storage class
    from trackio.sqlite_storage import SQLiteStorage

    assert (trackers_env / "trackio" / f"{PROJECT}.db").is_file()
    logs: dict[int, dict[str, Any]] = {}
    for row in SQLiteStorage.get_logs(PROJECT, EXPERIMENT):  # metrics and table: 2 rows a step
        logs.setdefault(row["step"], {}).update(row)
    for step in (1, 2):
        for key in keys:
            assert logs[step][key] == pytest.approx(logged[step][key]), key
        table = logs[step]["rollout/samples"]
        assert table["_type"] == "trackio.table"
        assert [r["prompt"] for r in table["_value"]] == [r["prompt"] for r in samples[step]]
        assert [r["reward"] for r in table["_value"]] == [r["reward"] for r in samples[step]]
    table = logs[2]["val/generations"]
    assert [r["prompt"] for r in table["_value"]] == [r["prompt"] for r in val_samples[2]]


@pytest.mark.parametrize("name", ["mlflow", "wandb", "swanlab", "trackio"])
def test_missing_package_names_the_extra(
    name: str, trackers_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    with pytest.raises(TrackerError, match=rf"pip install 'rollout-tracer\[{name}\]'"):
        Tracking(["console", name], project=PROJECT, experiment=EXPERIMENT)


def test_missing_package_is_a_clean_cli_error(
    trackers_env: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rollout.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)
    code = main(["run", "actor_rollout_ref.rollout.name=scripted", "trainer.logger=[wandb]",
                 "actor_rollout_ref.rollout.trace.backend=null"])  # fmt: skip
    assert code == 2
    assert "rollout-tracer[wandb]" in capsys.readouterr().err


def test_unknown_tracker_lists_valid_names() -> None:
    with pytest.raises(TrackerError, match="valid: console, mlflow, wandb, swanlab, trackio"):
        Tracking(["console", "tensorbord"])


def test_wandb_online_without_key(trackers_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _need("wandb", "rollout-tracer[wandb]")
    monkeypatch.delenv("WANDB_MODE")
    with pytest.raises(TrackerError, match=r"WANDB_API_KEY.*WANDB_MODE=offline"):
        Tracking(["wandb"], project=PROJECT, experiment=EXPERIMENT)
    assert not glob.glob(str(trackers_env / "wandb" / "wandb" / "*run-*"))


def test_swanlab_online_without_key(trackers_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _need("swanlab", "rollout-tracer[swanlab]")
    monkeypatch.setenv("SWANLAB_MODE", "cloud")  # verl's name for online
    with pytest.raises(TrackerError, match=r"SWANLAB_API_KEY.*SWANLAB_MODE=local"):
        Tracking(["swanlab"], project=PROJECT, experiment=EXPERIMENT)


def test_not_driver_logs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    lines: list[str] = []
    tracking = Tracking(["console", "wandb"], is_driver=False, write=lines.append)
    assert tracking.trackers == [] and tracking.mlflow_run_id is None
    tracking.log({"a": 1.0}, 1)
    tracking.finish()
    assert lines == []


def test_values_converted_or_skipped_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    assert to_float(np.float32(1.5)) == 1.5
    assert to_float(np.int64(3)) == 3.0
    assert to_float(np.array(2.5)) == 2.5
    assert to_float(torch.tensor(0.25)) == 0.25
    assert to_float(torch.tensor([7])) == 7.0
    assert to_float(True) == 1.0
    for bad in ("x", [1, 2], None, {"a": 1}, torch.ones(3), np.ones(2), object()):
        assert to_float(bad) is None
    lines: list[str] = []
    tracking = Tracking(["console"], write=lines.append)
    metrics = {"rollout/reward/mean": np.float64(0.5), "perf/step_time_s": torch.tensor(2.0),
               "odd/text": "x", "odd/list": [1, 2]}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="rollout.metrics"):
        assert tracking.log(metrics, 1) == {"rollout/reward/mean": 0.5, "perf/step_time_s": 2.0}
        tracking.log(metrics, 2)
    warnings = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 2 and any("odd/text" in w for w in warnings)
    assert len(lines) == 2 and lines[0].startswith("step 1 | reward 0.50")


def test_failing_tracker_warns_once_and_rollout_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    def broken(line: str) -> None:
        raise OSError("disk full")

    tracking = Tracking(["console"], write=broken)
    with caplog.at_level(logging.WARNING, logger="rollout.trackers"):
        for step in (1, 2, 3):
            tracking.log({"rollout/reward/mean": 1.0}, step)
    assert len([r for r in caplog.records if "disk full" in r.getMessage()]) == 1


def _inputs(step: int, rewards: list[float], groups: list[str], elapsed: float) -> StepInputs:
    n = len(rewards)
    return StepInputs(
        step=step, rewards=rewards, accuracies=[float(r > 0.5) for r in rewards],
        response_tokens=[10] * n, generated_tokens=[6] * n, turns=[2] * n, user_turns=[0] * n,
        tool_calls=[1] * n, tool_errors=[1] + [0] * (n - 1), finish_reasons=["stop"] * n,
        groups=groups, elapsed_s=elapsed,
        samples=[{"sample_index": i, "rollout_n": 0, "prompt": f"p{i}"} for i in range(n)],
    )  # fmt: skip


def test_aggregate_combines_workers() -> None:
    a = _inputs(3, [1.0, 1.0, 0.0, 1.0], ["3:0", "3:0", "3:1", "3:1"], elapsed=2.0)
    b = _inputs(3, [0.0, 0.0], ["3:2", "3:2"], elapsed=4.0)
    merged = aggregate([a, b.to_dict()], num_samples=3)
    m = compute_metrics(merged, {"tracer/submitted": 6, "tracer/note": "text"})
    assert m["rollout/num_trajectories"] == 6.0
    assert m["rollout/reward/mean"] == pytest.approx(0.5)
    assert m["rollout/reward/std"] == pytest.approx(0.5)
    assert m["rollout/grpo/zero_std_group_frac"] == pytest.approx(2 / 3)  # groups 0 and 2
    assert m["rollout/grpo/num_groups"] == 3.0
    assert m["rollout/tool_error_rate"] == pytest.approx(2 / 6)
    assert m["perf/step_time_s"] == 4.0  # workers run concurrently: the slowest one
    assert m["perf/trajectories_per_s"] == pytest.approx(6 / 4)
    assert m["perf/tokens_per_s"] == pytest.approx(36 / 4)
    assert m["tracer/submitted"] == 6.0 and "tracer/note" not in m
    assert m["rollout/finish_reason/stop"] == 1.0 and m["rollout/finish_reason/length"] == 0.0
    assert [s["sample_index"] for s in merged.samples] == [0, 0, 1]
    with pytest.raises(ValueError, match="different steps"):
        aggregate([a, _inputs(4, [1.0], ["4:0"], 1.0)])


def test_collect_from_a_step_result(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import asyncio

    from rollout.config import load_config
    from rollout.engines import make_engine
    from rollout.worker import RolloutWorker

    config = load_config(["actor_rollout_ref.rollout.name=scripted", "data.train_batch_size=2",
                          "actor_rollout_ref.rollout.n=3",
                          "actor_rollout_ref.rollout.trace.backend=null"])  # fmt: skip
    worker = RolloutWorker(config, make_engine(config, script=_script))
    (result,) = asyncio.run(worker.run(1))
    assert result.elapsed_s > 0
    inputs = collect(result, num_samples=2)
    assert len(inputs.rewards) == 6 and len(set(inputs.groups)) == 2
    assert [(s["sample_index"], s["rollout_n"]) for s in inputs.samples] == sorted(
        (s["sample_index"], s["rollout_n"]) for s in inputs.samples
    )
    assert inputs.samples[0]["rollout_n"] == 0 and inputs.samples[1]["rollout_n"] == 1
    # the same trajectories split over two workers give the same metrics
    data = inputs.to_dict()
    halves = [
        StepInputs.from_dict({k: v[part] if isinstance(v, list) else v for k, v in data.items()})
        for part in (slice(0, 3), slice(3, None))
    ]
    assert compute_metrics(aggregate(halves)) == compute_metrics(inputs)
