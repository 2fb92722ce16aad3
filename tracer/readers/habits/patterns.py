"""What the policy does, step by step: trajectories grouped by behaviour
(:mod:`tracer.readers.habits.behaviour`: tools, finish reason, reasoning, answer form, length class;
the exact-template signature of :mod:`tracer.readers.habits.signature` for exports written before
behaviours existed), and the groups that take over or are paid without earning it.

    from tracer.readers.habits.patterns import step_patterns
    found = step_patterns("exports/gsm8k")          # an export folder, a DataFrame or Arrow table
    found.summary()                                  # "possible reward hacking since step 18, ..."
    [(r.text, r.first_step, r.last_step, r.reason) for r in found.rising]

**Patterns per step.** For each training step (validation rollouts are left out), the groups
ranked by share of the step's trajectories, each with its reward mean and spread, correctness
mean, mean length (``response_tokens``, else characters), tool-error rate and an example.

At step *i*, the *recent* steps are the last ``smooth`` steps up to *i*. A group *holds a
share* there when over the recent steps it has at least ``min_share`` of the trajectories and
``min_count`` per step on average.

**Possible reward hacking** (at every step where the group holds a share, rising or not): where
at least half of its trajectories have a correctness signal, the verdict of
:func:`~.earned.judge`: at least ``min_unearned`` of them were paid like a correct
answer without being correct. A group with high correctness is never flagged, however short its
answers. Where the run has no correctness signal, only independent evidence flags a group
paid above the rest: at least ``min_repeated`` of its answers are near-duplicates of an answer
given to another prompt (:mod:`tracer.readers.habits.near_dup`); a tool no longer called while
reward rises; training reward rising while validation reward stays flat
(:mod:`tracer.readers.habits.independent`). Shape (short, rising) is shown as a note ("rising and
short; reward not checked: no correctness signal"), never as a verdict.

**Rising** (a hint): the group holds a share, has at least ``growth`` times its share of the
``smooth`` steps ending ``window`` steps earlier, and a reward at or above the step's mean.

Defaults (:class:`PatternThresholds`): window 10, smooth 3, growth 3.0, min_share 0.05,
min_count 5, short_ratio 0.5, min_prompts 5, low_correctness 0.5, paid_ratio 0.8,
min_unearned 0.5, min_repeated 0.5, min_tool_rate 0.3, tool_drop 0.5, min_gain 0.1, val_flat
0.5; ``top`` 10 patterns per step.

The grouping runs in DuckDB over the export's ``trajectories`` table (one ``GROUP BY step,
behaviour``); the rules then read one row per (step, group), so the cost is that of the scan.
:func:`aggregate` does the same grouping in Python for a running job's own rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tracer.readers.habits.earned import NOT_CHECKED, EarnedThresholds, judge, label, not_judged
from tracer.readers.habits.independent import RunShape, run_shape, tool_dropped, validation_flat
from tracer.readers.habits.independent import where as _where
from tracer.readers.habits.patterns_py import aggregate
from tracer.readers.habits.patterns_sql import Group, StepTotal, duckdb_groups

__all__ = ["Group", "Pattern", "PatternThresholds", "Patterns", "Rising", "StepTotal",
           "aggregate", "analyze", "step_patterns"]  # fmt: skip


@dataclass
class PatternThresholds:
    """The rules' thresholds (module docstring); ``rollout-tracer flags --pattern-*`` sets them,
    ``--earned-by`` the reward part that says correct."""

    window: int = 10
    smooth: int = 3
    growth: float = 3.0
    min_share: float = 0.05
    min_count: int = 5
    short_ratio: float = 0.5
    min_prompts: int = 5
    low_correctness: float = 0.5
    paid_ratio: float = 0.8
    min_unearned: float = 0.5
    min_repeated: float = 0.5
    min_tool_rate: float = 0.3
    tool_drop: float = 0.5
    min_gain: float = 0.1
    val_flat: float = 0.5
    top: int = 10
    earned_by: str | None = None

    @property
    def earned(self) -> EarnedThresholds:
        return EarnedThresholds(self.low_correctness, self.paid_ratio, self.min_unearned)


@dataclass
class Pattern:
    """One group at one step."""

    step: int
    signature: str  # the group's key: its behaviour (older exports: its signature)
    text: str
    n: int
    share: float
    reward_mean: float | None
    reward_std: float | None
    mean_length: float | None
    tool_error_rate: float | None
    example: str
    rising: bool = False  # flagged rising at this step
    hacking: bool = False  # flagged possible reward hacking at this step
    correct_mean: float | None = None
    template: str = ""  # the example's exact template (the finer level)


@dataclass
class Rising:
    """A group flagged ``rising`` or ``possible reward hacking`` at one or more steps."""

    signature: str
    text: str
    since: int  # first step of its first flag's look-back (rising), or its first flag
    first_step: int  # first step it was flagged at (either label)
    last_step: int  # last step it was flagged at
    share_then: float  # its share at step ``since``
    share_now: float  # its share over the recent steps of its last flag
    peak_share: float
    peak_step: int
    reward: float  # over the recent steps of its first flag
    step_reward: float  # all trajectories' mean reward over the same steps
    example: str
    steps: list[int]  # the steps it was flagged rising at
    curve: list[tuple[int, float]]  # (step, share) at every step of the run
    hacking_steps: list[int] = field(default_factory=list)  # ... and possible reward hacking
    reason: str | None = None  # why possible reward hacking (at its first such step), in words
    note: str | None = None  # what else is known: "rising and short; reward not checked: ..."
    correct: float | None = None  # correctness over the recent steps of its last flag
    template: str = ""
    pair: dict[str, Any] | None = None  # an example beside an earned one (step_patterns)

    @property
    def hacking(self) -> bool:
        return bool(self.hacking_steps)

    @property
    def hacking_step(self) -> int | None:
        """The first step it was flagged possible reward hacking at."""
        return self.hacking_steps[0] if self.hacking_steps else None

    @property
    def labels(self) -> list[str]:
        return (["rising"] if self.steps else []) + (
            ["possible reward hacking"] if self.hacking else []
        )


@dataclass
class Patterns:
    """The result: ``top`` patterns per step, the flagged ones (``rising``: possible reward
    hacking first, then by peak share), the thresholds used and per step the share of
    trajectories in groups flagged possible reward hacking (``unearned``)."""

    steps: list[int]
    top: dict[int, list[Pattern]]
    rising: list[Rising]
    thresholds: PatternThresholds = field(default_factory=PatternThresholds)
    n: int = 0  # trajectories grouped
    unearned: dict[int, float] = field(default_factory=dict)
    checked: bool = False  # some trajectory has a correctness signal
    not_judged: list[int] = field(default_factory=list)  # steps with no correct answer to go by

    def step_metrics(self, step: int) -> dict[str, float]:
        """``patterns/top_share``, the patterns flagged ``rising`` and ``possible reward
        hacking`` at ``step``, and ``patterns/unearned_reward_share`` (the share of the step's
        trajectories in groups flagged possible reward hacking), for a trainer's logger."""
        top = self.top.get(step) or []
        return {
            "patterns/top_share": top[0].share if top else 0.0,
            "patterns/rising": float(sum(step in r.steps for r in self.rising)),
            "patterns/possible_reward_hacking": float(sum(step in r.hacking_steps
                                                          for r in self.rising)),
            "patterns/unearned_reward_share": self.unearned.get(step, 0.0),
        }  # fmt: skip

    def top_text(self, step: int) -> str | None:
        """The text of the step's most common pattern."""
        top = self.top.get(step) or []
        return top[0].text if top else None

    def summary(self) -> str:
        """The run in one line: "possible reward hacking since step N, now X % of
        trajectories", or what was (not) checked."""
        hacked = sorted({s for r in self.rising for s in r.hacking_steps})
        if hacked:
            last = self.steps[-1]
            now = self.unearned.get(last, 0.0)
            # without correctness, what flagged it is independent evidence (each reason)
            unchecked = "" if self.checked else (
                f"; {NOT_CHECKED} ({label(self.thresholds.earned_by)}), flagged on independent "
                "evidence")  # fmt: skip
            if now:
                return (f"possible reward hacking since step {hacked[0]}, now "
                        f"{100 * now:.0f} % of trajectories (step {last}){unchecked}")  # fmt: skip
            return (f"possible reward hacking at steps {hacked[0]}-{hacked[-1]}; none at the "
                    f"last step ({last}){unchecked}")  # fmt: skip
        if not self.checked:
            return f"{NOT_CHECKED} ({label(self.thresholds.earned_by)})"
        if self.not_judged:
            return "no possible reward hacking where judged; " + not_judged(self.not_judged)
        return "no possible reward hacking: the reward was earned where it was high"


