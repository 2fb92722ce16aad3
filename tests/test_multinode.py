"""A real two-node Ray cluster (127.0.0.2 and 127.0.0.3, started here) tracing into a real
PostgreSQL-backed ``mlflow server``, read back with MLflow's own client: every trajectory stored
once and tagged with its node; the server killed and restarted mid-run; a shared spool replayed
from both nodes at once; a worker node's raylet killed mid-step (last: the node stays down).

Slow (the cluster's start, ~10 s on 2 quiet cores, overlaps the servers'); skipped, saying
why, without Ray or PostgreSQL.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests._ray_cluster import NODE_IPS, RayCluster
from tests._servers import MlflowServer
from tests.conftest import search_traces

pytestmark = pytest.mark.slow


def _key(t: Any) -> tuple[str, str, str, str]:
    tags = t.info.tags
    return (tags["step"], tags["sample_index"], tags["rollout_n"], tags["validate"])


def _drive(cluster: RayCluster, scenario: str, **args: Any) -> dict[str, Any]:
    """Run a fault scenario in its own driver process (tests/_multinode_driver.py)."""
    return cluster.drive(scenario, **args)


def _reconcile(per_worker: list[dict[str, Any]]) -> dict[str, float]:
    """Each worker's counters reconcile (submitted = exported + pending + dropped); the sums."""
    for m in per_worker:
        assert m["tracer/submitted"] == (m["tracer/mlflow/exported"] + m["tracer/mlflow/pending"]
                                         + m["tracer/mlflow/dropped"]), m  # fmt: skip
    keys = ("tracer/submitted", "tracer/mlflow/exported", "tracer/mlflow/dropped")
    return {k: sum(m[k] for m in per_worker) for k in keys}


# Each of these takes 10-22 s on 2 quiet cores (the first 34-41 s in a full run, 2026-12-04),
# ~10 s of it 2 actors starting (each imports MLflow and loads a tokenizer): real Ray nodes, a
# PostgreSQL-backed server, scripted engines that pace the steps so that the faults land
# mid-step (node loss: 4 s trajectories).
def test_multinode_run_stores_every_trajectory_once_tagged_with_its_node(
    ray_cluster: RayCluster, postgres_mlflow_server: MlflowServer, tmp_path: Path
) -> None:
    project = "multinode-run"
    # `rollout-tracer run` as a user runs it on a cluster node: RAY_ADDRESS and the token
    cmd = [sys.executable, "-m", "rollout.cli", "run", "--no-progress",
           "actor_rollout_ref.rollout.name=scripted", "actor_rollout_ref.rollout.n=2",
           "data.train_batch_size=4", "trainer.total_steps=2", f"trainer.project_name={project}",
           "trainer.val_before_train=false", "trainer.test_freq=2", "data.val_max_samples=2",
           "actor_rollout_ref.rollout.agent.num_workers=2",
           f"actor_rollout_ref.rollout.trace.tracking_uri={postgres_mlflow_server.url}",
           f"+actor_rollout_ref.rollout.trace.spool_dir={tmp_path / 'spool'}"]  # fmt: skip
    proc = subprocess.run(cmd, env=ray_cluster.env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=400)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # 2 steps x 4 prompts x n=2, and the validation pass after step 2 (2 prompts x n=1)
    assert "done: 16 training + 2 validation trajectories" in proc.stdout, proc.stdout
    traces = search_traces(postgres_mlflow_server.url, project)
    keys = Counter(_key(t) for t in traces)
    assert len(traces) == 18 and max(keys.values()) == 1, keys
    assert sum(k[3] == "true" for k in keys) == 2
    nodes = Counter((t.info.tags["ray_node_ip"], t.info.tags["ray_node_id"]) for t in traces)
    assert {ip for ip, _ in nodes} == set(NODE_IPS.values()), nodes  # workers on both nodes
    assert len({node_id for _, node_id in nodes}) == 2
    for t in traces:
        assert t.info.tags["attempt"] == "0" and t.info.tags["worker_id"].startswith("worker-")
    # one worker per node: a worker's traces all carry one node
    per_worker = {(t.info.tags["worker_id"], t.info.tags["ray_node_id"]) for t in traces}
    assert len(per_worker) == 2


def test_server_killed_and_restarted_mid_run_stores_everything_once(
    ray_cluster: RayCluster, postgres_mlflow_server: MlflowServer, postgres_uri: str,
    tmp_path: Path,
) -> None:
    project, steps = "multinode-server-restart", 3
    got = _drive(ray_cluster, "server_restart", tmp=str(tmp_path), project=project,
                 postgres_uri=postgres_uri, steps=steps,
                 url=postgres_mlflow_server.url)  # fmt: skip
    assert got["steps"] == steps and got["trajectories"] == steps * 8 and got["durable"], got
    assert got["restarted"] == 1, got
    # the outage was met: exports failed (and were retried) while the port was dark
    assert sum(m["tracer/mlflow/retries"] for m in got["metrics"]) > 0, got
    print(f"server restart: {got['timings']}")
    assert got["lost"] == [] and got["stored_before_kill"] == [8], got
    # read back through another server on the same database
    traces = search_traces(postgres_mlflow_server.url, project)
    keys = Counter(_key(t) for t in traces)
    assert len(keys) == steps * 8 and max(keys.values()) == 1, keys
    assert _reconcile(got["metrics"]) == {"tracer/submitted": steps * 8,
                                          "tracer/mlflow/exported": steps * 8,
                                          "tracer/mlflow/dropped": 0}  # fmt: skip


