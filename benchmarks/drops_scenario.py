"""A traced GRPO rollout whose drops are known: a timeout that cuts the longest rollouts.

Each step has ``samples`` prompts of ``group`` rollouts, run concurrently (asyncio). A rollout
writes a number of turns drawn from ``turns`` (``TOKENS_PER_TURN`` tokens each; a generate call
returns at once). A rollout with more than ``limit`` turns behaves like one whose engine stalls
on its next turn: that generate call waits until the rollout's timeout (``asyncio.wait_for``
around the agent loop, ``timeout_s``) cuts it, so the rollouts that write most are the ones
dropped, after ``limit`` turns, as a 600 s timeout does in a real run. ``outside=True`` puts the
timeout outside ``trace_attr`` (around the whole rollout function): asyncio then cancels the
trajectory's task and raises ``TimeoutError`` only to the caller, so the tracer sees a cancel.
What happened comes back in :class:`Planted`: which rollouts the timeout cut (on a machine too
busy to finish even a short rollout within ``timeout_s``, more than the planted ones) and the
tokens each wrote; the caller initialises the tracer and flushes.

    planted = run_drops(steps=2, samples=4, group=4, limit=4, seed=1)
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

from tracer import trace_attr, trace_op

TOKENS_PER_TURN = 100


@dataclass
class Planted:
    """``kept`` / ``dropped``: (step, sample_index, rollout_n) -> tokens written (so far), as
    the rollouts saw it; ``planted``: the keys planted to stall (turns over ``limit``)."""

    kept: dict[tuple[int, int, int], int] = field(default_factory=dict)
    dropped: dict[tuple[int, int, int], int] = field(default_factory=dict)
    planted: set[tuple[int, int, int]] = field(default_factory=set)
    timeouts_seen: int = 0  # TimeoutErrors that reached the caller (the rollout's behaviour)


@trace_op(kind="generate")
async def generate(messages: list[dict[str, Any]], stall_s: float = 0.0) -> dict[str, Any]:
    if stall_s:
        await asyncio.sleep(stall_s)  # the engine stalls: only the timeout ends this call
    else:
        await asyncio.sleep(0)
    return {"response_ids": list(range(TOKENS_PER_TURN)), "finish_reason": "stop"}


@trace_op(kind="reward")
def reward(turns: int) -> float:
    return float(turns % 2)


async def _agent_loop(step: int, index: int, n: int, turns: int, limit: int,
                      stall_s: float, done: list[int]) -> None:  # fmt: skip
    messages = [{"role": "user", "content": f"problem {step}.{index}"}]
    for turn in range(turns):
        await generate(messages, stall_s if turn >= limit else 0.0)
        done[0] += 1  # turns returned so far
        messages.append({"role": "assistant", "content": f"turn {turn}"})
    reward(turns)


async def _rollout(step: int, index: int, n: int, turns: int, limit: int, timeout_s: float,
                   outside: bool, done: list[int]) -> None:  # fmt: skip
    stall = 60 * timeout_s
    async with trace_attr(step=step, sample_index=index, rollout_n=n):
        loop = _agent_loop(step, index, n, turns, limit, stall, done)
        await (loop if outside else asyncio.wait_for(loop, timeout_s))


async def _run(steps: int, samples: int, group: int, turns: tuple[int, int], limit: int,
               timeout_s: float, outside: bool, seed: int, planted: Planted) -> None:  # fmt: skip
    rng = random.Random(seed)
    for step in range(1, steps + 1):
        jobs, keys, done = [], [], []
        for index in range(samples):
            for n in range(group):
                k = rng.randint(*turns)
                key = (step, index, n)
                if k > limit:
                    planted.planted.add(key)
                done.append([0])
                job = _rollout(step, index, n, k, limit, timeout_s, outside, done[-1])
                jobs.append(asyncio.wait_for(job, timeout_s) if outside else job)
                keys.append(key)
        results = await asyncio.gather(*jobs, return_exceptions=True)
        for key, result, turns_done in zip(keys, results, done, strict=True):
            if isinstance(result, TimeoutError):
                planted.timeouts_seen += 1
                planted.dropped[key] = turns_done[0] * TOKENS_PER_TURN
            elif isinstance(result, BaseException):
                raise result
            else:
                planted.kept[key] = turns_done[0] * TOKENS_PER_TURN


def run_drops(steps: int = 2, samples: int = 4, group: int = 4, turns: tuple[int, int] = (1, 8),
              limit: int = 5, timeout_s: float = 2.0, outside: bool = False,
              seed: int = 0) -> Planted:  # fmt: skip
    """Run the scenario on this thread (its own event loop); returns what it planted."""
    planted = Planted()
    asyncio.run(_run(steps, samples, group, turns, limit, timeout_s, outside, seed, planted))
    return planted
