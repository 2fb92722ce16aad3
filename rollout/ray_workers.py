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

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rollout.agent_loop import AgentLoopOutput
from rollout.ray_actor import RolloutActor
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


@dataclass
class LostShare:
    """A worker's share of a step that did not come back: its actor (usually its node) died.

    ``samples`` are the ``(sample_index, rollout_n)`` pairs it was running. Their trajectories
    may be partly in the store already (tagged with the dead ``node_id``, ``attempt`` as run):
    the tracer exports as it goes, and what was still in that process's buffer or spool is gone
    unless the spool folder is shared and replayed (README). ``rerun_attempt`` is the attempt
    they were re-run as on the remaining workers, None when they were not re-run.
    """

    step: int
    validate: bool
    worker_id: str
    node_id: str
    node_ip: str
    attempt: int
    samples: list[tuple[Any, int]]
    error: str
    rerun_attempt: int | None = None

    def describe(self) -> str:
        what = "validation samples" if self.validate else "samples"
        fate = (f"re-run as attempt {self.rerun_attempt}" if self.rerun_attempt is not None
                else "not re-run")  # fmt: skip
        return (f"step {self.step}: {len(self.samples)} {what} {self.samples} lost with node "
                f"{self.node_ip} ({self.node_id[:12]}, {self.worker_id}); {fate}: {self.error}")


def _samples(rows: Sequence[Mapping[str, Any]], n: int) -> list[tuple[Any, int]]:
    return [(row["index"], k) for row in rows for k in range(n)]


# Errors that mean a worker (its process or its whole node) is gone, not a bug in the rollout.
def _lost_errors(ray: Any) -> tuple[type[BaseException], ...]:
    ex = ray.exceptions
    return tuple(getattr(ex, n) for n in ("RayActorError", "NodeDiedError", "WorkerCrashedError",
                                          "ObjectLostError") if hasattr(ex, n))  # fmt: skip


