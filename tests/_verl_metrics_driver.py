"""tests/test_verl_metrics.py's driver, a process of its own with ``ROLLOUT_TRACER_VERL=1`` (so
that the switch's ``.pth`` line ran at its start, as in a verl job): a local Ray cluster, verl's
``Tracking`` with console, MLflow and W&B (offline), and two rollout workers (Ray actors, each
a process) that trace through the switched ``verl.utils.rollout_trace`` the way verl's
``AgentLoopWorker._run_agent_loop`` does. The driver logs each step as verl's trainer does
(``logger.log(data=metrics, step=self.global_steps)``); between a step's rollouts and its log
call a trainer computes log-probs, advantages and an update, which this driver stands in for by
waiting until the step's numbers are in (except where a test wants them late). Prints
``RESULT {json}``.

    ROLLOUT_TRACER_VERL=1 python -m tests._verl_metrics_driver TMPDIR
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import ray
from verl.utils.rollout_trace import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op

PROJECT, EXPERIMENT = "verl-live-metrics", "grpo-cpu"
PER_STEP = 4  # trajectories a step per worker


class Loop:
    @rollout_trace_op
    async def generate(self, prompt: str) -> str:
        await asyncio.sleep(0.01)
        return f"{prompt} = 4"

    @rollout_trace_op
    async def execute(self, expression: str) -> str:  # a tool call that never returns
        await asyncio.sleep(3600)
        return "4"

    @rollout_trace_op
    async def compute_score(self, answer: str, hacked: bool) -> dict[str, Any]:
        return {"score": 1.0, "acc": not hacked}  # acc as a bool: verl's DAPO scorer's


@ray.remote(num_cpus=0)
class Rollouts:
    """A rollout worker: verl's trace calls, in verl's order."""

    def __init__(self) -> None:
        RolloutTraceConfig.init(PROJECT, EXPERIMENT, "jsonl", False, None)
        self.hung: list[asyncio.Task[None]] = []

    async def hang(self, step: int) -> None:
        """One more rollout of ``step`` whose tool call hangs (left running)."""

        async def rollout() -> None:
            with rollout_trace_attr(step=step, sample_index=99, rollout_n=0, name="agent_loop"):
                await Loop().execute("2 + 2")

        self.hung.append(asyncio.create_task(rollout()))

    async def step(self, step: int, validate: bool = False) -> None:
        loop = Loop()

        async def one(i: int) -> None:
            with rollout_trace_attr(step=step, sample_index=i, rollout_n=0, validate=validate,
                                    name="agent_loop"):  # fmt: skip
                await loop.compute_score(await loop.generate(f"2 + 2 ({i})"), i == 0)

        await asyncio.gather(*(one(i) for i in range(PER_STEP)))

    def partials(self, steps: list[int]) -> dict[int, dict[str, Any]]:
        import tracer

        return {s: tracer.live.partial(s, history=False) for s in steps}


def main(tmp: str) -> None:
    import tracer
    from tracer.live_gather import NAMESPACE, actor_name

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    from verl.utils.tracking import Tracking  # the switched module: verl's, Tracking extended

    logger = Tracking(project_name=PROJECT, experiment_name=EXPERIMENT,
                      default_backend=["console", "mlflow", "wandb"],
                      config={"trainer": {"project_name": PROJECT}})  # fmt: skip
    book = logger._rollout_tracer_book
    workers = [Rollouts.options(runtime_env={"env_vars": {
        "ROLLOUT_TRACER_JSONL_PATH": f"{tmp}/traces-{i}.jsonl",
        "ROLLOUT_TRACER_STUCK_AFTER_S": "1"}}).remote() for i in range(2)]  # fmt: skip
    log_s: list[float] = []

    def rollouts(step: int, ws: list[Any], validate: bool = False) -> None:
        ray.get([w.step.remote(step, validate) for w in ws], timeout=300)

    def arrived(step: int, n: int) -> None:  # the trainer's own work between rollouts and log
        deadline = time.monotonic() + 180
        while book.numbers.get(step, ({}, 0))[1] < n:
            assert time.monotonic() < deadline, f"step {step}: {book.numbers.get(step)}"
            time.sleep(0.05)

    def log(step: int) -> None:
        t0 = time.perf_counter()
        logger.log(data={"critic/score/mean": 0.1 * step}, step=step)
        log_s.append(time.perf_counter() - t0)

    for step in (1, 2, 3):
        rollouts(step, workers)
        if step == 2:  # verl's _validate at a test_freq step: not in the numbers
            rollouts(step, workers, validate=True)
        arrived(step, 2 * PER_STEP)
        log(step)
    rollouts(4, workers)
    log(4)  # at once: the workers' numbers of step 4 reach the driver after it was logged
    rollouts(5, workers)
    ray.get(workers[0].hang.remote(5))  # reported stuck after 1 s (its stuck_after_s)
    arrived(5, 2 * PER_STEP)
    log(5)
    # what the tracker must show for steps 1-5: every worker's own partials, merged here
    parts = [p for w in workers for p in ray.get(w.partials.remote([1, 2, 3, 4, 5])).values()]
    expected = {s: tracer.live.metrics(tracer.live.merge([p for p in parts if p["step"] <= s]))
                for s in range(1, 6)}  # fmt: skip

    ray.kill(workers[1])  # a worker gone
    rollouts(6, workers[:1])
    arrived(6, PER_STEP)
    log(6)
    ray.kill(ray.get_actor(actor_name(ray.get_runtime_context().get_job_id()),
                           namespace=NAMESPACE))  # the gatherer gone  # fmt: skip
    rollouts(7, workers[:1])
    log(7)  # the trainer goes on
    rollouts(8, workers[:1])
    arrived(8, PER_STEP)  # the driver starts the gatherer again, the worker finds it
    log(8)
    logger.finish()
    print("RESULT " + json.dumps({"expected": expected, "log_s": log_s,
                                  "tracking": type(logger).__mro__[1].__module__}))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