def test_shared_spool_replayed_from_both_nodes_exports_each_batch_once(
    ray_cluster: RayCluster, postgres_mlflow_server: MlflowServer, postgres_uri: str,
    tmp_path: Path,
) -> None:
    project, steps = "multinode-shared-spool", 2
    shared = tmp_path / "shared-spool"  # one folder standing in for NFS: every node's spool
    got = _drive(ray_cluster, "shared_spool", tmp=str(tmp_path), project=project, steps=steps,
                 postgres_uri=postgres_uri, shared=str(shared),
                 url=postgres_mlflow_server.url)  # fmt: skip
    assert {p["node_ip"] for p in got["placement"]} == set(NODE_IPS.values())
    assert got["exported_by_workers"] == 0 and got["batches"] >= 2, got
    assert sorted(ip for ip, _, _ in got["replays"]) == sorted(NODE_IPS.values())
    assert all(not failed for _, _, failed in got["replays"]), got
    replayed = sum(n for _, counts, _ in got["replays"] for n in counts.values())
    traces = search_traces(postgres_mlflow_server.url, project)
    keys = Counter(_key(t) for t in traces)
    assert replayed == len(traces) == steps * 8 and max(keys.values()) == 1, (got, keys)
    assert not list(shared.rglob("*.jsonl"))  # every batch exported, and deleted, once


def test_worker_node_lost_mid_step_is_reported_and_rerun_and_the_report_matches_the_store(
    ray_cluster: RayCluster, postgres_mlflow_server: MlflowServer, tmp_path: Path,
) -> None:
    """Last in this file: the worker node stays down for the rest of the session."""
    project = "multinode-node-lost"
    got = _drive(ray_cluster, "node_lost", tmp=str(tmp_path), project=project,
                 url=postgres_mlflow_server.url,
                 raylet_pid=ray_cluster.raylet_pid("worker"))  # fmt: skip
    print(f"node lost: step 2 done, re-run included, {got['noticed_s']} s after the kill; "
          + "; ".join(got["report"]))
    lost_node = next(p for p in got["placement"] if p["node_ip"] == NODE_IPS["worker"])
    assert got["flushed_1"] == [True, True] and got["flushed_3"] == [True], got
    assert got["steps"] == [8, 8, 8]  # every sample of every step came back (re-runs too)

    # the driver's report: step 2's share on the lost node, its samples re-run as attempt 1
    assert len(got["lost"]) == 1, got["report"]
    loss = got["lost"][0]
    assert (loss["step"], loss["node_id"], loss["node_ip"], loss["rerun_attempt"]) == (
        2, lost_node["node_id"], NODE_IPS["worker"], 1)  # fmt: skip
    lost = {tuple(x) for x in loss["samples"]}
    assert len(lost) == 4 and lost < {(i, k) for i in got["batch2"] for k in range(2)}

    # ... and what is in the store says the same
    traces = search_traces(postgres_mlflow_server.url, project)
    tags = [t.info.tags for t in traces]
    assert max(Counter((_key(t), t.info.tags["attempt"]) for t in traces).values()) == 1
    for tag in tags:
        sample = (int(tag["sample_index"]), int(tag["rollout_n"]))
        rerun = tag["step"] == "2" and sample in lost
        if tag["attempt"] == "1":
            assert rerun and tag["ray_node_ip"] == NODE_IPS["head"], tag
        elif rerun:  # a first attempt the lost node exported before it died
            assert tag["ray_node_id"] == loss["node_id"], tag
        else:
            assert tag["attempt"] == "0", tag
    assert len({(t["step"], t["sample_index"], t["rollout_n"]) for t in tags}) == 24
    reruns = sorted((int(t["sample_index"]), int(t["rollout_n"])) for t in tags
                    if t["attempt"] == "1")  # fmt: skip
    assert reruns == sorted(lost)
    assert {t["ray_node_ip"] for t in tags if t["step"] == "3"} == {NODE_IPS["head"]}
    # the survivor's counters plus what the lost worker stored before it died = the store
    sums = _reconcile(got["metrics"])
    from_lost = sum(t["ray_node_id"] == loss["node_id"] for t in tags)
    assert sums["tracer/mlflow/exported"] + from_lost == len(traces)
    assert sums["tracer/mlflow/dropped"] == 0
