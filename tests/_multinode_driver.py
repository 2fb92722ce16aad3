"""The driver of tests/test_multinode.py's fault scenarios (and of test_ray_workers.py's run),
in its own process (as a user's driver is): Ray keeps process-wide state (its auth mode is
read once, when its core loads), so joining the test cluster from pytest's own process would
leak into later tests.

    python -m tests._multinode_driver SCENARIO '{"json": "arguments"}'

joins the cluster named by RAY_ADDRESS (token in the environment), runs the scenario, and
prints one JSON line (``RESULT {...}``): what the driver saw, for the test to hold against the
store.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from rollout.config import load_config, trace_config
from rollout.ray_workers import RayRolloutPool
from rollout.worker import config_batches
from tests._forward import Forward
from tests._servers import start_mlflow_server

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n</tool_call>'
SCRIPT = {"": [f"Let me compute.\n{CALL}", "The result is 42.\n#### 42"]}  # 2 engine calls


def _config(url: str, project: str, steps: int) -> dict[str, Any]:
    return load_config([
        "actor_rollout_ref.rollout.name=scripted", "actor_rollout_ref.rollout.n=2",
        "data.train_batch_size=4", f"trainer.project_name={project}",
        "actor_rollout_ref.rollout.agent.num_workers=2", f"trainer.total_steps={steps}",
        "trainer.test_freq=0", f"actor_rollout_ref.rollout.trace.tracking_uri={url}",
    ])  # fmt: skip


def _trace(config: dict[str, Any], spool: str, **more: Any) -> dict[str, Any]:
    return {**trace_config(config), "spool_dir": spool, "flush_interval_s": 0.2,
            "replay_interval_s": 0.5, "raise_internal_errors": True, **more}  # fmt: skip


def _count(url: str, project: str) -> int:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=url)
    exp = client.get_experiment_by_name(project)
    return 0 if exp is None else len(client.search_traces(locations=[exp.experiment_id]))


def server_restart(a: dict[str, Any]) -> dict[str, Any]:
    """The server goes away as soon as step 1 is durable (its port refuses connections, open
    ones are reset: a SIGKILL as the workers see it) and a new PostgreSQL-backed server starts
    on the same port while step 2 runs; the run goes on throughout."""
    t0 = time.monotonic()
    root = Path(a["tmp"])
    # the first server: the session's, behind a port that can go dark (tests/_forward.py)
    first = Forward(_host_port(a["url"]))
    # MLflow's client (for _count) imports while the workers start, not after step 1
    threading.Thread(target=importlib.import_module, args=("mlflow.tracking",),
                     daemon=True).start()  # fmt: skip
    restarted: list[Any] = []
    config = _config(first.url, a["project"], a["steps"])
    pool = RayRolloutPool(config, _trace(config, str(root / "spool"), export_timeout_s=5),
                          engine_kwargs={"script": SCRIPT, "delay_s": 0.2})  # fmt: skip
    timings = {"started_s": time.monotonic() - t0}
    stored: list[int] = []

    def restart() -> None:
        # no pause first: a server takes seconds to import before it listens, and step 2
        # (~0.5 s) runs into the dark port meanwhile (the test checks that exports failed)
        restarted.append(start_mlflow_server(root, port=first.port,
                                             backend_store_uri=a["postgres_uri"]))  # fmt: skip
        timings["restarted_s"] = time.monotonic() - t0

    restarter = threading.Thread(target=restart)

    def on_step(result: Any) -> None:
        if result.step == 1:  # step 1 is durable: the server goes while the rest runs
            stored.append(_count(first.url, a["project"]))
            first.close()
            timings["killed_s"] = time.monotonic() - t0
            restarter.start()

    try:
        results = pool.run(a["steps"], on_step=on_step, flush_timeout_s=120)
        restarter.join(timeout=300)
        durable = all(pool.flush(a["steps"], timeout_s=120))
        timings["durable_s"] = time.monotonic() - t0
        return {"steps": len(results), "trajectories": sum(len(r.outputs) for r in results),
                "durable": durable, "metrics": pool.metrics(), "stored_before_kill": stored,
                "restarted": len(restarted), "lost": [dataclasses.asdict(x) for x in pool.lost],
                "timings": timings}  # fmt: skip
    finally:
        pool.shutdown()
        first.close()
        for server in restarted:
            server.stop(kill=True)  # the scenario is over: no graceful shutdown to wait for


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def shared_spool(a: dict[str, Any]) -> dict[str, Any]:
    """Both workers spool into one folder while their server is gone; then both nodes replay
    that folder at the same time, onto the PostgreSQL-backed server."""
    import ray

    # the session's server behind a port that goes dark before the run (tests/_forward.py)
    down = Forward(_host_port(a["url"]))
    config = _config(down.url, a["project"], a["steps"])
    pool = RayRolloutPool(config, _trace(config, a["shared"], export_max_retries=0,
                                         export_timeout_s=1),
                          engine_kwargs={"script": SCRIPT})  # fmt: skip
    try:
        down.close()  # gone for the whole run: every batch goes to the shared spool
        # with the server down a flush waits out its whole timeout: 1 s per step, 3 s at
        # shutdown are ample for batches that are spooled the moment the connection is refused
        pool.run(a["steps"], flush_timeout_s=1)
        placement = list(pool.placement)
    finally:
        final = pool.shutdown(timeout_s=3)  # the workers end: their batches are orphans now
    batches = len(list(Path(a["shared"]).rglob("*.jsonl")))

    @ray.remote(num_cpus=0)
    def replay_here(spool_dir: str, url: str) -> tuple[str, dict[str, int], dict[str, str]]:
        from tracer.replay import replay

        # the workers' 1 s timeout was for a server that is down; a loaded one needs longer
        result = replay(spool_dir, {"tracking_uri": url, "export_timeout_s": 60})
        return ray.util.get_node_ip_address(), dict(result.replayed), dict(result.failed)

    refs = [replay_here.options(resources={f"node_{name}": 0.01}).remote(a["shared"], a["url"])
            for name in ("head", "worker")]  # fmt: skip
    return {"placement": placement, "exported_by_workers":
            sum(m.get("tracer/mlflow/exported", 0) for m in final), "batches": batches,
            "replays": ray.get(refs, timeout=300)}  # fmt: skip


def node_lost(a: dict[str, Any]) -> dict[str, Any]:
    """Step 2 running on both nodes when the worker node's raylet is SIGKILLed."""
    root = Path(a["tmp"])
    config = _config(a["url"], a["project"], 3)
    batches = config_batches(config)
    batch1, batch2, batch3 = next(batches), next(batches), next(batches)
    # step 2's trajectories each take >= 4 s (2 engine calls of 2 s) and the kill lands 1 s
    # in: the node's actor, which outlives its raylet by up to ~1 s (Ray's check interval) and
    # could still hand its share back directly to the driver, cannot finish it in time.
    # Steps 1 and 3 answer at once (one call, 2 s): the kill is not theirs.
    script = {row["question"]: SCRIPT[""] for row in batch2}
    assert not any(q in row["question"] for q in script for row in batch1 + batch3)
    script[""] = SCRIPT[""][1:]
    pool = RayRolloutPool(config, _trace(config, str(root / "spool")),
                          engine_kwargs={"script": script, "delay_s": 2.0})  # fmt: skip
    try:
        placement = list(pool.placement)
        out: dict[str, Any] = {"placement": placement, "steps": []}
        first = pool.run_step(1, batch1)
        out["flushed_1"] = pool.flush(1)
        holder: list[Any] = []
        runner = threading.Thread(target=lambda: holder.append(pool.run_step(2, batch2)))
        runner.start()
        time.sleep(1.0)
        os.kill(a["raylet_pid"], signal.SIGKILL)
        t0 = time.monotonic()
        runner.join(timeout=240)
        out["noticed_s"] = round(time.monotonic() - t0, 1)
        out["flushed_2"] = pool.flush(2)
        third = pool.run_step(3, batch3)  # goes on with the node left
        out["flushed_3"] = pool.flush(3)
        out["steps"] = [len(r.outputs) for r in (first, *holder, third)]
        out["batch2"] = [r["index"] for r in batch2]
        out["metrics"] = pool.metrics()
        out["lost"] = [dataclasses.asdict(x) for x in pool.lost]
        out["report"] = [x.describe() for x in pool.lost]
        return out
    finally:
        pool.shutdown()


