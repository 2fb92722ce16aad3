"""A real two-node Ray cluster (127.0.0.2 and 127.0.0.3, started here) tracing into a real
PostgreSQL-backed ``mlflow server``, read back with MLflow's own client: every trajectory stored
once and tagged with its node; the server killed and restarted mid-run; a shared spool replayed
from both nodes at once; a worker node's raylet killed mid-step (last: the node stays down).

Slow (a cluster start is ~30 s on 2 shared cores); skipped, saying why, without Ray or
PostgreSQL.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from rollout.config import load_config, trace_config
from tests._ray_cluster import NODE_IPS, RayCluster, ray_cluster  # noqa: F401  (fixture)
from tests._servers import (  # noqa: F401  (fixtures)
    MlflowServer,
    postgres_mlflow_server,
    postgres_uri,
    start_mlflow_server,
)
from tests.conftest import search_traces

pytestmark = pytest.mark.slow
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
SCRIPT = {"": [f"Let me compute.\n{CALL}", "The result is 42.\n#### 42"]}  # 2 engine calls


def _config(url: str, project: str, *extra: str) -> dict[str, Any]:
    return load_config([
        "actor_rollout_ref.rollout.name=scripted", "actor_rollout_ref.rollout.n=2",
        "data.train_batch_size=4", f"trainer.project_name={project}",
        "actor_rollout_ref.rollout.agent.num_workers=2",
        f"actor_rollout_ref.rollout.trace.tracking_uri={url}", *extra,
    ])  # fmt: skip


def _trace(config: dict[str, Any], spool: Path, **more: Any) -> dict[str, Any]:
    return {**trace_config(config), "spool_dir": str(spool), "flush_interval_s": 0.2,
            "raise_internal_errors": True, **more}  # fmt: skip


def _key(t: Any) -> tuple[str, str, str, str]:
    tags = t.info.tags
    return (tags["step"], tags["sample_index"], tags["rollout_n"], tags["validate"])


def _join(cluster: RayCluster, monkeypatch: pytest.MonkeyPatch) -> Any:
    """This test process becomes the driver of the session's cluster."""
    # before `import ray`: Ray reads its auth mode once, when its C++ core is loaded
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
        monkeypatch.setenv(k, cluster.env()[k])
    import ray

    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    return ray


def _reconcile(per_worker: list[dict[str, Any]]) -> dict[str, float]:
    """Each worker's counters reconcile (submitted = exported + pending + dropped); the sums."""
    for m in per_worker:
        assert m["tracer/submitted"] == (m["tracer/mlflow/exported"] + m["tracer/mlflow/pending"]
                                         + m["tracer/mlflow/dropped"]), m  # fmt: skip
    keys = ("tracer/submitted", "tracer/mlflow/exported", "tracer/mlflow/dropped")
    return {k: sum(m[k] for m in per_worker) for k in keys}


