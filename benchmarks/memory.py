"""Section 4: peak memory with a stalled backend.

A backend registered with ``tracer.backends.register_backend`` blocks forever in ``export``
(a collector that hangs). The rollout keeps producing trajectories of 5 spans carrying
~13 KB of payload each (token ids, messages). With ``max_buffer_trajectories`` /
``max_buffer_bytes`` the tracer must hold a bounded amount in memory; what does not fit goes to
the spool (overflowing on the rollout's thread when the hot buffer is full), and only what the
spool cannot take either is dropped and counted (``tracer.metrics()``). Peak RSS is read from
the kernel.
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import tracer
from benchmarks.common import current_rss_mib, peak_rss_mib, section_main
from tracer.backends import register_backend
from tracer.backends.base import ExportResult

_release = threading.Event()


class StalledExporter:
    name = "stalled"

    def __init__(self, config: Any = None) -> None:
        self.calls = 0

    def export(self, batch: Any) -> ExportResult:
        self.calls += 1
        _release.wait()  # hangs until the benchmark is over
        return ExportResult.SUCCESS

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        return None


register_backend("stalled", StalledExporter)


@tracer.trace_op(kind="generate")
def generate(prompt_ids: list[int], messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"response_ids": list(prompt_ids[:500]), "finish_reason": "stop"}


@tracer.trace_op(kind="parse")
def parse(text: str) -> dict[str, Any]:
    return {"content": text, "tool_calls": []}


@tracer.trace_op(kind="tool")
def call_tool(name: str, arguments: dict[str, Any]) -> str:
    return "84" * 100


@tracer.trace_op(kind="reward")
def reward(answer: str) -> dict[str, float]:
    return {"score": 1.0}


def run(quick: bool) -> dict[str, Any]:
    import shutil
    import tempfile
    from pathlib import Path

    n = 3000 if quick else 20000
    spool_dir = tempfile.mkdtemp(prefix="bench-spool-")
    max_traj, max_bytes = 500, 16 * 1024 * 1024
    prompt = list(range(1000))
    messages = [{"role": "user", "content": "x" * 800} for _ in range(4)]
    nbytes = _approx_traj_bytes(prompt, messages)
    base_rss = current_rss_mib()
    tracer.init(
        {
            "backend": "stalled",
            "max_buffer_trajectories": max_traj,
            "max_buffer_bytes": max_bytes,
            "flush_interval_s": 0.1,
            "spool_dir": spool_dir,
        }
    )
    samples = []
    traj_us: list[float] = []
    t0 = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        with tracer.trace_attr(step=i // 64, sample_index=i % 64):
            generate(prompt, messages)
            parse("the answer is 84")
            call_tool("calculator", {"expression": "12 * 7"})
            reward("84")
        traj_us.append((time.perf_counter() - t) * 1e6)
        if i % 500 == 0:
            samples.append(round(current_rss_mib() - base_rss, 1))
    produce_s = time.perf_counter() - t0
    time.sleep(0.5)  # let the processor move what it can towards the stalled backend
    m = tracer.metrics()
    peak = peak_rss_mib()
    spooled = sum(
        len(p.read_bytes().splitlines()) for p in Path(spool_dir).glob("stalled-*/*.jsonl")
    )
    _release.set()
    tracer.shutdown(timeout_s=5)
    shutil.rmtree(spool_dir, ignore_errors=True)
    dropped = int(m.get("tracer/stalled/dropped", 0))  # by every reason, buffer full included
    return {
        "trajectories": n,
        "max_buffer_trajectories": max_traj,
        "max_buffer_bytes": max_bytes,
        "tracer_estimate_bytes_per_trajectory": nbytes,
        "unbounded_estimate_mib": round(n * nbytes / 2**20, 1),
        "baseline_rss_mib": round(base_rss, 1),
        "peak_rss_mib": round(peak, 1),
        "peak_growth_mib": round(peak - base_rss, 1),
        "rss_growth_every_500_mib": samples,
        "produce_s": round(produce_s, 3),
        "trajectory_us_p50_p99_max": [
            round(statistics.median(traj_us), 1),
            round(sorted(traj_us)[int(len(traj_us) * 0.99)], 1),
            round(max(traj_us), 1),
        ],
        "dropped": dropped,
        "held": n - dropped,
        "spooled": spooled,
        "overflowed": int(m.get("tracer/overflowed_to_spool", 0)),
        "metrics": m,
    }


def _approx_traj_bytes(prompt: list[int], messages: list[dict[str, str]]) -> int:
    """The tracer's own size estimate (``Trajectory.nbytes``) of one such trajectory."""
    tracer.init({"backend": "memory"})
    with tracer.trace_attr(step=-1, sample_index=0) as traj:
        generate(prompt, messages)
        parse("the answer is 84")
        call_tool("calculator", {"expression": "12 * 7"})
        reward("84")
        nbytes = traj.nbytes if traj is not None else 0
    tracer.reset()
    return int(nbytes)


if __name__ == "__main__":
    section_main(run)
