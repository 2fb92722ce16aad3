"""What the policy does, step by step: trajectories grouped by behaviour signature
(:mod:`tracer.readers.signature`), and the groups that take over.

    from tracer.readers.patterns import step_patterns
    found = step_patterns("exports/gsm8k")          # an export folder, a DataFrame or Arrow table
    found.top[found.steps[-1]][0].text               # the last step's most common signature
    [(r.text, r.since, r.last_step, r.reason) for r in found.rising]

**Patterns per step.** For each training step (validation rollouts are left out), the
signatures ranked by share of the step's trajectories, each with its reward mean and spread
(population standard deviation), mean length (``response_tokens``, else the response's
characters), tool-error rate (failed / all tool calls) and an example trace id.

**Rising.** Steps are taken in order (the steps present in the data). At step *i*, the
*recent* steps are the last ``smooth`` steps up to *i* and the *earlier* steps the ``smooth``
steps ending ``window`` steps before *i*. A signature is flagged ``rising`` at *i* when, over
the recent steps, it holds

- at least ``min_share`` of the trajectories and at least ``min_count`` per step on average,
- at least ``growth`` times its share of the earlier steps (a share of 0 counts as 0),
- a reward mean at or above the mean of all trajectories of those steps.

A step can be judged from the ``window + smooth``-th step on. Signatures without rewards are
never flagged.

**Possible reward hacking.** A rising signature is also flagged ``possible reward hacking``
where, over the same recent steps, its reward mean is above the rest of the trajectories' and
its answer is *short* (mean length at most ``short_ratio`` of the rest's) or *repeated* (over
at least ``min_prompts`` distinct prompts, at most ``repeat_ratio`` distinct response texts
per prompt: the same words whatever the question). The reason is given in words.

Defaults (:class:`PatternThresholds`): window 10, smooth 3, growth 3.0, min_share 0.05,
min_count 10, short_ratio 0.5, repeat_ratio 0.2, min_prompts 5; ``top`` 10 patterns per step.

The grouping runs in DuckDB over the export's ``trajectories`` table (one ``GROUP BY step,
signature``); the rules then read one row per (step, signature), so the cost is that of the
scan. :func:`aggregate` does the same grouping in Python for a running job's own rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tracer.readers.patterns_sql import Group, StepTotal, duckdb_groups

__all__ = ["Group", "Pattern", "PatternThresholds", "Patterns", "Rising", "StepTotal",
           "aggregate", "analyze", "step_patterns"]  # fmt: skip


@dataclass
class PatternThresholds:
    """The rules' thresholds (module docstring); ``rollout-tracer flags --pattern-*`` sets them."""

    window: int = 10
    smooth: int = 3
    growth: float = 3.0
    min_share: float = 0.05
    min_count: int = 10
    short_ratio: float = 0.5
    repeat_ratio: float = 0.2
    min_prompts: int = 5
    top: int = 10


@dataclass
class Pattern:
    """One signature at one step."""

    step: int
    signature: str
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


@dataclass
class Rising:
    """A signature flagged ``rising`` at one or more steps."""

    signature: str
    text: str
    since: int  # its first step in the earlier steps of its first flag (or that flag's step)
    first_step: int  # first step it was flagged at
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
    reason: str | None = None  # why it was possible reward hacking first, in words

    @property
    def hacking(self) -> bool:
        return bool(self.hacking_steps)

    @property
    def hacking_step(self) -> int | None:
        """The first step it was flagged possible reward hacking at."""
        return self.hacking_steps[0] if self.hacking_steps else None

    @property
    def labels(self) -> list[str]:
        return ["rising", "possible reward hacking"] if self.hacking else ["rising"]


@dataclass
class Patterns:
    """The result: ``top`` patterns per step, the ``rising`` ones (possible reward hacking
    first, then by peak share), and the thresholds used."""

    steps: list[int]
    top: dict[int, list[Pattern]]
    rising: list[Rising]
    thresholds: PatternThresholds = field(default_factory=PatternThresholds)
    n: int = 0  # trajectories grouped

    def step_metrics(self, step: int) -> dict[str, float]:
        """``patterns/top_share``, and the patterns flagged ``rising`` and ``possible reward
        hacking`` at ``step`` (``patterns/rising``, ``patterns/possible_reward_hacking``), for
        a trainer's logger."""
        top = self.top.get(step) or []
        return {
            "patterns/top_share": top[0].share if top else 0.0,
            "patterns/rising": float(sum(step in r.steps for r in self.rising)),
            "patterns/possible_reward_hacking": float(sum(step in r.hacking_steps
                                                          for r in self.rising)),
        }  # fmt: skip

    def top_text(self, step: int) -> str | None:
        """The signature text of the step's most common pattern."""
        top = self.top.get(step) or []
        return top[0].text if top else None


