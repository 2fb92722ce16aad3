"""Rollout workers as Ray actors, all tracing into one shared store (like verl's AgentLoopWorker).

``actor_rollout_ref.rollout.agent.num_workers = K > 0`` runs the rollout in K Ray actors::

    driver (RayRolloutPool)                     actor i (RolloutActor, async)
      batch of step N, split by prompt  ──────>  RolloutWorker.run_step(N, its prompts)
                                                   tracer: worker_id "worker-i@host:pid",
                                                   max_samples_per_step_per_worker per actor
      ray.get([w.flush.remote(N) ...])  ──────>  tracer.flush(): step N durable -> True

Each actor initialises the tracer itself from the trace config it is given (``tracer.init``
inside the actor) and exports to the configured backend: for several workers, one MLflow
tracking server (``trace.tracking_uri=http://host:5000``) that every actor posts to over HTTP.
A step's batch is split across the actors by prompt, so a GRPO group (the ``n`` samples of one
prompt) always runs, and is sampled, on one worker.

The same code runs on Ray's local cluster (``ray_kwargs.ray_init.address: null`` and no
``RAY_ADDRESS``: ``ray.init`` starts one) and on a multi-node cluster, by configuration alone
(``ray_kwargs.ray_init.address=auto`` on a cluster node, ``ray://head:10001``, or
``RAY_ADDRESS``). Ray is an optional dependency (``pip install 'rollout-tracer[ray]'``); this
module imports it only when a pool is created.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout.agent_loop import AgentLoopOutput
from rollout.worker import StepResult, config_batches, validation_rows, validation_steps

log = logging.getLogger("rollout")


def num_workers(config: Mapping[str, Any]) -> int:
    """``actor_rollout_ref.rollout.agent.num_workers`` (0, the default: in-process, no Ray)."""
    agent = config["actor_rollout_ref"]["rollout"].get("agent") or {}
    value = agent.get("num_workers") or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"actor_rollout_ref.rollout.agent.num_workers must be an int >= 0, got {value!r}"
        )
    return value


def ray_init_kwargs(config: Mapping[str, Any]) -> dict[str, Any]:
    """``ray_kwargs.ray_init`` without its null values: the keyword arguments of ``ray.init``."""
    section = (config.get("ray_kwargs") or {}).get("ray_init") or {}
    return {k: v for k, v in dict(section).items() if v is not None}


def split_by_prompt(batch: Sequence[Any], parts: int) -> list[list[Any]]:
    """Contiguous chunks of ``batch`` for ``parts`` workers, sizes differing by at most one
    (the first ``len % parts`` chunks get one more); a chunk may be empty."""
    size, extra = divmod(len(batch), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(list(batch[start:end]))
        start = end
    return chunks


class RolloutActor:
    """One rollout worker in its own process (a Ray actor): engine, agent loop and tracer.

    Async actor: ``run_step`` runs its trajectories concurrently on the actor's event loop (as
    the in-process worker does), ``flush`` waits for the tracer in a thread.
    """

    def __init__(
        self,
        config: dict[str, Any],
        trace: Mapping[str, Any] | None,
        index: int,
        engine_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        import tracer
        from rollout.engines import make_engine
        from rollout.worker import RolloutWorker

        self.index = index
        self.worker_id = f"worker-{index}@{socket.gethostname()}:{os.getpid()}"
        # tracer.init inside the actor: its own sampler (max_samples_per_step_per_worker counts
        # per actor), its own background pipeline and spool, every trace tagged worker_id.
        base = dict(trace) if trace is not None else {"backend": None}
        tracer.init({**base, "worker_id": self.worker_id})
        self.engine = make_engine(config, **dict(engine_kwargs or {}))
        self.worker = RolloutWorker(config, self.engine)

    async def ready(self) -> str:
        """The worker id, once the actor (engine, tracer) is up."""
        return self.worker_id

    async def run_step(
        self, step: int, rows: list[dict[str, Any]], validate: bool = False
    ) -> list[AgentLoopOutput]:
        """All ``len(rows) * n`` trajectories of this worker's share of ``step`` (validation
        samples with ``validate``)."""
        if not rows:
            return []
        result = await self.worker.run_step(step, rows, validate=validate)
        return result.outputs

    async def flush(self, step: int, timeout_s: float = 60.0) -> bool:
        """Wait until every trajectory finished so far (so all of ``step``) is exported."""
        import tracer

        return await asyncio.to_thread(tracer.flush, timeout_s)

    async def metrics(self) -> dict[str, Any]:
        """The tracer's counters (``tracer/mlflow/exported``, ...) plus ``worker_id``."""
        import tracer

        return {"worker_id": self.worker_id, **tracer.metrics()}

    async def shutdown(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Close the engine, flush and stop the tracer; returns the final metrics."""
        import tracer

        try:
            await self.engine.close()
        finally:
            m = tracer.metrics()
            ok = await asyncio.to_thread(tracer.shutdown, timeout_s)
        return {"worker_id": self.worker_id, "flushed": ok, **m}


class RayRolloutPool:
    """The driver side: K :class:`RolloutActor` actors, one step at a time.

    Example::

        pool = RayRolloutPool(config, trace_config(config))   # ray.init from ray_kwargs
        try:
            result = pool.run_step(1, batch)    # split by prompt, gathered in batch order
            assert all(pool.flush(1))           # step 1's traces are durable in the store
        finally:
            pool.shutdown()                     # and ray.shutdown() if the pool started Ray
    """

    def __init__(
        self,
        config: dict[str, Any],
        trace: Mapping[str, Any] | None,
        workers: int | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        start_timeout_s: float = 600.0,
    ) -> None:
        try:
            import ray
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "actor_rollout_ref.rollout.agent.num_workers > 0 needs Ray: "
                "pip install 'rollout-tracer[ray]'"
            ) from exc
        self.ray = ray
        self.config = config
        k = num_workers(config) if workers is None else workers
        if k <= 0:
            raise ValueError(f"a Ray rollout pool needs at least one worker, got {k}")
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            # address None: RAY_ADDRESS if set, else a new local cluster
            ray.init(**{"include_dashboard": False, **ray_init_kwargs(config)})
        agent = config["actor_rollout_ref"]["rollout"].get("agent") or {}
        cpus = agent.get("num_cpus_per_worker")
        actor_cls = ray.remote(RolloutActor).options(
            num_cpus=1 if cpus is None else cpus, max_concurrency=1000
        )
        self.workers: list[Any] = [  # ray ActorHandles
            actor_cls.remote(config, dict(trace) if trace is not None else None, i, engine_kwargs)
            for i in range(k)
        ]
        try:
            self.worker_ids: list[str] = ray.get(
                [w.ready.remote() for w in self.workers], timeout=start_timeout_s
            )
        except ray.exceptions.GetTimeoutError as exc:
            self.shutdown()
            raise RuntimeError(
                f"{k} rollout workers did not start within {start_timeout_s:.0f} s: does the "
                f"cluster have {k} x num_cpus_per_worker CPUs? {ray.cluster_resources()}"
            ) from exc
        except BaseException:
            self.shutdown()
            raise
        self.flushed: dict[int, list[bool]] = {}

    def run_step(
        self,
        step: int,
        batch: Sequence[dict[str, Any]],
        on_done: Callable[[AgentLoopOutput], None] | None = None,
        validate: bool = False,
    ) -> StepResult:
        """Run ``step`` over ``batch``: whole prompts (GRPO groups) per worker; the outputs
        come back in batch order. ``on_done`` is called per trajectory as workers finish."""
        t0 = time.perf_counter()
        chunks = split_by_prompt(batch, len(self.workers))
        refs = [w.run_step.remote(step, c, validate)
                for w, c in zip(self.workers, chunks, strict=True)]  # fmt: skip
        if on_done is not None:
            pending = list(refs)
            while pending:
                done, pending = self.ray.wait(pending, num_returns=1)
                for out in self.ray.get(done[0]):
                    on_done(out)
        parts: list[list[AgentLoopOutput]] = self.ray.get(refs)
        outs = [out for part in parts for out in part]
        elapsed = time.perf_counter() - t0  # flush not included
        return StepResult(step, outs, elapsed_s=elapsed, validate=validate)

    def flush(self, step: int, timeout_s: float = 60.0) -> list[bool]:
        """Every worker flushes its tracer; all True: the traces of ``step`` are durable."""
        ok: list[bool] = self.ray.get([w.flush.remote(step, timeout_s) for w in self.workers])
        self.flushed[step] = ok
        return ok

    def metrics(self) -> list[dict[str, Any]]:
        """Each worker's tracer counters, with its ``worker_id``."""
        return list(self.ray.get([w.metrics.remote() for w in self.workers]))

    def run(
        self,
        total_steps: int,
        on_done: Callable[[AgentLoopOutput], None] | None = None,
        on_step: Callable[[StepResult], None] | None = None,
        flush_timeout_s: float = 60.0,
        on_validate: Callable[[StepResult], None] | None = None,
    ) -> list[StepResult]:
        """``total_steps`` steps over the configured dataset (the same batches as the
        in-process worker), flushing every worker at the end of each step; validation passes
        on the in-process worker's schedule (``trainer.test_freq``, ``val_before_train``)."""
        batches = config_batches(self.config)
        before, after = validation_steps(self.config, total_steps)
        val_rows = validation_rows(self.config) if before or after else []

        def validate(step: int) -> None:
            val = self.run_step(step, val_rows, validate=True)
            self.flush(step, flush_timeout_s)
            if on_validate is not None:
                on_validate(val)

        results = []
        if before:
            validate(0)
        for step in range(1, total_steps + 1):
            result = self.run_step(step, next(batches), on_done)
            ok = self.flush(step, flush_timeout_s)
            if not all(ok):
                late = [w for w, good in zip(self.worker_ids, ok, strict=True) if not good]
                log.warning(
                    "rollout-tracer: traces of step %d not yet durable on %s (spooled, "
                    "exported when the backend catches up)", step, late,
                )  # fmt: skip
            results.append(result)
            if on_step is not None:
                on_step(result)
            if step in after:
                validate(step)
        return results

    def shutdown(self, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Flush and stop every worker's tracer, end the actors, and stop Ray if this pool
        started it. Returns each worker's final metrics (empty for a worker that failed)."""
        ray = self.ray
        final: list[dict[str, Any]] = []
        try:
            for w in getattr(self, "workers", []):
                try:
                    final.append(ray.get(w.shutdown.remote(timeout_s), timeout=timeout_s + 30))
                except Exception as exc:
                    log.warning("rollout-tracer: a rollout worker did not shut down: %s", exc)
                    final.append({})
                ray.kill(w)
            self.workers = []
        finally:
            if self.owns_ray and ray.is_initialized():
                ray.shutdown()
        return final


def combine_tracer_metrics(per_worker: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The workers' tracer counters added up (rates such as ``*_per_trajectory`` averaged):
    the driver's ``tracer/...`` step metrics for all workers together."""
    values: dict[str, list[float]] = {}
    for m in per_worker:
        for key, v in m.items():
            number = isinstance(v, (int, float)) and not isinstance(v, bool)
            if key.startswith("tracer/") and number:
                values.setdefault(key, []).append(float(v))
    return {k: sum(v) / len(v) if "_per_" in k else sum(v) for k, v in values.items()}


def cmd_run_ray(
    args: Any, config: dict[str, Any], trace: dict[str, Any], browse_hint: Callable[[], None]
) -> int:
    """``rollout-tracer run`` with ``agent.num_workers > 0`` (called from rollout/cli.py after
    the driver's ``tracer.init`` validated the trace config and reached the backend, and
    ``trainer.logger`` started ``args.tracking``: the driver logs every step's metrics)."""
    from tqdm import tqdm

    import tracer

    tracer.shutdown()  # the driver traces nothing: each actor runs its own tracer
    tracking = getattr(args, "tracking", None)
    k = num_workers(config)
    uri = str(trace.get("tracking_uri") or "")
    backends = trace.get("backend")
    if "mlflow" in str(backends) and not uri.startswith(("http://", "https://")):
        print(f"note: {k} workers share the MLflow store {uri}; for several workers (and any "
              "multi-node cluster) point them at one tracking server: "
              "actor_rollout_ref.rollout.trace.tracking_uri=http://HOST:5000")  # fmt: skip
    steps = int(config["trainer"]["total_steps"])
    rollout = config["actor_rollout_ref"]["rollout"]
    total = steps * int(config["data"]["train_batch_size"]) * int(rollout["n"])
    t0 = time.perf_counter()
    print(f"starting {k} Ray rollout workers ({rollout['name']} engine for "
          f"{config['actor_rollout_ref']['model']['path']})")  # fmt: skip
    pool: RayRolloutPool | None = None
    bar = tqdm(total=total, desc="trajectories", unit="traj", disable=args.no_progress)

    def on_step(result: StepResult) -> None:
        assert pool is not None
        m = result.metrics()
        bar.set_postfix(step=result.step, score=f"{m['score']:.2f}", turns=f"{m['turns']:.1f}")
        durable = all(pool.flushed.get(result.step, [False]))
        if tracking is not None:  # console line and trackers (trainer.logger), all workers
            tracking.log_step(result, combine_tracer_metrics(pool.metrics()))
        if not durable:
            tqdm.write(f"step {result.step}: traces not yet durable on every worker (spooled)")

    def on_validate(result: StepResult) -> None:
        assert pool is not None
        if tracking is not None:  # val/ metrics and the val/generations table
            tracking.log_validation(result, combine_tracer_metrics(pool.metrics()))

    final: list[dict[str, Any]] = []
    failed = True
    try:
        pool = RayRolloutPool(config, trace, k)
        pool.run(steps, on_done=lambda _: bar.update(1), on_step=on_step,
                 on_validate=on_validate)  # fmt: skip
        failed = False
    finally:
        bar.close()
        if pool is not None:
            final = pool.shutdown()
        if tracking is not None:
            tracking.finish(failed=failed)
    stats = combine_tracer_metrics(final)
    print(f"done: {total} trajectories in {time.perf_counter() - t0:.1f} s on {k} workers; "
          f"tracer (all workers): {stats}")  # fmt: skip
    for m in final:
        exported = {n: v for n, v in m.items() if n.endswith("/exported")}
        print(f"  {m.get('worker_id', '?')}: {exported}")
    browse_hint()
    return 0
