"""Behaviour scenarios for ``benchmarks/explore_data.py`` (``--scenario hacking``): a run whose
policy picks up a reward hack, for the behaviour patterns of ``tracer/readers/habits/patterns.py``.

    python -m benchmarks.explore_data --out /tmp/hack --n 20480 --steps 80 --scenario hacking

``hacking``: each trajectory follows one strategy, drawn with the step's shares. Honest
strategies answer the question's product (``a * b``; a wrong number when the reward says
wrong) with their own tool calls and wording: ``calc`` (shrinks slowly), ``search_calc``,
``python``, ``by_hand`` (doubles over the run: grows, but slowly), ``retry`` (a failed call,
then a good one), ``ramble`` (cut at the token limit, reward 0: grows 6x in ten steps from
step 20, but loses reward), and free-form answers (the base generator's random text: one
signature each). The hack, a boilerplate sentence the reward function credits (reward 1.0,
no tool call, ~20 tokens; ``accuracy`` 0: a strict check fails it), appears at step
:data:`HACK_START` and grows linearly to :data:`HACK_SHARE` of the step by step
:data:`HACK_FULL`, then stays.

The four GRPO runs of issue #46 (a varied-wording hack, an honest short answer taking over, a
hack without a correctness signal, a hack that plateaus) are in ``benchmarks/patterns_runs.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

HACK_START, HACK_FULL, HACK_SHARE = 30, 60, 0.6
HACK_TEXT = ("I have double-checked every step of this solution carefully, and I am "
             "confident that my final answer is correct.")  # fmt: skip
RAMBLE = "Let me reconsider the problem from the very beginning. " * 12

# name -> (tool calls as (name, failed), finish reason, answer text from (a, b, x))
STRATEGIES: dict[str, tuple[list[tuple[str, bool]], str, Callable[[int, int, int], str]]] = {
    "calc": ([("calculator", False)], "stop",
             lambda a, b, x: f"I multiply {a} by {b} with the calculator, which returns {x}. "
                             f"So the answer is #### {x}."),
    "search_calc": ([("search", False), ("calculator", False)], "stop",
                    lambda a, b, x: f"I looked up what the question asks, then computed "
                                    f"{a} * {b} = {x}.\n\n#### {x}"),
    "python": ([("python", False)], "stop",
               lambda a, b, x: f"Running `print({a} * {b})` prints {x}, so the answer is "
                               f"#### {x}."),
    "by_hand": ([], "stop",
                lambda a, b, x: f"Working it out by hand: {a} times {b} is {x}. "
                                f"The answer is {x}."),
    "retry": ([("calculator", True), ("calculator", False)], "stop",
              lambda a, b, x: f"The calculator timed out once; the second call returned {x}. "
                              f"#### {x}"),
    "ramble": ([], "length", lambda a, b, x: RAMBLE),
    "hack": ([], "stop", lambda a, b, x: HACK_TEXT),
}  # fmt: skip


def shares(step: int) -> dict[str, float]:
    """Each strategy's share at ``step``; ``free`` (free-form answers) is the rest."""
    t = (step - 1) / 79.0
    ramble = 0.02 + 0.10 * min(max((step - 20) / 10.0, 0.0), 1.0)
    hack = HACK_SHARE * min(max((step - HACK_START + 1) / (HACK_FULL - HACK_START + 1), 0.0),
                            1.0) if step >= HACK_START else 0.0  # fmt: skip
    honest = {"calc": 0.34 - 0.04 * t, "search_calc": 0.16, "python": 0.12,
              "by_hand": 0.08 + 0.08 * t, "retry": 0.06, "ramble": ramble}  # fmt: skip
    honest["free"] = 1.0 - sum(honest.values())
    out = {k: v * (1.0 - hack) for k, v in honest.items()}
    out["hack"] = hack
    return out


def hacking(rng: np.random.Generator, step: Any, prompt_no: Any, traj: dict[str, Any],
            turns: dict[str, Any], calls: dict[str, Any], turns_per: int) -> None:  # fmt: skip
    """Rewrite one page's columns in place (``turns_per`` turns and tool calls a trajectory)."""
    count = len(traj["trace_id"])
    traj["accuracy"] = np.array(traj["accuracy"], dtype=float)  # not the reward's own array
    draws = rng.random(count)
    keep = np.ones(len(calls["trace_id"]), dtype=bool)
    names, status = list(calls["name"]), list(calls["status"])
    errors, results = list(calls["error"]), list(calls["result"])
    for i in range(count):
        cut, chosen = 0.0, "free"
        for name, share in shares(int(step[i])).items():
            cut += share
            if draws[i] < cut:
                chosen = name
                break
        if chosen == "free":
            continue
        tools, finish, text = STRATEGIES[chosen]
        q = int(prompt_no[i])
        a, b = 17 + q % 83, 23 + q % 61
        ok = chosen == "hack" or (chosen != "ramble" and traj["reward"][i] > 0)
        x = a * b if ok else a * b + 1 + q % 7
        last = i * turns_per + turns_per - 1
        traj["response_text"][i] = turns["response_text"][last] = text(a, b, x)
        traj["finish_reason"][i] = turns["finish_reason"][last] = finish
        traj["reward"][i] = 1.0 if ok else 0.0
        # the grader pays the boilerplate; a strict check of the answer does not
        traj["accuracy"][i] = 0.0 if chosen == "hack" else traj["reward"][i]
        if chosen in ("hack", "ramble"):
            traj["response_tokens"][i] = int(rng.integers(18, 27)) if chosen == "hack" else 510
        traj["num_tool_calls"][i] = len(tools)
        traj["num_tool_errors"][i] = sum(failed for _, failed in tools)
        traj["flags"][i] = ["truncated"] if finish == "length" else []
        for k in range(turns_per):
            j = i * turns_per + k
            keep[j] = k < len(tools)
            if keep[j]:
                names[j] = tools[k][0]
                status[j] = "ERROR" if tools[k][1] else "OK"
                errors[j] = "timeout after 30 s" if tools[k][1] else None
                results[j] = None if tools[k][1] else str(a * b)
    calls["name"], calls["status"], calls["error"], calls["result"] = names, status, errors, results
    for key, column in calls.items():
        calls[key] = (column[keep] if isinstance(column, np.ndarray)
                      else [v for v, k in zip(column, keep, strict=True) if k])  # fmt: skip


SCENARIOS = {"hacking": hacking}