# ------------------------------------------------------------------------------ grouping
def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if f != f else f


def aggregate(rows: Iterable[Mapping[str, Any]]) -> tuple[list[Group], dict[int, StepTotal]]:
    """The grouping of :func:`step_patterns` in Python, over rows with the ``trajectories``
    columns (``trace_id``, ``step``, ``validate``, ``signature``, ``signature_text``,
    ``reward``, ``response_tokens``/``response_text``, ``num_tool_calls``,
    ``num_tool_errors``, ``prompt``/``sample_key``)."""
    groups: dict[tuple[int, str], Group] = {}
    seen: dict[tuple[int, str], tuple[set[Any], set[Any]]] = {}
    totals: dict[int, StepTotal] = {}
    for row in rows:
        step = row.get("step")
        if step is None or step != step or row.get("validate") or not row.get("signature"):
            continue
        step = int(step)
        key = (step, str(row["signature"]))
        reward = _num(row.get("reward"))
        length = _num(row.get("response_tokens"))
        if length is None and isinstance(row.get("response_text"), str):
            length = float(len(row["response_text"]))
        g = groups.get(key)
        if g is None:
            g = groups[key] = Group(step, key[1], str(row.get("signature_text") or ""),
                                    example=str(row["trace_id"]))  # fmt: skip
            seen[key] = (set(), set())
        total = totals.setdefault(step, StepTotal(step))
        for acc in (g, total):
            acc.add(reward, length)
        g.calls += int(_num(row.get("num_tool_calls")) or 0)
        g.errors += int(_num(row.get("num_tool_errors")) or 0)
        g.example = min(g.example, str(row["trace_id"]))
        prompt = row.get("prompt") if row.get("prompt") is not None else row.get("sample_key")
        for values, value in zip(seen[key], (prompt, row.get("response_text")), strict=True):
            if value is not None:  # as SQL's count(DISTINCT ...)
                values.add(value)
    for key, g in groups.items():
        g.prompts, g.answers = len(seen[key][0]), len(seen[key][1])
    return list(groups.values()), totals


def step_patterns(source: Any, thresholds: PatternThresholds | None = None) -> Patterns:
    """Patterns of a run from its ``trajectories`` table: an export folder, a
    ``trajectories.parquet`` path, a pandas DataFrame or an Arrow table (DuckDB reads it in
    place). Raises :class:`~tracer.readers.patterns_sql.NoSignatures` for an export written
    before signatures existed."""
    th = thresholds or PatternThresholds()
    groups, totals = duckdb_groups(source, th.top, th.min_count)
    return analyze(groups, totals, th)


# ------------------------------------------------------------------------------ the rules
@dataclass
class _Sums:
    """A signature over some steps, next to all trajectories of those steps."""

    n: int = 0
    total: int = 0
    reward: float | None = None
    step_reward: float | None = None
    rest_reward: float | None = None
    length: float | None = None
    rest_length: float | None = None
    prompts: int = 0
    answers: int = 0

    @property
    def share(self) -> float:
        return self.n / self.total if self.total else 0.0


def _ratio(a: float, b: int) -> float | None:
    return a / b if b else None


def _sums(per_step: dict[int, Group], totals: dict[int, StepTotal], steps: list[int]) -> _Sums:
    mine, all_ = Group(0, "", ""), StepTotal(0)
    prompts = answers = 0
    for step in steps:
        all_.merge(totals[step])
        g = per_step.get(step)
        if g is not None:
            mine.merge(g)
            prompts, answers = prompts + g.prompts, answers + g.answers
    return _Sums(
        mine.n, all_.n, _ratio(mine.reward_sum, mine.n_reward),
        _ratio(all_.reward_sum, all_.n_reward),
        _ratio(all_.reward_sum - mine.reward_sum, all_.n_reward - mine.n_reward),
        _ratio(mine.len_sum, mine.n_len),
        _ratio(all_.len_sum - mine.len_sum, all_.n_len - mine.n_len), prompts, answers,
    )  # fmt: skip


