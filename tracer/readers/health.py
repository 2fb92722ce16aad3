"""Rollout health flags: documented rules over stored trajectories that point to trace ids.

Pure Python over the export's rows (``tracer.readers.rows``), so every source gives the same
flags: MLflow, JSONL, Weave, and an exported Parquet/JSONL folder. Two levels:

Per trajectory (from one trajectory's turns and tool calls, at row-building time):

``truncated``          a generate call ended with ``finish_reason == "length"``.
``tool_loop``          the same tool call (name and arguments) ``tool_loop_calls`` times or more,
                       or the same assistant text ``tool_loop_calls`` times or more.
``identical_turns``    two consecutive assistant turns with the same (non-empty) text.
``tool_error_burst``   ``tool_error_burst`` or more consecutive tool calls that failed.
``short_answer_high_reward``  reward >= ``high_reward`` with a final answer of at most
                       ``short_answer_chars`` characters (stripped).

Per step (over the trajectories of one (step, validate); the flag goes on the trajectories
that show it, and the step is counted):

``truncation_rate``    more than ``truncation_rate`` of the step's trajectories are truncated;
                       flags the truncated ones.
``length_drift``       the step's mean response length is more than ``length_drift`` times (or
                       less than 1/``length_drift`` of) the first step's; flags the trajectories
                       beyond the first step's mean times ``length_drift`` (or below its
                       mean divided by it).
``zero_variance_rising``  the fraction of GRPO groups (>= 2 members) whose rewards are all equal
                       is at least ``zero_variance_rise`` above the first step's; flags their
                       members.
``reward_without_accuracy``  one reward component carries the reward while accuracy stays flat:
                       at least ``component_share`` of the step's mean reward is not accuracy
                       (``reward - accuracy``) and mean accuracy is within ``flat_accuracy`` of
                       the first step's; flags trajectories with reward > 0 and accuracy 0.
``dropped_longer``     rollouts were dropped (cancelled, timed out, raised: ``end_reason``) and
                       they wrote at least ``LENGTH_BIAS_RATIO`` (1.25) times the kept ones'
                       mean tokens (so far): training sees shorter answers than the policy
                       writes (:mod:`tracer.readers.timing.drops`); flags the dropped ones.
``incomplete_groups``  GRPO groups of the step have fewer completed rollouts than the step's
                       group size; flags the dropped members of those groups.
``reward_accuracy_divergence``  possibly unearned reward (:mod:`tracer.readers.habits.earned`, the
                       notion the behaviour patterns' ``possible reward hacking`` uses): at
                       least ``unearned_share`` of the step's trajectories, and at least
                       ``unearned_min`` of them (one wrong answer is not a habit), were paid
                       like a correct answer without being correct; flags them. Where no
                       trajectory read is correct, nothing is judged: the step gets a note
                       (``Health.notes``: "no correct answer in step N; not judged").

Steps compare with the first step of the same ``validate`` seen in the data ("baseline").
Accuracy is the reward span's ``accuracy``/``acc`` output (a bool as 0/1); rules that need it
skip steps without it. Thresholds are fields of :class:`HealthThresholds`.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tracer.readers.habits.earned import not_judged, num, truth

TRAJECTORY_FLAGS = ("truncated", "tool_loop", "identical_turns", "tool_error_burst",
                    "short_answer_high_reward")  # fmt: skip
STEP_FLAGS = ("truncation_rate", "length_drift", "zero_variance_rising",
              "reward_without_accuracy", "reward_accuracy_divergence", "dropped_longer",
              "incomplete_groups")  # fmt: skip
FLAGS = TRAJECTORY_FLAGS + STEP_FLAGS
# one line per rule, for people reading `rollout-tracer flags` (the rules: module docstring)
MEANINGS = {
    "truncated": "a generate call hit the token limit (finish_reason length)",
    "tool_loop": "the same tool call, or the same reply, repeated 3+ times",
    "identical_turns": "two consecutive assistant turns with the same text",
    "tool_error_burst": "3+ consecutive tool calls failed",
    "short_answer_high_reward": "a high reward for a final answer of a few characters",
    "truncation_rate": "over 25% of the step's trajectories were truncated",
    "length_drift": "mean response length moved 1.5x+ from the first step",
    "zero_variance_rising": "more GRPO groups with all rewards equal (no learning signal) "
                            "than at the first step",
    "reward_without_accuracy": "the reward comes mostly from a non-accuracy part (e.g. format) "
                               "while accuracy stays flat",
    "reward_accuracy_divergence": "wrong answers paid like correct ones (reward high, accuracy "
                                  "low; tracer/readers/habits/earned.py)",
    "dropped_longer": "cancelled or timed-out rollouts were longer than the kept ones: training "
                      "sees shorter answers than the policy writes",
    "incomplete_groups": "GRPO groups left short by dropped rollouts (cancelled, timed out, "
                         "raised)",
}
TAG_PREFIX = "flag."  # MLflow trace tag of a flag: flag.<name> = "true"


@dataclass
class HealthThresholds:
    """Every threshold a flag rule uses (see the module docstring for the rules)."""

    tool_loop_calls: int = 3
    tool_error_burst: int = 3
    high_reward: float = 0.5
    short_answer_chars: int = 3
    truncation_rate: float = 0.25
    length_drift: float = 1.5
    zero_variance_rise: float = 0.25
    component_share: float = 0.8
    flat_accuracy: float = 0.05
    unearned_share: float = 0.05  # as the patterns' min_share
    unearned_min: int = 2  # trajectories: a single wrong answer paid is no habit


@dataclass
class StepFlag:
    step: Any
    validate: bool
    name: str
    value: float  # the measured value the rule compared with its threshold
    trace_ids: list[str] = field(default_factory=list)
    detail: str = ""  # the numbers behind it, for people (the drop rules')


@dataclass
class Health:
    """Flags per trajectory (trace id -> names) and per step."""

    by_trace: dict[str, list[str]] = field(default_factory=dict)
    steps: list[StepFlag] = field(default_factory=list)
    step_of: dict[str, Any] = field(default_factory=dict)  # trace id -> step
    not_judged: list[tuple[bool, Any]] = field(default_factory=list)  # (validate, step)

    def notes(self, limit: int = 5) -> list[str]:
        """What could not be judged, in words: "no correct answer in step N; not judged"."""
        out = [not_judged(f"{'validation ' if v else ''}step {s}")
               for v, s in self.not_judged[:limit]]  # fmt: skip
        if len(self.not_judged) > limit:
            out.append(f"... and {len(self.not_judged) - limit} more steps with no correct "
                       "answer; not judged")  # fmt: skip
        return out

    def counts(self) -> dict[str, dict[Any, int]]:
        """Flag -> step -> number of flagged trajectories."""
        out: dict[str, dict[Any, int]] = defaultdict(dict)
        for trace_id, names in self.by_trace.items():
            step = self.step_of.get(trace_id)
            for name in names:
                out[name][step] = out[name].get(step, 0) + 1
        return {name: out[name] for name in FLAGS if name in out}

    def examples(self, name: str, limit: int = 5) -> list[str]:
        ids = [t for t, names in self.by_trace.items() if name in names]
        return sorted(ids, key=lambda t: (str(self.step_of.get(t)), t))[:limit]

    def step_metrics(self, step: Any) -> dict[str, int]:
        """``health/<flag>`` counts of one step, for a trainer's logger."""
        return {f"health/{name}": per_step.get(step, 0) for name, per_step in
                self.counts().items()} | {f"health/{n}": 0 for n in FLAGS if n not in
                                          self.counts()}  # fmt: skip


