"""A traced rollout whose time is known: stragglers and a hung tool call, planted.

Each trajectory of a step runs concurrently (asyncio): generate, a tool call (``python`` or
``search``), generate, reward. The generate calls and tools sleep for real. With probability
``slow_prob`` a ``python`` call takes ``slow_factor`` (10-30x by default) its usual time: the
step's straggler. ``hang=(step, sample_index)`` makes that trajectory's ``python`` call wait
until ``release`` is set (a ``threading.Event`` the caller holds). What was planted comes back in
:class:`Planted`, so tests (and held-out runs with other seeds) check the readers and the
watchdog against it. The caller initialises the tracer (any backend) and flushes it.

    planted = run_scenario(steps=3, samples=8, slow_prob=0.1, seed=1)
"""

from __future__ import annotations

import asyncio
import random
import threading
from dataclasses import dataclass, field
from typing import Any

from tracer import trace_attr, trace_op

GENERATE_S = 0.010
TOOL_S = {"python": 0.020, "search": 0.010}
SLOW_TOOL = "python"


@dataclass
class Planted:
    """What a scenario planted: slow calls as (step, sample_index, factor), the hung one."""

    slow: list[tuple[int, int, float]] = field(default_factory=list)
    hang: tuple[int, int] | None = None
    hang_arguments: dict[str, Any] | None = None

    def slow_steps(self) -> set[int]:
        return {s for s, _, _ in self.slow}


@trace_op(kind="generate")
async def generate(messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    await asyncio.sleep(GENERATE_S)
    return {"response_ids": list(range(max_tokens)), "finish_reason": "stop"}


@trace_op(kind="tool", name="call_tool")
async def call_tool(name: str, arguments: dict[str, Any], delay_s: float,
                    release: Any = None) -> str:  # fmt: skip
    if release is not None:  # the hung call: returns only when the caller releases it
        while not release.is_set():
            await asyncio.sleep(0.01)
    else:
        await asyncio.sleep(delay_s)
    return f"{name} ok"


@trace_op(kind="reward", name="reward")
def reward(response: str) -> float:
    return float(len(response) % 2)


async def _trajectory(step: int, index: int, tool: str, delay_s: float, release: Any) -> None:
    with trace_attr(step=step, sample_index=index, rollout_n=0, name="trajectory"):
        messages = [{"role": "user", "content": f"problem {step}.{index}"}]
        await generate(messages, 24)
        args = {"code": f"print({step} * {index})"} if tool == "python" else {"query": "x"}
        await call_tool(tool, args, delay_s, release)
        await generate(messages, 12)
        reward("answer")


async def _run(steps: int, samples: int, slow_prob: float, slow_factor: tuple[float, float],
               seed: int, hang: tuple[int, int] | None, release: Any,
               planted: Planted) -> None:  # fmt: skip
    rng = random.Random(seed)
    for step in range(1, steps + 1):
        jobs = []
        for index in range(samples):
            tool = SLOW_TOOL if index % 2 == 0 else "search"
            delay = TOOL_S[tool]
            if tool == SLOW_TOOL and rng.random() < slow_prob:
                factor = rng.uniform(*slow_factor)
                delay *= factor
                planted.slow.append((step, index, factor))
            hung = hang == (step, index)
            if hung:
                planted.hang = (step, index)
                planted.hang_arguments = {"code": f"print({step} * {index})"}
            jobs.append(_trajectory(step, index, SLOW_TOOL if hung else tool, delay,
                                    release if hung else None))  # fmt: skip
        await asyncio.gather(*jobs)


def run_scenario(
    steps: int = 3,
    samples: int = 8,
    slow_prob: float = 0.15,
    slow_factor: tuple[float, float] = (10.0, 30.0),
    seed: int = 0,
    hang: tuple[int, int] | None = None,
    release: threading.Event | None = None,
) -> Planted:
    """Run the scenario on this thread (its own event loop); returns what it planted. With
    ``hang``, it returns only after ``release`` is set."""
    if hang is not None and release is None:
        raise ValueError("hang needs a release event")
    planted = Planted()
    asyncio.run(_run(steps, samples, slow_prob, slow_factor, seed, hang, release, planted))
    return planted