class RayRolloutPool:
    """The driver side: K :class:`RolloutActor` actors, one step at a time.

    A worker that dies mid-step (its node lost) is noticed when its share does not come back:
    the pool records a :class:`LostShare` in ``lost`` (which samples, which node), drops the
    worker, re-runs the share on the remaining workers as the next ``attempt`` (``rerun_lost``)
    and goes on; with no worker left it raises.

    Example::

        pool = RayRolloutPool(config, trace_config(config))   # ray.init from ray_kwargs
        try:
            result = pool.run_step(1, batch)    # split by prompt, gathered in batch order
            assert all(pool.flush(1))           # step 1's traces are durable in the store
            for loss in pool.lost: print(loss.describe())
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
        rerun_lost: bool = True,
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
        self.rerun_lost = rerun_lost
        self.lost: list[LostShare] = []
        self.flushed: dict[int, list[bool]] = {}
        # worker id -> (step, validate, attempt, samples) of the share it ran last
        self._last_share: dict[str, tuple[int, bool, int, list[tuple[Any, int]]]] = {}
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
            self.placement: list[dict[str, str]] = ray.get(
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

    @property
    def worker_ids(self) -> list[str]:
        """The live workers' ids, in pool order."""
        return [p["worker_id"] for p in self.placement]

    def run_step(
        self,
        step: int,
        batch: Sequence[dict[str, Any]],
        on_done: Callable[[AgentLoopOutput], None] | None = None,
        validate: bool = False,
    ) -> StepResult:
        """Run ``step`` over ``batch``: whole prompts (GRPO groups) per worker; the outputs
        come back in batch order. ``on_done`` is called per trajectory as workers finish.
        A share lost with its worker is recorded in ``lost`` and re-run (see the class)."""
        ray = self.ray
        t0 = time.perf_counter()
        rollout = self.config["actor_rollout_ref"]["rollout"]
        n = int((rollout.get("val_kwargs") or {}).get("n", 1)) if validate else int(rollout["n"])
        # (order key, rows, attempt): the key keeps the outputs in batch order across re-runs
        shares: list[tuple[tuple[int, ...], list[Any], int]] = [
            ((i,), rows, 0) for i, rows in enumerate(split_by_prompt(batch, len(self.workers)))
        ]
        got: dict[tuple[int, ...], list[AgentLoopOutput]] = {}
        while shares:
            if not self.workers:
                raise RuntimeError(f"step {step}: no rollout worker left; "
                                   + "; ".join(x.describe() for x in self.lost))  # fmt: skip
            running: dict[Any, tuple[tuple[int, ...], list[Any], int, Any, dict[str, str]]] = {}
            for j, (key, rows, attempt) in enumerate(shares):
                handle = self.workers[j % len(self.workers)]
                place = self.placement[j % len(self.workers)]
                if rows:
                    ref = handle.run_step.remote(step, rows, validate, attempt)
                    running[ref] = (key, rows, attempt, handle, place)
                    self._last_share[place["worker_id"]] = (step, validate, attempt,
                                                            _samples(rows, n))  # fmt: skip
            shares = []
            pending = list(running)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                key, rows, attempt, handle, place = running[done[0]]
                try:
                    outs: list[AgentLoopOutput] = ray.get(done[0])
                except _lost_errors(ray) as exc:
                    why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                    loss = LostShare(step, validate, place["worker_id"], place["node_id"],
                                     place["node_ip"], attempt, _samples(rows, n), why)  # fmt: skip
                    self._drop(handle)
                    if self.rerun_lost:
                        loss.rerun_attempt = attempt + 1
                        shares.append((key, rows, attempt + 1))
                    self.lost.append(loss)
                    log.error("rollout-tracer: %s", loss.describe())
                    continue
                got[key] = outs
                if on_done is not None:
                    for out in outs:
                        on_done(out)
            # a lost share is split over the workers left, whole prompts each
            left = max(1, len(self.workers))
            shares = [((*key, m), sub, attempt) for key, rows, attempt in shares
                      for m, sub in enumerate(split_by_prompt(rows, left))]  # fmt: skip
        outs = [out for key in sorted(got) for out in got[key]]
        elapsed = time.perf_counter() - t0  # flush not included
        return StepResult(step, outs, elapsed_s=elapsed, validate=validate)

    def _drop(self, handle: Any) -> None:
        """Take a dead worker out of the pool (its actor is ended, should it linger)."""
        for i, w in enumerate(self.workers):
            if w is handle:
                del self.workers[i]
                del self.placement[i]
                break
        with contextlib.suppress(Exception):
            self.ray.kill(handle, no_restart=True)

    def flush(self, step: int, timeout_s: float = 60.0) -> list[bool]:
        """Every worker flushes its tracer; all True: the traces of ``step`` are durable.
        A worker lost before its flush answered is recorded in ``lost`` (its samples ran, but
        the traces it had not exported yet are gone or in its spool) and dropped."""
        ray = self.ray
        refs = [(w, p, w.flush.remote(step, timeout_s))
                for w, p in zip(self.workers, self.placement, strict=True)]  # fmt: skip
        ok: list[bool] = []
        for handle, place, ref in refs:
            try:
                ok.append(bool(ray.get(ref)))
                if not ok[-1]:
                    log.warning("rollout-tracer: traces of step %d not yet durable on %s "
                                "(spooled, exported when the backend catches up)", step,
                                place["worker_id"])  # fmt: skip
            except _lost_errors(ray) as exc:
                ok.append(False)
                last = self._last_share.get(place["worker_id"], (step, False, 0, []))
                why = f"lost before its traces were durable: {type(exc).__name__}"
                loss = LostShare(last[0], last[1], place["worker_id"], place["node_id"],
                                 place["node_ip"], last[2], last[3] if last[0] == step else [],
                                 why)  # fmt: skip
                self.lost.append(loss)
                self._drop(handle)
                log.error("rollout-tracer: %s", loss.describe())
        self.flushed[step] = ok
        return ok

    def metrics(self) -> list[dict[str, Any]]:
        """Each live worker's tracer counters, with its ``worker_id`` (a worker lost since
        the last step is left out; ``flush`` or ``run_step`` records the loss)."""
        refs = [w.metrics.remote() for w in self.workers]
        out = []
        for ref in refs:
            with contextlib.suppress(*_lost_errors(self.ray)):
                out.append(self.ray.get(ref))
        return out

    def live_partial(self, step: int, validate: bool = False) -> dict[str, Any]:
        """The live analysis of ``step`` over every live worker: their partials merged
        (``tracer.live.merge``); a worker lost since is left out."""
        import tracer

        refs = [w.live_partial.remote(step, validate) for w in self.workers]
        parts = []
        for ref in refs:
            with contextlib.suppress(*_lost_errors(self.ray)):
                parts.append(self.ray.get(ref))
        return tracer.live.merge(parts) if parts else {"step": step, "validate": validate,
                                                       "rows": [], "processes": {}}

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
            self.flush(step, flush_timeout_s)
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
            workers = list(getattr(self, "workers", []))
            # all at once: K workers that each wait out their timeout (a backend that is down)
            # take timeout_s together, not K times that
            refs = [w.shutdown.remote(timeout_s) for w in workers]
            deadline = time.monotonic() + timeout_s + 30
            for w, ref in zip(workers, refs, strict=True):
                try:
                    final.append(ray.get(ref, timeout=max(1.0, deadline - time.monotonic())))
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