def test_multinode_run_stores_every_trajectory_once_tagged_with_its_node(
    ray_cluster: RayCluster, postgres_mlflow_server: MlflowServer, tmp_path: Path  # noqa: F811
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
    ray_cluster: RayCluster, postgres_uri: str, tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlflow.tracking import MlflowClient

    from rollout.ray_workers import RayRolloutPool

    project, steps = "multinode-server-restart", 4
    (tmp_path / "a").mkdir()
    server = start_mlflow_server(tmp_path / "a", backend_store_uri=postgres_uri)
    port = int(server.url.rsplit(":", 1)[1])
    ray = _join(ray_cluster, monkeypatch)
    pool: Any = None
    try:
        config = _config(server.url, project, f"trainer.total_steps={steps}", "trainer.test_freq=0")
        pool = RayRolloutPool(config, _trace(config, tmp_path / "spool", export_timeout_s=5),
                              engine_kwargs={"script": SCRIPT, "delay_s": 0.3})  # fmt: skip
        results: list[Any] = []
        runner = threading.Thread(
            target=lambda: results.extend(pool.run(steps, flush_timeout_s=120))
        )
        runner.start()
        client = MlflowClient(tracking_uri=server.url)
        deadline = time.monotonic() + 120
        while not _count(client, project) and time.monotonic() < deadline:
            time.sleep(0.2)
        server.stop(kill=True)  # SIGKILL mid-run: step 1 stored, the rest in flight
        time.sleep(3)
        (tmp_path / "b").mkdir()
        server = start_mlflow_server(tmp_path / "b", port=port, backend_store_uri=postgres_uri)
        runner.join(timeout=300)
        assert not runner.is_alive() and len(results) == steps
        assert all(pool.flush(steps, timeout_s=120))
        sums = _reconcile(pool.metrics())
        assert pool.lost == []
    finally:
        try:
            if pool is not None:
                pool.shutdown()
        finally:
            ray.shutdown()
    try:
        traces = search_traces(server.url, project)
        keys = Counter(_key(t) for t in traces)
        assert len(keys) == steps * 8 and max(keys.values()) == 1, keys
        assert sums == {"tracer/submitted": steps * 8, "tracer/mlflow/exported": steps * 8,
                        "tracer/mlflow/dropped": 0}  # fmt: skip
    finally:
        server.stop()


def _count(client: Any, project: str) -> int:
    exp = client.get_experiment_by_name(project)
    return 0 if exp is None else len(client.search_traces(locations=[exp.experiment_id]))


def test_shared_spool_replayed_from_both_nodes_exports_each_batch_once(
    ray_cluster: RayCluster, postgres_mlflow_server: MlflowServer, postgres_uri: str,  # noqa: F811
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollout.ray_workers import RayRolloutPool

    project, steps = "multinode-shared-spool", 2
    shared = tmp_path / "shared-spool"  # one folder standing in for NFS: every node's spool
    (tmp_path / "down").mkdir()
    down = start_mlflow_server(tmp_path / "down", backend_store_uri=postgres_uri)
    ray = _join(ray_cluster, monkeypatch)
    pool: Any = None
    try:
        config = _config(down.url, project, f"trainer.total_steps={steps}", "trainer.test_freq=0")
        pool = RayRolloutPool(config, _trace(config, shared, export_max_retries=0,
                                             export_timeout_s=1),
                              engine_kwargs={"script": SCRIPT})  # fmt: skip
        down.stop(kill=True)  # the workers' server is gone for the whole run: all is spooled
        pool.run(steps, flush_timeout_s=2)
        assert {p["node_ip"] for p in pool.placement} == set(NODE_IPS.values())
        final = pool.shutdown(timeout_s=5)  # the workers end: their batches are orphans now
        assert sum(m["tracer/mlflow/exported"] for m in final) == 0
        batches = list(shared.rglob("*.jsonl"))
        assert len(batches) >= 2, batches

        # replay from both nodes at once, onto the PostgreSQL-backed server
        @ray.remote(num_cpus=0)
        def replay_here(spool_dir: str, url: str) -> tuple[str, dict[str, int]]:
            import ray as r

            from tracer.replay import replay

            result = replay(spool_dir, {"tracking_uri": url})
            assert result.ok, result.failed
            return r.util.get_node_ip_address(), dict(result.replayed)

        refs = [replay_here.options(resources={f"node_{name}": 0.01}).remote(
                    str(shared), postgres_mlflow_server.url) for name in NODE_IPS]  # fmt: skip
        done = ray.get(refs, timeout=300)
    finally:
        try:
            if pool is not None:
                pool.shutdown(timeout_s=5)
        finally:
            ray.shutdown()
            down.stop()
    assert sorted(ip for ip, _ in done) == sorted(NODE_IPS.values())
    replayed = sum(n for _, counts in done for n in counts.values())
    traces = search_traces(postgres_mlflow_server.url, project)
    keys = Counter(_key(t) for t in traces)
    assert replayed == len(traces) == steps * 8 and max(keys.values()) == 1, (done, keys)
    assert not list(shared.rglob("*.jsonl"))  # every batch exported, and deleted, once


def test_worker_node_lost_mid_step_is_reported_and_rerun_and_the_report_matches_the_store(
    ray_cluster: RayCluster, postgres_mlflow_server: MlflowServer, tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Last in this file: the worker node stays down for the rest of the session."""
    from rollout.ray_workers import RayRolloutPool
    from rollout.worker import config_batches

    project = "multinode-node-lost"
    ray = _join(ray_cluster, monkeypatch)
    pool: Any = None
    try:
        config = _config(postgres_mlflow_server.url, project, "trainer.total_steps=3",
                         "trainer.test_freq=0")  # fmt: skip
        # each trajectory takes >= 2 s (2 engine calls of 1 s): the kill lands mid-step
        pool = RayRolloutPool(config, _trace(config, tmp_path / "spool"),
                              engine_kwargs={"script": SCRIPT, "delay_s": 1.0})  # fmt: skip
        lost_node = next(p for p in pool.placement if p["node_ip"] == NODE_IPS["worker"])
        batches = config_batches(config)
        steps = []
        steps.append(pool.run_step(1, next(batches)))
        assert pool.flush(1) == [True, True]
        holder: list[Any] = []
        batch2 = next(batches)
        runner = threading.Thread(target=lambda: holder.append(pool.run_step(2, batch2)))
        runner.start()
        time.sleep(1.0)
        ray_cluster.kill_raylet("worker")
        runner.join(timeout=240)
        assert not runner.is_alive() and holder, "the driver did not notice the lost node"
        steps.append(holder[0])
        pool.flush(2)
        steps.append(pool.run_step(3, next(batches)))  # goes on with the node left
        assert pool.flush(3) == [True]
        survivors = pool.metrics()
        sums = _reconcile(survivors)
    finally:
        try:
            if pool is not None:
                pool.shutdown()
        finally:
            ray.shutdown()

    # the driver's report: step 2's share on the lost node, its samples re-run as attempt 1
    assert len(pool.lost) == 1, [x.describe() for x in pool.lost]
    loss = pool.lost[0]
    assert (loss.step, loss.node_id, loss.node_ip, loss.rerun_attempt) == (
        2, lost_node["node_id"], NODE_IPS["worker"], 1)  # fmt: skip
    expected = {(r["index"], k) for r in batch2 for k in range(2)}
    assert set(loss.samples) < expected and len(loss.samples) == 4
    assert all(len(s.outputs) == 8 for s in steps)  # every sample of every step came back

    # ... and what is in the store says the same
    traces = search_traces(postgres_mlflow_server.url, project)
    by_key = Counter((_key(t), t.info.tags["attempt"]) for t in traces)
    assert max(by_key.values()) == 1, by_key  # nothing stored twice
    for step in ("1", "2", "3"):
        for t in [t for t in traces if t.info.tags["step"] == step]:
            sample = (int(t.info.tags["sample_index"]), int(t.info.tags["rollout_n"]))
            rerun = step == "2" and sample in loss.samples
            if t.info.tags["attempt"] == "1":
                assert rerun and t.info.tags["ray_node_ip"] == NODE_IPS["head"]
            elif rerun:  # a first attempt the lost node exported before it died
                assert t.info.tags["ray_node_id"] == loss.node_id
    got = {(t.info.tags["step"], t.info.tags["sample_index"], t.info.tags["rollout_n"])
           for t in traces}  # fmt: skip
    assert len(got) == 24  # every sample of the 3 steps is in the store
    reruns = [t for t in traces if t.info.tags["attempt"] == "1"]
    assert sorted((int(t.info.tags["sample_index"]), int(t.info.tags["rollout_n"]))
                  for t in reruns) == sorted(loss.samples)  # fmt: skip
    step3 = [t for t in traces if t.info.tags["step"] == "3"]
    assert {t.info.tags["ray_node_ip"] for t in step3} == {NODE_IPS["head"]}
    # the survivor's counters plus what the lost worker stored before it died = the store
    from_lost = sum(t.info.tags["ray_node_id"] == loss.node_id for t in traces)
    assert sums["tracer/mlflow/exported"] + from_lost == len(traces)
    assert sums["tracer/mlflow/dropped"] == 0