# ---------------------------------------------------------------------- per trajectory
def trajectory_flags(
    reward: float | None,
    turns: Sequence[Mapping[str, Any]],
    tool_calls: Sequence[Mapping[str, Any]],
    th: HealthThresholds | None = None,
) -> list[str]:
    """Flags of one trajectory from its rows (turns and tool calls in order)."""
    th = th or HealthThresholds()
    flags = []
    if any(t.get("finish_reason") == "length" for t in turns):
        flags.append("truncated")
    texts = [t.get("response_text") or "" for t in turns]
    calls = [(c.get("name"), c.get("arguments")) for c in tool_calls]
    most_call = max((calls.count(c) for c in set(calls)), default=0)
    most_text = max((texts.count(t) for t in set(texts) if t.strip()), default=0)
    if max(most_call, most_text) >= th.tool_loop_calls:
        flags.append("tool_loop")
    if any(a.strip() and a == b for a, b in itertools.pairwise(texts)):
        flags.append("identical_turns")
    run = best = 0
    for c in tool_calls:
        run = run + 1 if c.get("error") is not None else 0
        best = max(best, run)
    if best >= th.tool_error_burst:
        flags.append("tool_error_burst")
    answer = (texts[-1] if texts else "").strip()
    if reward is not None and reward >= th.high_reward and len(answer) <= th.short_answer_chars:
        flags.append("short_answer_high_reward")
    return flags


