"""Fault injection against a real tracking server: gone mid-run and back, nothing lost,
nothing stored twice (read back with MLflow's own client)."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest

import tracer
from tests._forward import Outage
from tests._servers import MlflowServer
from tests._wait import wait_for
from tests.conftest import search_traces

pytest.importorskip("mlflow")


# The server goes away as a SIGKILL looks from the client (its port refuses, open connections
# are reset) while the session's server stands behind the port: its data is all there when it
# is back, as a restarted server's is. A real SIGKILL and restart: tests/test_chaos.py.
@pytest.mark.slow(seconds=15)
def test_server_gone_mid_run_and_back_stores_exactly_500(
    tmp_path: Path, mlflow_server: MlflowServer
) -> None:
    server = Outage(mlflow_server.url)
    project = f"outage-{uuid.uuid4().hex[:8]}"  # the server is shared: a project of its own
    try:
        tracer.init(
            backend="mlflow",
            tracking_uri=server.url,
            project_name=project,
            spool_dir=str(tmp_path / "spool"),
            flush_interval_s=0.2,
            export_batch_size=25,
            export_max_retries=1,
            replay_interval_s=0.5,
            export_timeout_s=10,
            raise_internal_errors=True,
        )

        @tracer.trace_op(kind="generate")
        def generate(prompt: str) -> str:
            return prompt.upper()

        @tracer.trace_op(kind="reward")
        def reward(i: int) -> float:
            return float(i % 3 == 0)

        def metric(name: str) -> float:
            return float(tracer.metrics()[f"tracer/mlflow/{name}"])

        # conditions, not a fixed pace: a first batch stored before the crash, batches spooled
        # while the server is down, the rest traced after it is back
        for i in range(500):
            with tracer.trace_attr(step=i // 100, sample_index=i % 100):
                generate(f"question {i}")
                reward(i)
            if i == 200:
                wait_for(lambda: metric("exported") > 0, "a first batch stored")
                server.down()  # the tracking server goes away mid-run
            if i == 350:
                wait_for(lambda: metric("down") > 0 and metric("spooled_batches") > 0,
                         "the server seen down, batches spooled")  # fmt: skip
                server.up()  # ... and comes back
        assert tracer.flush(180), tracer.metrics()
        m = tracer.metrics()
        assert m["tracer/mlflow/replayed"] > 0 and m["tracer/mlflow/failed"] == 0, str(m)
        traces = search_traces(server.url, project)
        keys = [(t.info.tags["step"], t.info.tags["sample_index"]) for t in traces]
        assert len(keys) == 500 and len(set(keys)) == 500
        rewards = [a for t in traces for a in t.info.assessments if a.name == "reward"]
        assert len(rewards) == 500  # one reward per trajectory, none duplicated by replay
        assert all(len(t.data.spans) == 3 for t in traces)
    finally:
        tracer.reset()
        server.down()


def test_reward_requests_that_fail_mid_batch_are_retried_once_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mlflow_server: MlflowServer
) -> None:
    """Rewards go to a tracking server side by side (one REST call each). Two of them fail
    inside one batch: the batch is retried, and one lookup finds the traces stored and which
    already have their reward: those are not written again, the two lost ones are."""
    from tracer.backends import mlflow_backend

    real_rest = mlflow_backend.MlflowExporter._rest
    posts = {"n": 0}
    lock = threading.Lock()

    def flaky_rest(self, method, endpoint, body):  # the fault: the 3rd and 7th POST fail
        if method == "POST" and endpoint.endswith("/assessments"):
            with lock:
                posts["n"] += 1
                n = posts["n"]
            if n in (3, 7):
                raise ConnectionError(f"injected: reward request {n} lost")
        return real_rest(self, method, endpoint, body)

    monkeypatch.setattr(mlflow_backend.MlflowExporter, "_rest", flaky_rest)
    server, exp = mlflow_server, f"flaky-rewards-{tmp_path.name}"  # the session's server
    try:
        tracer.init(backend="mlflow", tracking_uri=server.url, project_name=exp,
                    spool_dir=str(tmp_path / "spool"), export_batch_size=20,
                    flush_interval_s=0.2, replay_interval_s=0.3, export_timeout_s=10,
                    export_in_subprocess=False)  # the fault is patched into this process

        @tracer.trace_op(kind="reward")
        def reward(i: int) -> float:
            return i / 10

        for i in range(40):
            with tracer.trace_attr(step=0, sample_index=i):
                reward(i)
        assert tracer.flush(120), tracer.metrics()
        traces = search_traces(server.url, exp)
        assert len(traces) == 40
        rewards = {
            t.info.tags["sample_index"]: [a.value for a in t.info.assessments if a.name == "reward"]
            for t in traces
        }
        assert rewards == {str(i): [i / 10] for i in range(40)}  # each once, right value
        assert posts["n"] >= 42  # the two lost requests were sent again
    finally:
        tracer.reset()