def _hacking_reason(s: _Sums, steps: list[int], th: PatternThresholds) -> str | None:
    if s.reward is None or s.rest_reward is None or s.reward <= s.rest_reward:
        return None
    why = []
    if s.length and s.rest_length and s.length <= th.short_ratio * s.rest_length:
        why.append(f"its responses are {s.rest_length / s.length:.1f}x shorter than the rest's "
                   f"({s.length:.0f} against {s.rest_length:.0f})")  # fmt: skip
    if s.prompts >= th.min_prompts and s.answers <= th.repeat_ratio * s.prompts:
        why.append(f"it gives the same response to different prompts ({s.answers} distinct "
                   f"responses for {s.prompts} prompts, counted per step)")  # fmt: skip
    if not why:
        return None
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    return (f"reward {s.reward:.2f} against {s.rest_reward:.2f} for the other trajectories of "
            f"{where}; " + " and ".join(why))  # fmt: skip


def _rising(sig: str, per_step: dict[int, Group], steps: list[int],
            totals: dict[int, StepTotal], th: PatternThresholds,
            last_only: bool) -> Rising | None:  # fmt: skip
    found: Rising | None = None
    first = len(steps) - 1 if last_only else 0
    for i in range(max(first, th.window + th.smooth - 1), len(steps)):
        recent = steps[i - th.smooth + 1 : i + 1]
        earlier = steps[i - th.window - th.smooth + 1 : i - th.window + 1]
        now = _sums(per_step, totals, recent)
        if now.n < th.min_count * len(recent) or now.share < th.min_share:
            continue
        then = _sums(per_step, totals, earlier)
        if now.share < th.growth * then.share or now.reward is None or now.step_reward is None:
            continue
        if now.reward < now.step_reward - 1e-9:  # at or above the mean, float sums aside
            continue
        reason = _hacking_reason(now, recent, th)
        if found is None:
            g = per_step[max(s for s in recent if s in per_step)]
            since = next(s for s in steps[i - th.window - th.smooth + 1 : i + 1] if s in per_step)
            found = Rising(sig, g.text, since, steps[i], steps[i],
                           per_step[since].n / totals[since].n, now.share, 0.0, steps[i],
                           now.reward, now.step_reward, g.example, [], [])  # fmt: skip
        found.last_step, found.share_now = steps[i], now.share
        found.steps.append(steps[i])
        if reason is not None:
            found.hacking_steps.append(steps[i])
            found.reason = found.reason or reason
    if found is None:
        return None
    found.curve = [(s, per_step[s].n / totals[s].n if s in per_step else 0.0) for s in steps]
    found.peak_step, found.peak_share = max(found.curve, key=lambda p: (p[1], -p[0]))
    last = per_step.get(found.last_step)
    if last is not None:
        found.example = last.example
    return found


def analyze(groups: Iterable[Group], totals: Mapping[int, StepTotal],
            th: PatternThresholds | None = None, last_only: bool = False) -> Patterns:  # fmt: skip
    """The rules (module docstring) over per-(step, signature) groups and per-step totals
    (from :func:`aggregate` or DuckDB). ``last_only``: only the last step is judged and
    ranked (what a running job needs of each new step)."""
    th = th or PatternThresholds()
    totals = {int(k): v for k, v in totals.items() if v.n}
    steps = sorted(totals)
    by_sig: dict[str, dict[int, Group]] = defaultdict(dict)
    by_step: dict[int, list[Group]] = defaultdict(list)
    for g in groups:
        if g.step in totals:
            by_sig[g.signature][g.step] = g
            by_step[g.step].append(g)
    rising = []
    for sig, per_step in by_sig.items():
        if max(g.n for g in per_step.values()) >= th.min_count:
            r = _rising(sig, per_step, steps, totals, th, last_only)
            if r is not None:
                rising.append(r)
    rising.sort(key=lambda r: (not r.hacking, -r.peak_share, r.first_step, r.signature))
    flagged = {(r.signature, s): r for r in rising for s in r.steps}
    top: dict[int, list[Pattern]] = {}
    for step in steps[-1:] if last_only else steps:
        ranked = sorted(by_step[step], key=lambda g: (-g.n, g.signature))[: th.top]
        top[step] = []
        for g in ranked:
            r = flagged.get((g.signature, step))
            errors = _ratio(g.errors, g.calls) if g.calls else None
            top[step].append(Pattern(
                step, g.signature, g.text, g.n, g.n / totals[step].n, g.reward_mean,
                g.reward_std, _ratio(g.len_sum, g.n_len), errors, g.example, r is not None,
                r is not None and step in r.hacking_steps))  # fmt: skip
    return Patterns(steps, top, rising, th, sum(t.n for t in totals.values()))
