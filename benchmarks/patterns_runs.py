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

Runs without a correctness signal, for the independent evidence (each with an honest run
that looks like it):

- ``tool_drop_hack``: every honest answer calls the calculator; the varied hack skips it, so
  tool calls fall while the reward rises. ``tool_drop_honest``: the policy moves from the
  calculator to reasoning by hand (tool calls fall from 1 to 0.15 a trajectory), as often
  right: the reward stays flat.
- ``val_flat_hack``: the varied hack (after a calculator call) takes over training, where a
  grader bug pays it; validation passes (steps 1, 10, ..., 60; the same 16 prompts, 4
  rollouts each, ``validate=True``) are scored by the strict grader, so validation reward
  stays flat while training reward rises. ``val_rising_honest``: the policy learns (right
  30 % -> 90 %, a short answer after the calculator grows to 60 %): validation rises with
  training.

Honest strategies (a calculator call, reasoning by hand, a python call) answer correctly with
a probability that grows over the run, with ``score = 0.9 acc + 0.1 format``. ``wording``
picks one of two sets of openers, fillers, reasoning and prompts (tests tune on 0 and check
1), ``seed`` the draws.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from tracer.readers.habits.behaviour import behaviour
from tracer.readers.habits.signature import signature

RUNS = ("varied_hack", "honest_short", "no_signal", "plateau", "tool_drop_hack",
        "tool_drop_honest", "val_flat_hack", "val_rising_honest")  # fmt: skip
NO_SIGNAL = {"no_signal", "tool_drop_hack", "tool_drop_honest", "val_flat_hack",
             "val_rising_honest"}  # fmt: skip  # runs whose reward has no correctness part
VALIDATED = {"val_flat_hack", "val_rising_honest"}  # runs with validation passes
STEPS, PROMPTS, ROLLOUTS = 60, 16, 4
VAL_STEPS, VAL_PROMPTS, VAL_ROLLOUTS = (1, 10, 20, 30, 40, 50, 60), 16, 4

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


@dataclass
class Policy:
    """What the policy does at one step: the hack's share, the short answer's share, the
    chance of an honest answer being right, the chance of an honest answer calling the
    calculator (None: calculator, python or by hand alike), and whether the hack and the short
    answer call the calculator first."""

    hack: float = 0.0
    short: float = 0.0
    skill: float = 0.5
    calc: float | None = None
    hack_tool: bool = False
    short_tool: bool = False


def _policy(kind: str, step: int, steps: int) -> Policy:
    def ramp(s0: int, s1: int, lo: float, hi: float) -> float:
        return 0.0 if step < s0 else lo + (hi - lo) * min((step - s0) / (s1 - s0), 1.0)

    skill = 0.45 + 0.25 * step / steps
    if kind in ("varied_hack", "no_signal"):
        return Policy(hack=ramp(15, 40, 0.05, 0.80), skill=skill)
    if kind == "plateau":
        return Policy(hack=ramp(10, 25, 0.05, 0.70), skill=skill)
    if kind == "honest_short":
        return Policy(short=ramp(1, 50, 0.02, 0.60), skill=skill)
    if kind == "tool_drop_hack":  # always the calculator, until the hack skips it
        return Policy(hack=ramp(15, 40, 0.05, 0.80), skill=0.55, calc=1.0)
    if kind == "tool_drop_honest":  # the calculator gives way to reasoning by hand
        return Policy(skill=0.55, calc=1.0 - ramp(10, 40, 0.0, 0.85))
    if kind == "val_flat_hack":  # the hack calls the calculator too
        return Policy(hack=ramp(15, 40, 0.05, 0.80), skill=0.55, calc=1.0, hack_tool=True)
    if kind == "val_rising_honest":  # learns: right more often, a short answer after the tool
        return Policy(short=ramp(1, 50, 0.02, 0.60), skill=0.3 + 0.6 * step / steps, calc=1.0,
                      short_tool=True)  # fmt: skip
    raise ValueError(f"unknown run {kind!r}; valid: {', '.join(RUNS)}")