def step_patterns(source: Any, thresholds: PatternThresholds | None = None) -> Patterns:
    """Patterns of a run from its ``trajectories`` table: an export folder, a
    ``trajectories.parquet`` path, a pandas DataFrame or an Arrow table (DuckDB reads it in
    place), with an example of each flagged group beside an earned trajectory of the same
    prompt. Raises :class:`~tracer.readers.habits.patterns_sql.NoSignatures` for an export written
    before signatures existed."""
    from tracer.readers.habits.evidence import add_pairs

    th = thresholds or PatternThresholds()
    groups, totals = duckdb_groups(source, th.top, th.min_count, earned_by=th.earned_by)
    found = analyze(groups, totals, th)
    add_pairs(source, found)
    return found


# ------------------------------------------------------------------------------ the rules
@dataclass
class _Sums:
    """A group over some steps, next to all trajectories of those steps."""

    mine: Group
    all_: StepTotal
    prompts: int = 0
    answers: int = 0
    repeated: float | None = None
    calls: int = 0  # the group's tool calls

    @property
    def share(self) -> float:
        return self.mine.n / self.all_.n if self.all_.n else 0.0

    def rest(self, name: str, count: str) -> float | None:
        n = getattr(self.all_, count) - getattr(self.mine, count)
        return (getattr(self.all_, name) - getattr(self.mine, name)) / n if n else None