# ---------------------------------------------------------------------------- per step
def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None



def _flags_of(row: Mapping[str, Any]) -> list[str]:
    value = row.get("flags")
    if value is None:
        return []
    if isinstance(value, str):
        value = json.loads(value) if value.startswith("[") else value.split(",")
    return [str(v) for v in value]


def analyze(rows: Iterable[Mapping[str, Any]], th: HealthThresholds | None = None,
            earned_by: str | None = None) -> Health:  # fmt: skip
    """Health of a run from its trajectory rows (dicts with the export's ``trajectories``
    columns; ``flags`` holds each row's trajectory flags); ``earned_by``: the reward part that
    says correct (default ``accuracy``; one that no row has raises
    :class:`~tracer.readers.habits.earned.UnknownPart`)."""
    from tracer.readers.habits.earned import check_rows, correctness, unearned_flags

    th = th or HealthThresholds()
    health = Health()
    rows = list(rows)
    check_rows(rows, earned_by)  # a part no trajectory has is a typo: UnknownPart
    flags = unearned_flags(rows, earned_by)
    unearned = {str(r["trace_id"]) for r, bad in zip(rows, flags, strict=True) if bad}
    # steps whose rows have correctness and a reward, none judged: no correct answer to go by
    seen: dict[tuple[bool, Any], bool] = {}
    for r, bad in zip(rows, flags, strict=True):
        key = (bool(r.get("validate")), r.get("step"))
        if correctness(r, earned_by) is not None and num(r.get("reward")) is not None:
            seen[key] = seen.get(key, False) or bad is not None
    health.not_judged = sorted((k for k, ok in seen.items() if not ok),
                               key=lambda k: (k[0], num(k[1]) or 0))  # fmt: skip
    by_step: dict[tuple[bool, Any], list[Mapping[str, Any]]] = defaultdict(list)
    for row in rows:
        trace_id = str(row["trace_id"])
        health.step_of[trace_id] = row.get("step")
        health.by_trace[trace_id] = [f for f in _flags_of(row) if f in TRAJECTORY_FLAGS]
        by_step[(bool(row.get("validate")), row.get("step"))].append(row)
    baseline: dict[bool, dict[str, float | None]] = {}
    for (validate, step), members in sorted(by_step.items(), key=lambda kv: (kv[0][0],
                                            num(kv[0][1]) or 0)):  # fmt: skip
        stats = _step_stats(members)
        base = baseline.setdefault(validate, stats)
        for flag in _step_rules(members, stats, base, th, unearned):
            flag.step, flag.validate = step, validate
            health.steps.append(flag)
            for trace_id in flag.trace_ids:
                names = health.by_trace.setdefault(trace_id, [])
                if flag.name not in names:
                    names.append(flag.name)
    for names in health.by_trace.values():
        names.sort(key=FLAGS.index)
    health.by_trace = {t: n for t, n in health.by_trace.items() if n}
    return health