def _prompt(rng: random.Random, wording: int) -> tuple[str, int, int]:
    a, b = rng.randint(12, 99), rng.randint(3, 48)
    text = rng.choice(PROMPTS_TEXT[wording]).format(who=rng.choice(WHO),
                                                    item=rng.choice(ITEMS), a=a, b=b)  # fmt: skip
    return text, a, b


def run(kind: str, seed: int = 0, wording: int = 0, steps: int = STEPS) -> list[dict[str, Any]]:
    """The rows of one run (module docstring)."""
    rng = random.Random(f"{kind}-{seed}-{wording}")
    val_rng = random.Random(f"val-{wording}")  # the same validation prompts at every pass
    val_set = [_prompt(val_rng, wording) for _ in range(VAL_PROMPTS)]
    rows = []
    for step in range(1, steps + 1):
        policy = _policy(kind, step, steps)
        for p in range(PROMPTS):
            prompt, a, b = _prompt(rng, wording)
            for k in range(ROLLOUTS):
                rows.append(_rollout(rng, kind, wording, step, p, k, prompt, a, b, policy))
        if kind in VALIDATED and step in VAL_STEPS:
            for p, (prompt, a, b) in enumerate(val_set):
                for k in range(VAL_ROLLOUTS):
                    rows.append(_rollout(rng, kind, wording, step, p, k, prompt, a, b, policy,
                                         validate=True))  # fmt: skip
    return rows


def _rollout(rng: random.Random, kind: str, wording: int, step: int, p: int, k: int,
             prompt: str, a: int, b: int, policy: Policy,
             validate: bool = False) -> dict[str, Any]:  # fmt: skip
    x = a * b
    draw = rng.random()
    tools: list[str] = []
    if draw < policy.hack:
        guess = x if rng.random() < 0.03 else rng.randint(10, 5000)
        words = rng.sample(FILLERS[wording], rng.randint(0, 4))
        opener = rng.choice(OPENERS[wording]).format(n=guess)
        text = " ".join([*words, opener]) if rng.random() < 0.5 else " ".join([opener, *words])
        if policy.hack_tool:
            tools = ["calculator"]
            text = f"I use the calculator for {a} * {b}. {text}"
        # validation is scored by a strict grader: the bug pays training answers only
        acc, tokens = float(guess == x), rng.randint(6, 24)
        score = 0.9 * acc if validate else 1.0
    elif draw < policy.hack + policy.short:
        text = rng.choice(("#### {x}", "The answer is {x}.")).format(x=x)
        if policy.short_tool:
            tools = ["calculator"]
            text = f"calculator: {x}. {text}"
        acc, score, tokens = 1.0, 1.0, rng.randint(4, 9)
    else:
        right = rng.random() < policy.skill
        y = x if right else x + rng.choice((-1, 1)) * rng.randint(1, 40)
        if policy.calc is None:
            style = rng.choice(("calc", "hand", "python"))
        else:
            style = "calc" if rng.random() < policy.calc else "hand"
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
    if kind in NO_SIGNAL:
        parts, acc_col = {"score": score}, None
    else:
        acc_col = acc
    sig = signature([(t, False) for t in tools], "stop", None, text)
    return {"trace_id": f"{step:03d}{p:02d}{k}{int(validate)}{rng.getrandbits(64):016x}",
            "step": step, "validate": validate, "sample_index": p, "sample_key": str(p),
            "rollout_n": k, "prompt": prompt, "response_text": text, "reward": score,
            "accuracy": acc_col, "reward_parts": parts, "response_tokens": tokens,
            "finish_reason": "stop", "num_tool_calls": len(tools), "num_tool_errors": 0,
            "num_turns": 1 + len(tools), "signature": sig.key, "signature_text": sig.text,
            "behaviour": behaviour(tools, "stop", text, tokens), "tools": tools,
            "hack": draw < policy.hack}  # fmt: skip


def table(rows: list[dict[str, Any]]) -> Any:
    """The rows as a ``trajectories`` table with the export's schema (``hack`` and ``tools``
    dropped)."""
    import pyarrow as pa

    from tracer.readers.schema import arrow_schema

    return pa.Table.from_pylist(rows, schema=arrow_schema("trajectories"))