def pool_run(a: dict[str, Any]) -> dict[str, Any]:
    """A plain run of ``a["overrides"]`` (tests/test_ray_workers.py checks what it stored):
    ``pool.run`` with the validation passes, each worker's counters after the last flush."""
    config = load_config(a["overrides"])
    pool = RayRolloutPool(config, {**trace_config(config), **a["trace"]},
                          engine_kwargs={"script": SCRIPT, "delay_s": a["delay_s"]})  # fmt: skip
    try:
        vals: list[Any] = []
        results = pool.run(int(config["trainer"]["total_steps"]), on_validate=vals.append)
        return {"worker_ids": pool.worker_ids, "steps": [len(r.outputs) for r in results],
                "tool_once_and_rewarded": all(o.tool_calls == 1 and o.reward for r in results
                                              for o in r.outputs),
                "flushed": {str(k): v for k, v in pool.flushed.items()},
                "metrics": pool.metrics(),
                "vals": [(v.step, v.validate, len(v.outputs)) for v in vals]}  # fmt: skip
    finally:
        pool.shutdown()


def main() -> None:
    import ray

    scenario, args = sys.argv[1], json.loads(sys.argv[2])
    ray.init(address=os.environ["RAY_ADDRESS"], include_dashboard=False, log_to_driver=False)
    try:
        result = {"server_restart": server_restart, "shared_spool": shared_spool,
                  "node_lost": node_lost, "pool_run": pool_run}[scenario](args)  # fmt: skip
    finally:
        ray.shutdown()
    print("RESULT " + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
