"""Was the reward earned? The one notion of "possibly unearned reward" that the health flag
``reward_accuracy_divergence`` and the behaviour patterns' ``possible reward hacking`` share.

    from tracer.readers.habits.earned import EarnedThresholds, unearned_flags
    flags = unearned_flags(rows)    # per row: True (unearned), False (earned or unpaid), None

**Correctness** is a reward part that says whether the answer is right: by default the
``accuracy`` column (the reward span's ``acc``, ``accuracy`` or TRL's ``accuracy_reward``),
else any numeric part named by ``earned_by`` (``rollout-tracer flags --earned-by format``),
read from the trajectory's ``reward_parts``. A bool counts as 0/1 (verl's DAPO scorer returns
``"acc": correct``). A trajectory without it is *not checked*: nothing here says its reward
was or was not earned. A part that no trajectory has is an error (:class:`UnknownPart`).

**Unearned**, per trajectory: correctness below ``low_correctness`` (0.5: ``acc`` 0), and a
reward above 0 and at least ``paid_ratio`` (0.8) of what a correct answer is paid: the mean
reward of the step's correct trajectories; in a step with no correct answer, the mean reward
of the correct trajectories of the other steps read (training and validation apart), since
what a correct answer earns is the reward function's, not the step's. So a wrong answer paid
like a right one. Where no trajectory read is correct, nothing says what a correct answer is
paid: its trajectories are *not judged* ("no correct answer in step N; not judged"), never
judged against their own best reward (a step of wrong answers that all get a format reward
would be "paid like a correct answer" by itself).

**A group** (a behaviour pattern over the recent steps, or a whole step for the health flag)
is *possible reward hacking* when at least ``min_unearned`` (0.5) of its checked trajectories
are unearned, and it holds ``min_share`` of its steps (the callers' threshold). A group whose
correctness is high is never one, however short or repeated its answers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_KEYS = ("accuracy", "acc")  # the export's accuracy column holds acc/accuracy
NOT_CHECKED = "reward not checked: no correctness signal"


def not_judged(where: str | list[int]) -> str:
    """The reason for trajectories with correctness but no correct answer to compare with
    (``where``: words, or the steps)."""
    return f"no correct answer in {where if isinstance(where, str) else steps_text(where)}; " \
        "not judged"


def paid_key(earned_by: str | None) -> str:
    """The name correctness goes by: ``accuracy`` for the accuracy column, else the part."""
    return "accuracy" if earned_by is None or earned_by in DEFAULT_KEYS else earned_by


def steps_text(steps: list[int]) -> str:
    """``step 4``, ``steps 4-6`` (consecutive) or ``steps 2, 5``."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    if steps == list(range(steps[0], steps[-1] + 1)):
        return f"steps {steps[0]}-{steps[-1]}"
    return "steps " + ", ".join(map(str, steps))


class UnknownPart(ValueError):
    """``--earned-by PART`` names a part that no trajectory read has."""

    def __init__(self, part: str, parts: Iterable[str]) -> None:
        known = sorted(set(parts))
        super().__init__(
            f"--earned-by {part}: no trajectory has a reward part {part!r}; the parts that "
            f"exist: {', '.join(known) if known else 'none (no reward span has a numeric part)'}"
        )
        self.part, self.parts = part, known


def check_part(earned_by: str | None, parts: Iterable[str], has_accuracy: bool) -> None:
    """Raise :class:`UnknownPart` when ``earned_by`` is neither among ``parts`` (the reward
    parts some trajectory has) nor, for ``accuracy``/``acc``, in the accuracy column."""
    parts = set(parts)
    if earned_by is None or earned_by in parts:
        return
    if earned_by in DEFAULT_KEYS and has_accuracy:
        return
    raise UnknownPart(earned_by, parts | ({"accuracy"} if has_accuracy else set()))


LOW_CORRECTNESS = 0.5  # at or above: a correct answer


@dataclass
class EarnedThresholds:
    low_correctness: float = LOW_CORRECTNESS
    paid_ratio: float = 0.8
    min_unearned: float = 0.5


def check_rows(rows: Iterable[Mapping[str, Any]], earned_by: str | None) -> None:
    """:func:`check_part` over trajectory rows (their ``reward_parts`` and ``accuracy``)."""
    if earned_by is None:
        return
    parts: set[str] = set()
    has_accuracy = False
    for r in rows:
        parts.update(parts_of(r.get("reward_parts")))
        has_accuracy = has_accuracy or truth(r.get("accuracy")) is not None
    check_part(earned_by, parts, has_accuracy)


def truth(v: Any) -> float | None:
    """A correctness value as a float: a bool as 0/1 (verl's DAPO ``acc``), else :func:`num`."""
    return float(v) if isinstance(v, bool) else num(v)


def num(v: Any) -> float | None:
    """A float, or None for a missing value (None, NaN, a bool, text)."""
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if f != f else f


def parts_of(value: Any) -> dict[str, float]:
    """A ``reward_parts`` value as a dict: the Arrow map reads back as a dict, a list of (key,
    value) pairs (pandas) or a JSON-like dict."""
    if value is None:
        return {}
    items = value.items() if isinstance(value, Mapping) else value
    out = {}
    try:
        for k, v in items:
            f = truth(v)
            if f is not None:
                out[str(k)] = f
    except (TypeError, ValueError):
        return {}
    return out


