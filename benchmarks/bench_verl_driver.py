"""What the live numbers cost verl's driver (tracer/live_gather.py, tracer/verl_metrics.py).

- ``log_added_us``: what ``Tracking.log(data, step)`` takes more on the trainer's thread under
  the switch than verl's own (both with no backend, so only the call itself is timed; a
  verl-like ``data`` of 150 metrics): the book's lookup and the dict merge. Each step's log is
  timed 200 times; median and p99 over all.
- ``collector_ms_per_refresh``: the driver's background thread, CPU per step's refresh (merge
  the pieces of every worker, recompute the step's numbers over the steps the rules look back
  at); it refreshes at most every 0.5 s while pieces arrive.
- ``publisher_us``: a worker's send, CPU: with a step's rows new, and with nothing new (what
  it does every 0.5 s between rollouts).

The partials are the real tracer's: ``--per-step`` trajectories a step (generate, tool, reward)
traced through the verl API in this process, copied for ``--workers`` workers (trace ids and
process names made distinct).

    PYTHONPATH=. .venv-verl/bin/python -m benchmarks.bench_verl_driver [--quick] [--record]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from tracer import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op
from tracer.live_gather import Publisher, StepBook
from tracer.verl_metrics import tracking_class


class Loop:
    @rollout_trace_op
    async def generate(self, prompt: str) -> str:
        return f"Let me compute {prompt}. The answer is 4."

    @rollout_trace_op
    async def execute(self, expression: str) -> str:
        return "4"

    @rollout_trace_op
    async def compute_score(self, answer: str, i: int) -> dict[str, Any]:
        return {"score": 1.0, "acc": i % 3 != 0}


async def _rollouts(step: int, n: int) -> None:
    loop = Loop()
    for i in range(n):
        with rollout_trace_attr(sample_index=i // 8, step=step, rollout_n=i % 8, name="agent_loop"):
            await loop.execute("2 + 2")
            await loop.compute_score(await loop.generate(f"2 + {i}"), i)


Parts = dict[int, list[dict[str, Any]]]  # step -> one partial per worker


def partials(steps: int, per_step: int, workers: int) -> tuple[Parts, Publisher]:
    """Per step, one partial per worker; and the publisher of worker 0 (its tracer live)."""
    import tracer

    RolloutTraceConfig.init("bench-verl-driver", "e1", "memory", False, None, worker_id="w0")
    for step in range(1, steps + 1):
        asyncio.run(_rollouts(step, per_step))
    tracer.flush()
    one = {s: tracer.live.partial(s, history=False) for s in range(1, steps + 1)}
    out: dict[int, list[dict[str, Any]]] = {}
    for step, part in one.items():
        out[step] = []
        for w in range(workers):
            rows = [{**r, "trace_id": f"{w}-{r['trace_id']}"} for r in part["rows"]]
            procs = {f"host:{w}": e for e in part["processes"].values()}
            out[step].append({**part, "rows": rows, "processes": procs})
    return out, Publisher("w0")


class _NoBackend:
    """verl's ``Tracking.log`` with no backend configured: a loop over nothing."""

    logger: dict[str, Any] = {}

    def log(self, data: Any, step: Any, backend: Any = None) -> None:
        for name, logger in self.logger.items():
            if backend is None or name in backend:
                logger.log(data=data, step=step)

    def finish(self, exit_code: int = 0) -> None:
        pass


def run(quick: bool, workers: int, per_step: int) -> dict[str, Any]:
    steps = 6 if quick else 24
    parts, publisher = partials(steps, per_step, workers)
    try:
        base: Any
        try:  # verl's own class when this is verl's venv, with no backend
            from verl.utils.tracking import Tracking as VerlTracking

            base = VerlTracking("bench", "e1", default_backend=[])
            ours = tracking_class(VerlTracking)("bench", "e1", default_backend=[])
            verl_version = __import__("verl").__version__
        except ImportError:
            base, ours, verl_version = _NoBackend(), tracking_class(_NoBackend)(), None
        book = StepBook()
        ours._rollout_tracer_book = book  # fed here instead of by the collector's Ray calls
        data = {f"actor/metric_{i}": float(i) for i in range(150)}
        added, base_ns, refresh_cpu = [], [], []
        for step in range(1, steps + 1):
            t0 = time.thread_time()
            book.receive([(step, f"host:{w}", p) for w, p in enumerate(parts[step])])
            book.refresh()
            refresh_cpu.append(time.thread_time() - t0)
            for _ in range(200):
                t1 = time.perf_counter_ns()
                base.log(data=data, step=step)
                t2 = time.perf_counter_ns()
                ours.log(data=data, step=step)
                t3 = time.perf_counter_ns()
                base_ns.append(t2 - t1)
                added.append((t3 - t2) - (t2 - t1))
        # a worker's sends: a whole step new, then nothing new (every 0.5 s between rollouts)
        publisher.note_step(steps)
        t0 = time.thread_time()
        pieces = publisher._pieces(steps)
        send_new = time.thread_time() - t0
        publisher._sent(pieces, steps)
        t0 = time.thread_time()
        for _ in range(100):
            publisher._pieces(steps)
        send_idle = (time.thread_time() - t0) / 100
    finally:
        RolloutTraceConfig.reset()
    added.sort()
    with open("/proc/loadavg") as f:
        load = float(f.read().split()[0])
    return {
        "verl": verl_version, "workers": workers, "trajectories_per_step_per_worker": per_step,
        "steps": steps, "load_average": load,
        "log_added_us": {"median": round(statistics.median(added) / 1e3, 1),
                         "p99": round(added[int(0.99 * len(added))] / 1e3, 1)},
        "verl_log_no_backend_us": round(statistics.median(base_ns) / 1e3, 1),
        "logged_keys_added": len(book.for_log(steps)),
        "collector_ms_per_refresh": {"median": round(1e3 * statistics.median(refresh_cpu), 1),
                                     "max": round(1e3 * max(refresh_cpu), 1)},
        "publisher_us": {"step_new": round(1e6 * send_new), "nothing_new": round(1e6 * send_idle)},
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--per-step", type=int, default=64)
    p.add_argument("--record", action="store_true", help="write the figures to figures.json")
    a = p.parse_args()
    result = run(a.quick, a.workers, a.per_step)
    print(json.dumps(result, indent=1))
    if a.record:
        from benchmarks.figures import record

        command = "PYTHONPATH=. .venv-verl/bin/python -m benchmarks.bench_verl_driver --record"
        shape = f"{a.workers} workers x {a.per_step} trajectories a step"
        record("verl-driver-log-added",
               f"{result['log_added_us']['median']} µs a step (p99 "
               f"{result['log_added_us']['p99']} µs)",
               figure=f"time verl's driver thread spends more in Tracking.log under the switch "
                      f"({shape}; verl {result['verl']})", command=command)  # fmt: skip
        record("verl-driver-collector",
               f"{result['collector_ms_per_refresh']['median']} ms CPU a refresh",
               figure=f"the driver's background thread: merge and recompute one step's live "
                      f"numbers ({shape}, 16 steps looked back at)", command=command)  # fmt: skip


if __name__ == "__main__":
    main()