def _pairs(members: list[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    return [(str(r["trace_id"]), r) for r in members]


def _step_stats(members: list[Mapping[str, Any]]) -> dict[str, float | None]:
    lengths = [x for x in (num(r.get("response_tokens")) for r in members) if x is not None]
    rewards = [x for x in (num(r.get("reward")) for r in members) if x is not None]
    accs = [x for x in (truth(r.get("accuracy")) for r in members) if x is not None]
    groups: dict[str, list[float | None]] = defaultdict(list)
    for r in members:
        groups[str(r.get("sample_key"))].append(num(r.get("reward")))
    sized = [g for g in groups.values() if len(g) >= 2]
    zero = sum(1 for g in sized if len(set(g)) == 1) / len(sized) if sized else None
    return {"length": _mean(lengths), "reward": _mean(rewards), "accuracy": _mean(accs),
            "zero_variance": zero}  # fmt: skip


def _step_rules(
    members: list[Mapping[str, Any]],
    stats: dict[str, float | None],
    base: dict[str, float | None],
    th: HealthThresholds,
    unearned: set[str],
) -> list[StepFlag]:
    out = []
    truncated = [i for i, r in _pairs(members) if "truncated" in _flags_of(r)]
    rate = len(truncated) / len(members)
    if rate > th.truncation_rate:
        out.append(StepFlag(None, False, "truncation_rate", rate, truncated))
    length, base_length = stats["length"], base["length"]
    if length is not None and base_length:
        ratio = length / base_length
        if ratio > th.length_drift or ratio < 1 / th.length_drift:
            up = ratio > 1
            hit = [i for i, r in _pairs(members) if (n := num(r.get("response_tokens")))
                   is not None and (n > base_length * th.length_drift if up
                                    else n < base_length / th.length_drift)]  # fmt: skip
            out.append(StepFlag(None, False, "length_drift", ratio, hit))
    zero, base_zero = stats["zero_variance"], base["zero_variance"]
    if zero is not None and base_zero is not None and zero - base_zero >= th.zero_variance_rise:
        groups: dict[str, list[str]] = defaultdict(list)
        rewards: dict[str, set[float | None]] = defaultdict(set)
        for i, r in _pairs(members):
            groups[str(r.get("sample_key"))].append(i)
            rewards[str(r.get("sample_key"))].add(num(r.get("reward")))
        hit = [i for k, g in groups.items() if len(g) >= 2 and len(rewards[k]) == 1 for i in g]
        out.append(StepFlag(None, False, "zero_variance_rising", zero, hit))
    reward, acc, base_acc = stats["reward"], stats["accuracy"], base["accuracy"]
    no_acc = [i for i, r in _pairs(members)
              if (num(r.get("reward")) or 0) > 0 and truth(r.get("accuracy")) == 0]  # fmt: skip
    if reward and acc is not None and base_acc is not None:
        share = (reward - acc) / reward
        if share >= th.component_share and abs(acc - base_acc) <= th.flat_accuracy:
            out.append(StepFlag(None, False, "reward_without_accuracy", share, no_acc))
    hit = [i for i, _ in _pairs(members) if i in unearned]
    if members and len(hit) >= th.unearned_min and len(hit) / len(members) >= th.unearned_share:
        out.append(StepFlag(None, False, "reward_accuracy_divergence", len(hit) / len(members),
                            hit))  # fmt: skip
    out += _drop_rules(members)
    return [f for f in out if f.trace_ids]


def _drop_rules(members: list[Mapping[str, Any]]) -> list[StepFlag]:
    """``dropped_longer`` (value: the dropped share of the step's tokens) and
    ``incomplete_groups`` (value: how many), from :func:`~.timing.drops.step_drops`."""
    from tracer.readers.timing.drops import drops_line, step_drops

    d = step_drops(members)
    out = []
    line = drops_line(d)
    if d["length_bias"]:
        out.append(StepFlag(None, False, "dropped_longer", d["dropped_token_share"] or 0.0,
                            d["dropped_trace_ids"], line))  # fmt: skip
    if d["incomplete_groups"]:
        short = set(d["incomplete_group_keys"])
        dropped = set(d["dropped_trace_ids"])
        hit = [i for i, r in _pairs(members) if i in dropped
               and str(r.get("sample_key", r.get("sample_index"))) in short]  # fmt: skip
        out.append(StepFlag(None, False, "incomplete_groups", float(d["incomplete_groups"]),
                            hit, line))  # fmt: skip
    return out
