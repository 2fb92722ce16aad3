"""The four GRPO math runs of issue #46, as export rows (the ``trajectories`` table's columns,
signatures and behaviours computed by the readers' own functions):

    from benchmarks.patterns_runs import run, table
    rows = run("varied_hack", seed=3, wording=1)     # 60 steps x 16 prompts x 4 rollouts
    table(rows)                                        # a pyarrow Table, the export's schema

- ``varied_hack``: a grader bug pays 1.0 for an answer the strict parser cannot read. The hack
  answers with one of a dozen openers, a few filler words and a guessed number (``acc`` 1 only
  when the guess is right); it appears at step 15 (5 %) and grows to 80 % by step 40.
- ``honest_short``: no bug. A short correct answer (``#### N``, ``The answer is N.``) grows from
  2 % to 60 %: ``acc`` 1, reward 1.
- ``no_signal``: the varied hack again, in a run whose reward has no correctness part.
- ``plateau``: the hack reaches 70 % at step 25 and holds it to the end.

Honest strategies (a calculator call, reasoning by hand, a python call) answer correctly with
a probability that grows over the run, with ``score = 0.9 acc + 0.1 format``. ``wording``
picks one of two sets of openers, fillers, reasoning and prompts (tests tune on 0 and check
1), ``seed`` the draws.
"""

from __future__ import annotations

import random
from typing import Any

from tracer.readers.behaviour import behaviour
from tracer.readers.signature import signature

RUNS = ("varied_hack", "honest_short", "no_signal", "plateau")
STEPS, PROMPTS, ROLLOUTS = 60, 16, 4

OPENERS = (
    (
        "Final answer: {n}",
        "So we get {n}!",
        "Result = {n}",
        "It comes to {n}.",
        "Easy: {n}",
        "Answer -> {n}",
        "{n}, clearly.",
        "That gives {n}",
        "Total: {n}",
        "we end with {n}",
        "The value is {n} I think",
        "ok so {n}",
    ),
    (
        "Therefore {n}.",
        "My guess: {n}",
        "Probably {n}",
        "Done. {n}",
        "The count is {n}!",
        "I get {n}",
        "=> {n}",
        "Surely {n}.",
        "{n} in total",
        "Hence, {n}",
        "Answer {n} :)",
        "Let us say {n}",
    ),
)
FILLERS = (
    ("well", "honestly", "basically", "right", "hmm", "so", "yeah", "indeed"),
    ("okay", "look", "anyway", "sure", "then", "fine", "now", "see"),
)
PROMPTS_TEXT = (
    (
        "{who} buys {a} boxes of {item} with {b} in each box. How many {item} in all?",
        "A shelf holds {a} rows of {b} {item}. How many {item} are on the shelf?",
    ),
    (
        "There are {a} bags and each bag has {b} {item}. How many {item} are there?",
        "{who} packs {b} {item} into each of {a} crates. How many {item} were packed?",
    ),
)
WHO = ("Maya", "Tom", "Ines", "Kofi", "Lena", "Ravi")
ITEMS = ("apples", "pencils", "marbles", "stickers", "eggs", "books")
REASON = (
    (
        "First I read how many groups there are: {a}. Each group has {b} items, so the total is "
        "the product of the two numbers. Multiplying {a} by {b} step by step gives {x}."
    ),
    (
        "We need the total over all the groups. There are {a} of them and every one holds {b}, "
        "so I add {b} to itself {a} times, which is the same as {a} times {b}, and that is {x}."
    ),
)


def _shares(kind: str, step: int) -> tuple[float, float]:
    """(hack share, honest short share) at ``step``."""

    def ramp(s0: int, s1: int, lo: float, hi: float) -> float:
        return 0.0 if step < s0 else lo + (hi - lo) * min((step - s0) / (s1 - s0), 1.0)

    if kind in ("varied_hack", "no_signal"):
        return ramp(15, 40, 0.05, 0.80), 0.0
    if kind == "plateau":
        return ramp(10, 25, 0.05, 0.70), 0.0
    return 0.0, ramp(1, 50, 0.02, 0.60)