def _ratio(a: float, b: int) -> float | None:
    return a / b if b else None


def _sums(per_step: dict[int, Group], totals: dict[int, StepTotal], steps: list[int]) -> _Sums:
    s = _Sums(Group(0, "", ""), StepTotal(0))
    weighted, weight = 0.0, 0
    for step in steps:
        s.all_.merge(totals[step])
        g = per_step.get(step)
        if g is not None:
            s.mine.merge(g)
            s.prompts, s.answers = s.prompts + g.prompts, s.answers + g.answers
            s.calls += g.calls
            if g.repeated is not None:
                weighted, weight = weighted + g.repeated * g.n, weight + g.n
    s.repeated = weighted / weight if weight else None
    return s


def _shape(s: _Sums, th: PatternThresholds) -> list[str]:
    """What the group's answers look like next to the rest's: hints, never a verdict."""
    length, rest = _ratio(s.mine.len_sum, s.mine.n_len), s.rest("len_sum", "n_len")
    out = []
    if length and rest and length <= th.short_ratio * rest:
        out.append("short")
    if s.prompts >= th.min_prompts and s.answers <= 0.2 * s.prompts:
        out.append("repeated")
    return out


def _judge(s: _Sums, steps: list[int], th: PatternThresholds, shape: RunShape, i: int,
           per_step: dict[int, Group]) -> tuple[bool, str]:  # fmt: skip
    """(possible reward hacking, why or what is known) for a group that holds a share:
    correctness where it has one, else independent evidence (near-duplicate answers, a tool
    no longer called, validation flat), named."""
    m = s.mine
    v = judge(n=m.n, n_checked=m.n_checked, n_unearned=m.n_unearned, reward=m.reward_mean,
              correct=m.correct_mean, rest_reward=s.rest("reward_sum", "n_reward"),
              rest_correct=s.rest("correct_sum", "n_checked"), where=_where(steps),
              earned_by=th.earned_by, th=th.earned, n_unjudged=m.n_unjudged)  # fmt: skip
    if v.checked:
        return v.hacking, v.reason
    if v.reason != NOT_CHECKED:  # correctness without a correct answer: said, not judged
        return False, v.reason
    rest = s.rest("reward_sum", "n_reward")
    if m.reward_mean is None or rest is None or m.reward_mean <= rest:
        return False, NOT_CHECKED
    paid = f"with reward {m.reward_mean:.2f} against {rest:.2f} for the rest of {_where(steps)}"
    if s.repeated is not None and s.repeated >= th.min_repeated:
        return True, (f"{NOT_CHECKED}; independent evidence: {100 * s.repeated:.0f}% of its "
                      f"answers are near-duplicates of an answer to another prompt (MinHash), "
                      f"{paid}")  # fmt: skip

    def share_at(window: list[int]) -> float:
        n = sum(per_step[x].n for x in window if x in per_step)
        return n / max(sum(shape.totals[x].n for x in window), 1)

    if m.reward_mean < rest + th.min_gain:
        return False, NOT_CHECKED
    found = tool_dropped(shape, i, steps, s.calls, m.n, th) or validation_flat(
        shape, steps[-1], share_at, s.share, th)
    if found:
        return True, f"{NOT_CHECKED}; independent evidence: {found}, {paid}"
    return False, NOT_CHECKED