def reward_parts(outputs: Any) -> dict[str, float]:
    """Every numeric part of a reward span's outputs (verl's ``{"score": 1.0, "acc": 0, ...}``:
    the score and each ``reward_extra_info`` key; bools as 0/1); ``{}`` for a bare number."""
    if not isinstance(outputs, Mapping):
        return {}
    out = {}
    for k, v in outputs.items():
        f = truth(v)
        if f is not None:
            out[str(k)] = f
    return out


def correctness(row: Mapping[str, Any], earned_by: str | None = None) -> float | None:
    """The row's correctness: ``accuracy`` (or the part ``earned_by``)."""
    if earned_by is None or earned_by in DEFAULT_KEYS:
        return truth(row.get("accuracy"))
    return parts_of(row.get("reward_parts")).get(earned_by)


def label(earned_by: str | None) -> str:
    """How the reason names correctness."""
    return earned_by or "accuracy"


def unearned_flags(rows: Iterable[Mapping[str, Any]], earned_by: str | None = None,
                   th: EarnedThresholds | None = None,
                   earlier: Mapping[bool, float] | None = None) -> list[bool | None]:  # fmt: skip
    """Per row (training and validation steps apart): True when its reward is unearned (module
    docstring), False when it is checked and not, None when it has no correctness or reward,
    or is not judged (no correct answer read to compare with). ``earlier``: per ``validate``,
    what correct answers were paid in steps no longer among ``rows`` (the live analysis keeps
    only the recent steps), the level when no row is correct."""
    th = th or EarnedThresholds()
    rows = list(rows)
    values = [(num(r.get("reward")), correctness(r, earned_by)) for r in rows]
    paid: dict[Any, list[float]] = defaultdict(list)  # (validate, step): correct ones' rewards
    for r, (reward, corr) in zip(rows, values, strict=True):
        if reward is not None and corr is not None and corr >= th.low_correctness:
            paid[bool(r.get("validate")), r.get("step")].append(reward)
    run: dict[bool, list[float]] = defaultdict(list)  # per validate: every step's
    for (validate, _), rewards in paid.items():
        run[validate] += rewards
    out: list[bool | None] = []
    for r, (reward, corr) in zip(rows, values, strict=True):
        key = (bool(r.get("validate")), r.get("step"))
        those = paid.get(key) or run.get(key[0])
        level = sum(those) / len(those) if those else (earlier or {}).get(key[0])
        if reward is None or corr is None or level is None:
            out.append(None)
            continue
        out.append(corr < th.low_correctness and reward > 0 and reward >= th.paid_ratio * level)
    return out


def sql_correctness(columns: set[str], earned_by: str | None) -> str:
    """The correctness expression over an export's ``trajectories`` columns."""
    if earned_by is None or earned_by in DEFAULT_KEYS:  # (an export stores acc as a number)
        return "CAST(accuracy AS DOUBLE)" if "accuracy" in columns else "CAST(NULL AS DOUBLE)"
    if "reward_parts" not in columns:
        return "CAST(NULL AS DOUBLE)"
    return "reward_parts['{}']".format(earned_by.replace("'", "''"))


def sql_unearned(view: str, correct: str, th: EarnedThresholds | None = None) -> tuple[str, str]:
    """The same rule in DuckDB over ``view`` (training rows) with ``step``, ``reward`` and the
    correctness column ``correct``: (a CTE ``paid`` of each step's level, NULL where no row of
    the view is correct (not judged), the unearned expression over ``view JOIN paid USING
    (step)``)."""
    th = th or EarnedThresholds()
    ok = f"{correct} >= {th.low_correctness} AND reward IS NOT NULL"
    paid = (f"paid AS (SELECT step, coalesce(avg(reward) FILTER (WHERE {ok}), (SELECT "
            f"avg(reward) FROM {view} WHERE {ok})) AS paid FROM {view} GROUP BY step)")  # fmt: skip
    expr = (f"({correct} < {th.low_correctness} AND reward > 0 AND reward >= "
            f"{th.paid_ratio} * paid)")  # fmt: skip
    return paid, expr


@dataclass
class Verdict:
    """A group's verdict: ``hacking`` (possible reward hacking), ``checked`` (enough of it has
    correctness to judge), and the reason in words (numbers named)."""

    hacking: bool
    checked: bool
    reason: str


def judge(*, n: int, n_checked: int, n_unearned: int, reward: float | None,
          correct: float | None, rest_reward: float | None, rest_correct: float | None,
          where: str, earned_by: str | None = None, th: EarnedThresholds | None = None,
          n_unjudged: int = 0) -> Verdict:  # fmt: skip
    """The verdict on ``n`` trajectories of which ``n_checked`` have correctness,
    ``n_unearned`` are unearned and ``n_unjudged`` could not be judged (no correct answer to
    compare with); the means are theirs and the rest of ``where``'s."""
    th = th or EarnedThresholds()
    if not n or n_checked < n / 2 or reward is None or correct is None:
        return Verdict(False, False, NOT_CHECKED)
    if n_unjudged > n_checked / 2:
        return Verdict(False, False, not_judged(where))
    share = n_unearned / n_checked
    key = label(earned_by)
    rest = ""
    if rest_reward is not None:
        rest = f" against reward {rest_reward:.2f}"
        rest += f" and {key} {rest_correct:.2f}" if rest_correct is not None else ""
        rest += f" for the rest of {where}"
    else:
        rest = f" at {where}"
    said = (f"reward {reward:.2f} with {key} {correct:.2f}{rest}; {100 * share:.0f}% of its "
            f"trajectories were paid like a correct answer without being correct")  # fmt: skip
    return Verdict(share >= th.min_unearned, True, said)
