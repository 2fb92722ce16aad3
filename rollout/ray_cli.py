"""``rollout-tracer run`` with ``actor_rollout_ref.rollout.agent.num_workers > 0``: the driver
of a pool of Ray rollout workers (rollout/ray_workers.py), with a progress bar, the step metrics
of all workers in the trackers, and a summary that names any node lost on the way."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rollout.ray_workers import RayRolloutPool, combine_tracer_metrics, num_workers
from rollout.worker import StepResult, done_line


def cmd_run_ray(
    args: Any, config: dict[str, Any], trace: dict[str, Any], browse_hint: Callable[[], None]
) -> int:
    """``rollout-tracer run`` with ``agent.num_workers > 0`` (called from rollout/cli.py after
    the driver's ``tracer.init`` validated the trace config and reached the backend, and
    ``trainer.logger`` started ``args.tracking``: the driver logs every step's metrics)."""
    from tqdm import tqdm

    import tracer
    from rollout.after_step import AfterStep

    tracking = getattr(args, "tracking", None)
    # the driver plays verl's trainer: the step's health counts and, with
    # trainer.recompute_log_probs, the trainer's and reference log-probs of every trajectory
    # (its own models), attached with tracer.annotate to the traces the workers stored
    pool: RayRolloutPool | None = None

    def live_partial(step: int) -> dict[str, Any]:  # the workers' live analysis, merged
        assert pool is not None
        return pool.live_partial(step)

    after_step = AfterStep(config, None, tracking, live_partial)
    if after_step.trainer_pass is None:
        tracer.shutdown()  # the driver traces nothing: each actor runs its own tracer
    k = num_workers(config)
    uri = str(trace.get("tracking_uri") or "")
    backends = trace.get("backend")
    if k > 1 and "mlflow" in str(backends) and not uri.startswith(("http://", "https://")):
        print(f"note: {k} workers share the MLflow store {uri}; for several workers (and any "
              "multi-node cluster) point them at one tracking server: "
              "actor_rollout_ref.rollout.trace.tracking_uri=http://HOST:5000")  # fmt: skip
    steps = int(config["trainer"]["total_steps"])
    rollout = config["actor_rollout_ref"]["rollout"]
    total = steps * int(config["data"]["train_batch_size"]) * int(rollout["n"])
    t0 = time.perf_counter()
    print(f"starting {k} Ray rollout workers ({rollout['name']} engine for "
          f"{config['actor_rollout_ref']['model']['path']})")  # fmt: skip
    validations: list[StepResult] = []
    bar = tqdm(total=total, desc="trajectories", unit="traj", disable=args.no_progress)

    def on_step(result: StepResult) -> None:
        assert pool is not None
        m = result.metrics()
        bar.set_postfix(step=result.step, score=f"{m['score']:.2f}", turns=f"{m['turns']:.1f}")
        durable = all(pool.flushed.get(result.step, [False]))
        extra = after_step(result)
        if tracking is not None:  # console line and trackers (trainer.logger), all workers
            tracking.log_step(result, {**combine_tracer_metrics(pool.metrics()), **extra})
        if not durable:
            tqdm.write(f"step {result.step}: traces not yet durable on every worker (spooled)")

    def on_validate(result: StepResult) -> None:
        assert pool is not None
        validations.append(result)
        if tracking is not None:  # val/ metrics and the val/generations table
            tracking.log_validation(result, combine_tracer_metrics(pool.metrics()))

    final: list[dict[str, Any]] = []
    results: list[StepResult] = []
    failed = True
    try:
        pool = RayRolloutPool(config, trace, k)
        print("workers: " + ", ".join(f"{p['worker_id']} on node {p['node_ip']}"
                                      for p in pool.placement))  # fmt: skip
        results = pool.run(steps, on_done=lambda _: bar.update(1), on_step=on_step,
                           on_validate=on_validate)  # fmt: skip
        failed = False
    finally:
        bar.close()
        if pool is not None:
            final = pool.shutdown()
        annotations: dict[str, Any] = {}
        if after_step.trainer_pass is not None:  # the driver's annotations, stored or counted
            tracer.flush(timeout_s=60)
            annotations = {k: v for k, v in tracer.metrics().items() if "/annotat" in k}
            tracer.shutdown()
        if tracking is not None:
            tracking.finish(failed=failed)
    stats = combine_tracer_metrics(final)
    print(f"{done_line(results, validations)} in {time.perf_counter() - t0:.1f} s on {k} "
          f"workers; tracer (workers left at the end): {stats}")  # fmt: skip
    for m in final:
        exported = {n: v for n, v in m.items() if n.endswith("/exported")}
        print(f"  {m.get('worker_id', '?')}: {exported}")
    if annotations:
        print(f"  driver (trainer pass): {annotations}")
    if pool is not None and pool.lost:
        print(f"lost with their nodes ({len(pool.lost)} shares; their traces in the store are "
              "tagged with that ray_node_id, re-runs with attempt > 0):")
        for loss in pool.lost:
            print(f"  {loss.describe()}")
    browse_hint()
    return 0