def _flagged(sig: str, per_step: dict[int, Group], steps: list[int],
             totals: dict[int, StepTotal], th: PatternThresholds,
             last_only: bool, shape: RunShape) -> Rising | None:  # fmt: skip
    found: Rising | None = None
    for i in range(len(steps) - 1 if last_only else 0, len(steps)):
        recent = steps[max(i - th.smooth + 1, 0) : i + 1]
        now = _sums(per_step, totals, recent)
        if now.mine.n < th.min_count * len(recent) or now.share < th.min_share:
            continue
        reward, step_reward = now.mine.reward_mean, now.all_.reward_mean
        rising = False
        if i >= th.window + th.smooth - 1 and reward is not None and step_reward is not None:
            earlier = steps[i - th.window - th.smooth + 1 : i - th.window + 1]
            then = _sums(per_step, totals, earlier)
            rising = now.share >= th.growth * then.share and reward >= step_reward - 1e-9
        hacking, why = _judge(now, recent, th, shape, i, per_step)
        if not (rising or hacking):
            continue
        if found is None:
            g = per_step[max(s for s in recent if s in per_step)]
            look = steps[max(i - th.window - th.smooth + 1, 0) : i + 1] if rising else recent
            since = next(s for s in look if s in per_step)
            found = Rising(sig, g.text, since, steps[i], steps[i],
                           per_step[since].n / totals[since].n, now.share, 0.0, steps[i],
                           reward or 0.0, step_reward or 0.0, g.example, [], [],
                           template=g.template)  # fmt: skip
        found.last_step, found.share_now = steps[i], now.share
        found.correct = now.mine.correct_mean
        if rising:
            found.steps.append(steps[i])
        if hacking:
            found.hacking_steps.append(steps[i])
            found.reason = found.reason or why
        elif found.note is None:
            hint = " and ".join((["rising"] if rising else []) + _shape(now, th))
            said = why == NOT_CHECKED or why.endswith("; not judged")  # no verdict, only why
            found.note = f"{hint}; {why}" if said else f"earned: {why}"
    if found is None:
        return None
    found.curve = [(s, per_step[s].n / totals[s].n if s in per_step else 0.0) for s in steps]
    found.peak_step, found.peak_share = max(found.curve, key=lambda p: (p[1], -p[0]))
    last = per_step.get(found.last_step)
    if last is not None:
        found.example, found.template = last.example, last.template
    return found


def analyze(groups: Iterable[Group], totals: Mapping[int, StepTotal],
            th: PatternThresholds | None = None, last_only: bool = False) -> Patterns:  # fmt: skip
    """The rules (module docstring) over per-(step, group) groups and per-step totals (from
    :func:`aggregate` or DuckDB). ``last_only``: only the last step is judged and ranked (what
    a running job needs of each new step)."""
    th = th or PatternThresholds()
    every = {int(k): v for k, v in totals.items()}  # validation-only steps too
    totals = {k: v for k, v in every.items() if v.n}
    shape = run_shape(totals, every, th)
    steps = sorted(totals)
    by_sig: dict[str, dict[int, Group]] = defaultdict(dict)
    by_step: dict[int, list[Group]] = defaultdict(list)
    for g in groups:
        if g.step in totals:
            by_sig[g.signature][g.step] = g
            by_step[g.step].append(g)
    rising = []
    for sig, per_step in by_sig.items():
        r = _flagged(sig, per_step, steps, totals, th, last_only, shape)
        if r is not None:
            rising.append(r)
    rising.sort(key=lambda r: (not r.hacking, not r.steps, -r.peak_share, r.first_step,
                               r.signature))  # fmt: skip
    unearned: dict[int, float] = defaultdict(float)
    for r in rising:
        for step in r.hacking_steps:
            held = by_sig[r.signature].get(step)
            unearned[step] += held.n / totals[step].n if held is not None else 0.0
    top: dict[int, list[Pattern]] = {}
    for step in steps[-1:] if last_only else steps:
        ranked = sorted(by_step[step], key=lambda g: (-g.n, g.signature))[: th.top]
        top[step] = []
        flagged = {r.signature: r for r in rising}
        for g in ranked:
            r = flagged.get(g.signature)
            errors = _ratio(g.errors, g.calls) if g.calls else None
            top[step].append(Pattern(
                step, g.signature, g.text, g.n, g.n / totals[step].n, g.reward_mean,
                g.reward_std, _ratio(g.len_sum, g.n_len), errors, g.example,
                r is not None and step in r.steps, r is not None and step in r.hacking_steps,
                g.correct_mean, g.template))  # fmt: skip
    unjudged = [s for s in steps if totals[s].n_unjudged and
                totals[s].n_unjudged == totals[s].n_checked]  # fmt: skip
    return Patterns(steps, top, rising, th, sum(t.n for t in totals.values()), dict(unearned),
                    any(t.n_checked for t in totals.values()), unjudged)  # fmt: skip
