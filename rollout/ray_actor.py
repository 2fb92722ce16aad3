"""The rollout worker as a Ray actor (rollout/ray_workers.py runs a pool of them): engine, agent
loop and tracer in their own process, placed by Ray on any node of the cluster."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping
from typing import Any

from rollout.agent_loop import AgentLoopOutput


class RolloutActor:
    """One rollout worker in its own process (a Ray actor): engine, agent loop and tracer.

    Async actor: ``run_step`` runs its trajectories concurrently on the actor's event loop (as
    the in-process worker does), ``flush`` waits for the tracer in a thread. Every trajectory
    it traces is tagged with its ``worker_id``, its Ray node (``ray_node_id``, ``ray_node_ip``)
    and its ``attempt``.
    """

    def __init__(
        self,
        config: dict[str, Any],
        trace: Mapping[str, Any] | None,
        index: int,
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        import ray

        import tracer
        from rollout.engines import make_engine
        from rollout.worker import RolloutWorker

        self.index = index
        self.worker_id = f"worker-{index}@{socket.gethostname()}:{os.getpid()}"
        self.node_id = ray.get_runtime_context().get_node_id()
        # the address Ray knows this node by (--node-ip-address), not the host name: two nodes
        # on one machine (and containers) share a host name
        self.node_ip = ray.util.get_node_ip_address()
        # tracer.init inside the actor: its own sampler (max_samples_per_step_per_worker counts
        # per actor), its own background pipeline and spool, every trace tagged worker_id.
        base = dict(trace) if trace is not None else {"backend": None}
        tracer.init({**base, "worker_id": self.worker_id})
        self.engine = make_engine(config, **dict(engine_kwargs or {}))
        self.worker = RolloutWorker(config, self.engine)
        self.worker.trace_attributes = {"ray_node_id": self.node_id, "ray_node_ip": self.node_ip}

    async def ready(self) -> dict[str, str]:
        """Where the worker runs (``worker_id``, ``node_id``, ``node_ip``), once it is up."""
        return {"worker_id": self.worker_id, "node_id": self.node_id, "node_ip": self.node_ip}

    async def run_step(
        self, step: int, rows: list[dict[str, Any]], validate: bool = False, attempt: int = 0
    ) -> list[AgentLoopOutput]:
        """All ``len(rows) * n`` trajectories of this worker's share of ``step`` (validation
        samples with ``validate``; ``attempt`` > 0: a re-run of samples lost elsewhere)."""
        if not rows:
            return []
        result = await self.worker.run_step(step, rows, validate=validate, attempt=attempt)
        return result.outputs

    async def flush(self, step: int, timeout_s: float = 60.0) -> bool:
        """Wait until every trajectory finished so far (so all of ``step``) is exported."""
        import tracer

        return await asyncio.to_thread(tracer.flush, timeout_s)

    async def metrics(self) -> dict[str, Any]:
        """The tracer's counters (``tracer/mlflow/exported``, ...) plus ``worker_id``."""
        import tracer

        return {"worker_id": self.worker_id, **tracer.metrics()}

    async def live_partial(self, step: int, validate: bool = False) -> dict[str, Any]:
        """This worker's part of the live analysis of ``step`` (``tracer.live.partial``)."""
        import tracer

        return await asyncio.to_thread(tracer.live.partial, step, validate=validate)

    async def shutdown(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Close the engine, flush and stop the tracer; returns the final metrics."""
        import tracer

        try:
            await self.engine.close()
        finally:
            m = tracer.metrics()
            ok = await asyncio.to_thread(tracer.shutdown, timeout_s)
        return {"worker_id": self.worker_id, "flushed": ok, **m}