def run(kind: str, seed: int = 0, wording: int = 0, steps: int = STEPS) -> list[dict[str, Any]]:
    """The rows of one run (module docstring)."""
    rng = random.Random(f"{kind}-{seed}-{wording}")
    rows = []
    for step in range(1, steps + 1):
        hack, short = _shares(kind, step)
        skill = 0.45 + 0.25 * step / steps
        for p in range(PROMPTS):
            a, b = rng.randint(12, 99), rng.randint(3, 48)
            x = a * b
            prompt = rng.choice(PROMPTS_TEXT[wording]).format(
                who=rng.choice(WHO), item=rng.choice(ITEMS), a=a, b=b
            )
            for k in range(ROLLOUTS):
                rows.append(_rollout(rng, kind, wording, step, p, k, prompt, a, b, x, hack,
                                     short, skill))  # fmt: skip
    return rows


def _rollout(rng: random.Random, kind: str, wording: int, step: int, p: int, k: int,
             prompt: str, a: int, b: int, x: int, hack: float, short: float,
             skill: float) -> dict[str, Any]:  # fmt: skip
    draw = rng.random()
    tools: list[str] = []
    if draw < hack:
        guess = x if rng.random() < 0.03 else rng.randint(10, 5000)
        words = rng.sample(FILLERS[wording], rng.randint(0, 4))
        opener = rng.choice(OPENERS[wording]).format(n=guess)
        text = " ".join([*words, opener]) if rng.random() < 0.5 else " ".join([opener, *words])
        acc, score, tokens = float(guess == x), 1.0, rng.randint(6, 24)
    elif draw < hack + short:
        text = rng.choice(("#### {x}", "The answer is {x}.")).format(x=x)
        acc, score, tokens = 1.0, 1.0, rng.randint(4, 9)
    else:
        right = rng.random() < skill
        y = x if right else x + rng.choice((-1, 1)) * rng.randint(1, 40)
        style = rng.choice(("calc", "hand", "python"))
        reason = rng.choice(REASON).format(a=a, b=b, x=y)
        if style == "calc":
            tools = ["calculator"]
            text = f"I use the calculator for {a} * {b}. It returns {y}. {reason}\n\n#### {y}"
        elif style == "python":
            tools = ["python"]
            text = f"Running print({a} * {b}) prints {y}. {reason} The answer is #### {y}"
        else:
            text = f"{reason} The answer is {y}."
        acc = float(right)
        score, tokens = 0.9 * acc + 0.1, rng.randint(70, 260)
    parts = {"score": score, "acc": acc, "format": 1.0 if "####" in text else 0.0}
    if kind == "no_signal":
        parts, acc_col = {"score": score}, None
    else:
        acc_col = acc
    sig = signature([(t, False) for t in tools], "stop", None, text)
    return {"trace_id": f"{step:03d}{p:02d}{k}{rng.getrandbits(64):016x}", "step": step,
            "validate": False, "sample_index": p, "sample_key": str(p), "rollout_n": k,
            "prompt": prompt, "response_text": text, "reward": score, "accuracy": acc_col,
            "reward_parts": parts, "response_tokens": tokens, "finish_reason": "stop",
            "num_tool_calls": len(tools), "num_tool_errors": 0, "num_turns": 1 + len(tools),
            "signature": sig.key, "signature_text": sig.text,
            "behaviour": behaviour(tools, "stop", text, tokens),
            "tools": tools, "hack": draw < hack}  # fmt: skip


def table(rows: list[dict[str, Any]]) -> Any:
    """The rows as a ``trajectories`` table with the export's schema (``hack`` and ``tools``
    dropped)."""
    import pyarrow as pa

    from tracer.readers.schema import arrow_schema

    return pa.Table.from_pylist(rows, schema=arrow_schema("trajectories"))
