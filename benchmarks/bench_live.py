"""What the live analysis (tracer/live/) and the watchdog's watch over unsampled rollouts cost.

1. **The watchdog on unsampled rollouts** (``unsampled``): ``trace_attr`` enter + exit of a
   rollout the sampler leaves out (N=1, its sample's hash loses), with the watchdog on
   (``stuck_after_s=600``: it registers the rollout) and off (``stuck_after_s=0``), rounds
   interleaved in one process, the background held off while timed (benchmarks/hotpath.py's
   ``HOLD``); and the registration alone (what ``trace_attr`` adds: a clock read, two slot
   writes, a dict insert and pop), timed in a loop.
2. **The live analysis on a verl-like rollout** (``rollout``): the project's rollout
   (``RolloutWorker`` -> ``ToolAgentLoop`` -> the scripted engine with a GPU-like latency per
   token, GRPO groups of 4, a calculator call then an answer: benchmarks/throughput.py's fast
   engine), traced at 100 % to JSONL, with the live analysis on (``live_steps=16``, and
   ``tracer.step_metrics`` read after every step, as a driver does) and off (``live_steps=0``),
   interleaved. Per mode: whole-process CPU (all threads, until the traces are durable) and
   wall time per trajectory; and the analysis's own CPU, timed inside it (the processing
   thread's time in ``LiveSteps.observe``, the driver's in ``step_metrics``).

    python -m benchmarks.bench_live [--reps 5] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

from benchmarks.common import per_call_us, quiet_env


def unsampled(n: int, rounds: int) -> dict[str, Any]:
    import tracer
    from benchmarks.hotpath import HOLD, losing_pair
    from tracer.core import _NOT_WATCHED
    from tracer.watchdog import OpenTrajectories

    per: dict[str, list[float]] = {"off": [], "on": []}
    win, lose = losing_pair(0, 7)

    def losing(k: int) -> None:
        for _ in range(k):
            with tracer.trace_attr(step=7, sample_index=lose):
                pass

    for _ in range(rounds):  # interleaved: drift on a shared machine hits both alike
        for mode, stuck in (("off", 0.0), ("on", 600.0)):
            tracer.init({"backend": "bench-null", "max_samples_per_step_per_worker": 1,
                         "stuck_after_s": stuck, **HOLD})  # fmt: skip
            with tracer.trace_attr(step=7, sample_index=win):
                pass  # the winner takes the step's only slot
            per[mode] += per_call_us(losing, n, 1, tracer.flush)
    tracer.reset()

    def registration(watched: Any) -> Any:
        attr = tracer.trace_attr(step=7, sample_index=lose)

        def loop(k: int) -> None:
            for _ in range(k):  # what trace_attr's enter and exit add for the watchdog
                attr._start_ns = time.time_ns()
                attr._watched = w = watched
                w.watch(attr)
                w = attr._watched
                attr._watched = None
                w.unwatch(attr)

        return loop

    alone = {m: per_call_us(registration(w), n, rounds)
             for m, w in (("on", OpenTrajectories()), ("off", _NOT_WATCHED))}  # fmt: skip
    med = {m: statistics.median(v) for m, v in per.items()}
    return {
        "n": n, "rounds": rounds,
        "trace_attr_unsampled_us": {m: round(v, 3) for m, v in med.items()},
        "watchdog_on_minus_off_us": round(med["on"] - med["off"], 3),
        "registration_alone_us": {m: round(statistics.median(v), 3) for m, v in alone.items()},
    }  # fmt: skip


def rollout(reps: int, steps: int) -> dict[str, Any]:
    import tracer
    from benchmarks.throughput import _config, _engine
    from rollout.worker import RolloutWorker, iterate_batches, load_dataset
    from tracer.live.steps import LiveSteps

    config = _config("latency", quick=False)
    rows = load_dataset(config["data"]["train_files"])
    it = iterate_batches(rows, int(config["data"]["train_batch_size"]), shuffle=False)
    batches = [next(it) for _ in range(steps)]
    engine = _engine("latency", config)
    worker = RolloutWorker(config, engine)
    spent = {"observe": 0.0, "read": 0.0}
    real_observe = LiveSteps.observe

    def timed_observe(self: LiveSteps, record: Any) -> None:
        t = time.thread_time()
        real_observe(self, record)
        spent["observe"] += time.thread_time() - t

    LiveSteps.observe = timed_observe  # type: ignore[method-assign]
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    wall: dict[str, list[float]] = {"off": [], "on": []}
    done = {"trajectories": 0}

    async def main() -> None:
        tmp = tempfile.mkdtemp(prefix="bench-live-")
        await worker.run_step(10_000, batches[0])  # warm-up: engine, tokenizer, tools
        for rep in range(reps):
            for mode, live_steps in (("off", 0), ("on", 16)):
                tracer.init(backend="jsonl", jsonl_path=f"{tmp}/{mode}-{rep}.jsonl",
                            spool_dir=f"{tmp}/spool", live_steps=live_steps,
                            max_samples_per_step_per_worker=None)  # fmt: skip
                n = 0
                c0, w0 = time.process_time(), time.perf_counter()
                for i, batch in enumerate(batches):
                    result = await worker.run_step(100 * rep + i + 1, batch)
                    n += len(result.outputs)
                    if live_steps:
                        t = time.thread_time()
                        tracer.step_metrics(100 * rep + i + 1)
                        spent["read"] += time.thread_time() - t
                assert tracer.flush(300)
                cpu[mode].append((time.process_time() - c0) / n * 1e6)
                wall[mode].append((time.perf_counter() - w0) / n * 1e3)
                done["trajectories"] = n
                tracer.reset()
        await engine.close()

    try:
        asyncio.run(main())
    finally:
        LiveSteps.observe = real_observe  # type: ignore[method-assign]
    n_on = reps * done["trajectories"]
    med = {m: statistics.median(v) for m, v in cpu.items()}
    live_us = (spent["observe"] + spent["read"]) / n_on * 1e6
    return {
        "reps": reps, "steps": steps, "trajectories_per_rep": done["trajectories"],
        "process_cpu_us_per_trajectory": {m: [round(x, 1) for x in v] for m, v in cpu.items()},
        "wall_ms_per_trajectory": {m: [round(x, 2) for x in v] for m, v in wall.items()},
        "median_cpu_us": {m: round(v, 1) for m, v in med.items()},
        "cpu_on_over_off_pct": round(100 * (med["on"] / med["off"] - 1), 2),
        "live_cpu_us_per_trajectory": round(live_us, 1),
        "live_observe_us_per_trajectory": round(spent["observe"] / n_on * 1e6, 1),
        "live_read_ms_per_step": round(spent["read"] / (reps * steps) * 1e3, 2),
        "live_share_of_process_cpu_pct": round(100 * live_us / med["on"], 2),
        "throughput_on_over_off": round(statistics.median(wall["off"])
                                        / statistics.median(wall["on"]), 4),
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--n", type=int, default=20000, help="trace_attr calls a round")
    p.add_argument("--json", help="write the results here too")
    p.add_argument("--record", action="store_true", help="store the figures (figures.json)")
    a = p.parse_args()
    quiet_env()
    with open("/proc/loadavg") as f:
        load = float(f.read().split()[0])
    out = {"load_average": load, "unsampled": unsampled(a.n, 2 * a.reps + 1),
           "rollout": rollout(a.reps, a.steps)}  # fmt: skip
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text)
    if a.record:
        from benchmarks.figures import record

        u, r = out["unsampled"], out["rollout"]
        cmd = f"python -m benchmarks.bench_live --reps {a.reps} --record"
        record("watchdog-unsampled",
               f"+{u['watchdog_on_minus_off_us']:.2f} µs a rollout (unsampled `trace_attr` "
               f"enter + exit {u['trace_attr_unsampled_us']['off']:.2f} -> "
               f"{u['trace_attr_unsampled_us']['on']:.2f} µs); the registration alone "
               f"{u['registration_alone_us']['on']:.2f} µs (goal < 0.5 µs)",
               figure="the watchdog's watch over a rollout the sampler leaves out", command=cmd)
        record("live-analysis-cost",
               f"{r['live_cpu_us_per_trajectory']:.0f} µs of CPU a trajectory "
               f"({r['live_share_of_process_cpu_pct']:.2f} % of the traced rollout's whole-"
               f"process CPU; goal < 2 %); whole-process CPU on vs off "
               f"{r['median_cpu_us']['on']:.0f} vs {r['median_cpu_us']['off']:.0f} µs "
               f"({r['cpu_on_over_off_pct']:+.1f} %); throughput on/off "
               f"{r['throughput_on_over_off']:.3f}; step_metrics "
               f"{r['live_read_ms_per_step']:.1f} ms a step of "
               f"{r['trajectories_per_rep'] // r['steps']} trajectories",
               figure="the live analysis on a verl-like rollout (fast engine, 100 % sampling, "
                      "JSONL)", command=cmd)  # fmt: skip


if __name__ == "__main__":
    main()
