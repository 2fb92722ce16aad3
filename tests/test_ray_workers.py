"""Rollout workers as Ray actors tracing into one real MLflow tracking server, read back with
MLflow's own client: per-worker sampling limits, whole GRPO groups, no duplicates, worker tags."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rollout.config import load_config
from rollout.ray_workers import (
    combine_tracer_metrics,
    num_workers,
    ray_init_kwargs,
    split_by_prompt,
)
from rollout.worker import iterate_batches, load_dataset
from tests._ray_cluster import RayCluster
from tests._servers import MlflowServer
from tests.conftest import search_traces
from tracer.sampling import sample_hash

EXP = "ray-workers"
# the session's Ray cluster (conftest.py): with the other Ray tests, one at a time; the
# workers run tests/_multinode_driver.py's scripted engine (one calculator call, then 42)
pytestmark = pytest.mark.xdist_group("servers")


def test_split_by_prompt_keeps_order_and_balances() -> None:
    assert split_by_prompt([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert split_by_prompt([1, 2, 3, 4, 5, 6], 3) == [[1, 2], [3, 4], [5, 6]]
    assert split_by_prompt([1], 3) == [[1], [], []]


def test_config_keys_default_to_in_process() -> None:
    config = load_config()
    assert num_workers(config) == 0  # default: the in-process worker, no Ray
    assert ray_init_kwargs(config) == {}  # address null: RAY_ADDRESS, else a local cluster
    config = load_config(["actor_rollout_ref.rollout.agent.num_workers=2",
                          "ray_kwargs.ray_init.address=auto"])  # fmt: skip
    assert num_workers(config) == 2
    assert ray_init_kwargs(config) == {"address": "auto"}
    with pytest.raises(ValueError, match="num_workers"):
        num_workers(load_config(["actor_rollout_ref.rollout.agent.num_workers=-1"]))


def test_tracer_metrics_of_all_workers_add_up() -> None:
    rate = "tracer/hot_path_us_per_trajectory"
    per_worker = [
        {"worker_id": "worker-0@h:1", "tracer/mlflow/exported": 4, rate: 10.0},
        {"worker_id": "worker-1@h:2", "tracer/mlflow/exported": 6, rate: 30.0},
    ]
    assert combine_tracer_metrics(per_worker) == {"tracer/mlflow/exported": 10.0, rate: 20.0}


# ~15 s on 2 quiet cores, most of it 2 actors starting (each imports MLflow and loads a
# tokenizer): one run on the session's Ray cluster checks the sampling of training steps and
# the validation passes (val_before_train, test_freq), so that start is paid once
@pytest.mark.slow
def test_two_ray_workers_trace_sampled_groups_into_one_server(
    ray_cluster: RayCluster, mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("transformers")
    limit, n, batch_size, steps = 2, 2, 6, 3
    server, exp = mlflow_server, f"{EXP}-{tmp_path.name}"  # the session's server, our experiment
    overrides = [
        "actor_rollout_ref.rollout.name=scripted",
        f"actor_rollout_ref.rollout.n={n}",
        f"data.train_batch_size={batch_size}",
        f"trainer.total_steps={steps}",
        f"trainer.project_name={exp}",
        # validation before step 1, after step 2 (test_freq) and after the last step
        "trainer.val_before_train=true", "trainer.test_freq=2", "data.val_max_samples=2",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        # half a CPU each: both fit on the head node alone (test_multinode takes the other down)
        "actor_rollout_ref.rollout.agent.num_cpus_per_worker=0.5",
        f"actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker={limit}",
        f"actor_rollout_ref.rollout.trace.tracking_uri={server.url}",
    ]  # fmt: skip
    config = load_config(overrides)
    t0 = time.perf_counter()
    # the scripted engine waits a little per call, so every trajectory of a step starts before
    # the first one ends and sampling keeps exactly the lowest hashes
    got_run = ray_cluster.drive("pool_run", overrides=overrides, delay_s=0.02, trace={
        "spool_dir": str(tmp_path / "spool"), "flush_interval_s": 0.2,
        "raise_internal_errors": True})  # fmt: skip
    elapsed = time.perf_counter() - t0
    worker_ids = got_run["worker_ids"]
    assert len(worker_ids) == 2 and len(set(worker_ids)) == 2, got_run
    assert got_run["steps"] == [batch_size * n] * steps and got_run["tool_once_and_rewarded"]
    # the driver waited for every worker's traces of every step (and validation) to be durable
    assert got_run["flushed"] == {str(s): [True, True] for s in range(0, steps + 1)}, got_run
    for m in got_run["metrics"]:
        # per worker: its `limit` GRPO groups of each step, and 1 of the 2 validation prompts
        # per pass (validation is sampled on its own, per (step, validate))
        assert m["tracer/mlflow/exported"] == limit * n * steps + 3, m
        assert m["tracer/mlflow/failed"] == 0 and m["tracer/dropped_buffer_full"] == 0

    # the fixed validation set, split by prompt over both workers, at steps 0, 2 and 3
    assert got_run["vals"] == [[0, True, 2], [2, True, 2], [3, True, 2]], got_run
    val = search_traces(server.url, exp, "tags.validate = 'true'")
    got_val = sorted((t.info.tags["step"], t.info.tags["sample_index"]) for t in val)
    assert got_val == [(s, i) for s in ("0", "2", "3") for i in ("0", "1")]
    for s in ("0", "2", "3"):  # each pass: one prompt on each worker
        assert {t.info.tags["worker_id"] for t in val if t.info.tags["step"] == s} == set(
            worker_ids)  # fmt: skip

    # expected: per step, worker i ran half of the batch (whole prompts) and kept the
    # `limit` prompts with the lowest sampling hash, each with all its n samples
    data = config["data"]
    batches = iterate_batches(load_dataset(data["train_files"]), batch_size,
                              int(data["seed"]), bool(data["shuffle"]))  # fmt: skip
    expected: dict[tuple[str, str, str], str] = {}
    for step in range(1, steps + 1):
        batch = next(batches)
        half = batch_size // 2
        for w, chunk in enumerate((batch[:half], batch[half:])):
            idx = sorted((r["index"] for r in chunk),
                         key=lambda i, s=step: sample_hash(0, s, False, i))  # fmt: skip
            for i in idx[:limit]:
                for k in range(n):
                    expected[(str(step), str(i), str(k))] = worker_ids[w]
    traces = search_traces(server.url, exp, "tags.validate = 'false'")
    got = [(t.info.tags["step"], t.info.tags["sample_index"], t.info.tags["rollout_n"])
           for t in traces]  # fmt: skip
    assert len(got) == len(set(got)), "a trajectory was stored twice"
    assert len(got) == len(expected) == 2 * limit * n * steps
    assert set(got) == set(expected)
    for t, key in zip(traces, got, strict=True):
        assert t.info.tags["worker_id"] == expected[key]
    assert all(w.startswith(f"worker-{i}@") and ":" in w for i, w in enumerate(worker_ids))
    print(f"ray workers: {len(got)} + {len(val)} traces in {elapsed:.1f} s (driver start to "
          "shutdown)")


# ~25 s on 2 quiet cores (32-50 s in a full run, 2026-12-04): the driver loads its trainer and
# reference models, the actor its engine, then real generation and the trainer pass. The model
# is tiny-qwen3 (2 random layers, a real tokenizer): what this checks is the Ray path, the
# driver annotating the traces that a worker stored; SmolLM2's own trainer pass is
# test_main_job's, and its bfloat16 forward passes cost ~25 s more here on a CPU without
# bfloat16. The run joins the session's Ray cluster (as `rollout-tracer run` does on a cluster
# node) rather than paying for a local cluster of its own; its one worker fits on the head
# node, which no test takes down.
@pytest.mark.slow
def test_ray_run_driver_does_the_trainer_pass(
    tmp_path: Path, mlflow_uri: str, ray_cluster: RayCluster
) -> None:
    """With Ray workers the driver plays verl's trainer: its own models recompute every
    trajectory's log-probs, attach them to the traces the worker stored, and log
    rollout_corr/* and the health counts of each step."""
    pytest.importorskip("mlflow")
    pytest.importorskip("xgrammar")
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    project = "ray-trainer-pass"
    cmd = [sys.executable, "-m", "rollout.cli", "run", "--no-progress",
           "actor_rollout_ref.rollout.agent.num_workers=1", "actor_rollout_ref.rollout.n=2",
           "trainer.total_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0",
           "trainer.logger=[console,mlflow]", "trainer.kl_heatmap_freq=0",
           "actor_rollout_ref.model.path=tiny-qwen3",
           "actor_rollout_ref.rollout.response_length=48",
           f"trainer.project_name={project}",
           f"actor_rollout_ref.rollout.trace.tracking_uri={mlflow_uri}",
           f"+actor_rollout_ref.rollout.trace.spool_dir={tmp_path / 'spool'}"]  # fmt: skip
    # RAY_ADDRESS and the cluster's token; PYTHONPATH: this checkout, installed or not
    proc = subprocess.run(cmd, env=ray_cluster.env(), cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "done: 2 training" in proc.stdout, proc.stdout
    assert "driver (trainer pass)" in proc.stdout, proc.stdout
    traces = search_traces(mlflow_uri, project)
    assert len(traces) == 2
    out = tmp_path / "export"
    from rollout.cli import main

    assert main(["export", "--from", "mlflow", "--tracking-uri", mlflow_uri, "--experiment",
                 project, "--out", str(out), "--format", "parquet", "--no-progress"]) == 0
    duckdb = pytest.importorskip("duckdb")
    [(model, missing, traced)] = duckdb.sql(f"""
        SELECT count(*), count(*) FILTER (WHERE train_logprob IS NULL OR ref_logprob IS NULL
            OR entropy IS NULL OR rollout_logprob IS NULL), count(DISTINCT trace_id)
        FROM read_parquet('{out / "tokens.parquet"}') WHERE loss_mask = 1""").fetchall()
    assert model > 10 and missing == 0 and traced == 2, (model, missing, traced)
    client = MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name(project)
    [run] = client.search_runs([exp.experiment_id])
    for name in ("rollout_corr/kl", "rollout_corr/k3_kl", "perf/trainer_pass_s"):
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == [1], name
    # the tracer's live analysis, the worker's partial merged in the driver: in MLflow at step 1
    for name in ("patterns/top_share", "timing/generate_share", "timing/wall_p50_s"):
        [m] = client.get_metric_history(run.info.run_id, name)
        assert m.step == 1 and 0 < m.value <= (1 if "share" in name else 600), (name, m)
