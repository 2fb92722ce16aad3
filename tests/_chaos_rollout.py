"""One rollout process of the chaos test (tests/test_chaos.py), run as a user would run a job:
``python -m tests._chaos_rollout LEDGER URI SPOOL WORKER RATE SLOW BUSY BUSY_KIND``, in a
session of its own, so a terminal's Ctrl-C is SIGINT to its whole process group.

It traces multi-turn trajectories at about RATE a second into MLflow while a busy Python thread
holds the GIL, and appends ``<step> <sample_index> <unix time>`` to LEDGER when each one has
finished (the moment the tracer owns it). On SIGINT it leaves its loop as a rollout would
(KeyboardInterrupt), shuts the tracer down gracefully, and writes its final metrics next to the
ledger (``LEDGER.metrics.json``). While the file SLOW exists, its spool disk is slow
(``slow_disk``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tracer


def spin(busy: float, kind: str = "spin") -> None:
    """A busy thread (the rollout's own work): it holds the GIL in 20 ms bursts, a ``busy``
    share of the time (the suite 0.25; ``python -m benchmarks.chaos``'s soak 0.5). ``kind``:
    ``spin``, Python code that runs (the soak's: it spends the CPU too, and lets the GIL go at
    the interpreter's switch interval, as Python work does); ``hold``, a C call that keeps the
    GIL for the whole burst and spends no CPU, as a tokenizer or an array operation that does
    not release it would (the suite's: spinning, the chaos test took 83-87 CPU-seconds of the
    2-core suite, holding 54-64, 2026-12-07)."""
    pause = 0.02 * (1 - busy) / busy
    if kind == "hold":
        import ctypes

        usleep = ctypes.PyDLL(None).usleep  # PyDLL: the GIL is kept during the call
        usleep.argtypes = [ctypes.c_uint]
        while True:
            usleep(20_000)
            time.sleep(pause)
    while True:
        until = time.monotonic() + 0.02
        while time.monotonic() < until:
            pass
        time.sleep(pause)


def slow_disk(flag: Path) -> None:
    """A slow spool disk, switched on by the test: while ``flag`` exists, every create, rename
    and removal of a spool file (tracer/spool.py's own file-system helpers, through which all
    of them go) takes 50-200 ms more, as on a loaded network disk. The races of issue 56 (a
    late call ending between two renames, a mark written after the call returned) open wide
    when these calls are slow."""
    import tracer.spool as spool

    rng = random.Random()  # a private generator: never the rollout's

    def slowed(call: Callable[..., Any]) -> Callable[..., Any]:
        def slow_call(*args: Any, **kwargs: Any) -> Any:
            if flag.exists():
                time.sleep(rng.uniform(0.05, 0.2))
            return call(*args, **kwargs)

        return slow_call

    for name in ("_write_new", "_rename", "_unlink"):
        setattr(spool, name, slowed(getattr(spool, name)))


@tracer.trace_op(kind="generate")
def generate(messages: list[dict[str, str]]) -> str:
    return "call calculator(2 + 3)" if len(messages) < 3 else "The answer is 5."


@tracer.trace_op(kind="tool")
def calculator(expression: str) -> str:
    return "5"


@tracer.trace_op(kind="reward")
def reward(answer: str) -> float:
    return 1.0 if "5" in answer else 0.0


def rollout(worker: int, i: int) -> None:
    with tracer.trace_attr(step=worker, sample_index=i, name="chaos"):
        messages = [{"role": "user", "content": f"question {i} from worker {worker}: 2 + 3?"}]
        messages.append({"role": "assistant", "content": generate(messages)})
        messages.append({"role": "tool", "content": calculator("2 + 3")})
        answer = generate(messages)
        reward(answer)


def main() -> None:
    ledger_path, uri, spool, worker, rate, slow, busy, busy_kind = sys.argv[1:9]
    slow_disk(Path(slow))
    tracer.init(
        backend="mlflow", tracking_uri=uri, project_name="chaos", spool_dir=spool,
        flush_interval_s=0.2, export_batch_size=20, replay_interval_s=0.5,
        export_max_retries=1, export_timeout_s=5.0, shutdown_timeout_s=60.0,
    )  # fmt: skip
    threading.Thread(target=spin, args=(float(busy), busy_kind), daemon=True).start()
    period = 1.0 / float(rate)
    ledger = os.open(ledger_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    i = 0
    next_at = time.monotonic()
    try:
        while True:
            rollout(int(worker), i)
            os.write(ledger, f"{worker} {i} {time.time():.3f}\n".encode())
            i += 1
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic()))
    except KeyboardInterrupt:  # Ctrl-C: the job ends, the tracer shuts down gracefully
        pass
    pipeline = tracer.get_tracer().pipeline
    graceful = tracer.shutdown()
    metrics = pipeline.metrics() if pipeline is not None else {}
    with open(ledger_path + ".metrics.json", "w") as f:
        json.dump({"graceful": graceful, "metrics": metrics}, f)


if __name__ == "__main__":
    main()
