"""The grouping of :mod:`tracer.readers.habits.patterns` in Python, for a running job's own rows
(``rollout/step_patterns.py``): the same groups and sums as the DuckDB grouping of
:mod:`tracer.readers.habits.patterns_sql`."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from tracer.readers.habits.earned import EarnedThresholds, correctness, num, unearned_flags
from tracer.readers.habits.patterns_sql import Group, StepTotal, needs_near_dups


def aggregate(
    rows: Iterable[Mapping[str, Any]],
    earned_by: str | None = None,
    earned: EarnedThresholds | None = None,
    min_count: int = 5,
    earlier: Mapping[bool, float] | None = None,
) -> tuple[list[Group], dict[int, StepTotal]]:
    """The grouping of :func:`step_patterns` in Python, over rows with the ``trajectories``
    columns (``trace_id``, ``step``, ``validate``, ``behaviour`` (else ``signature``),
    ``signature_text``, ``reward``, ``accuracy``/``reward_parts``, ``response_tokens``/
    ``response_text``, ``num_tool_calls``, ``num_tool_errors``, ``prompt``/``sample_key``);
    ``earned_by``, ``earned`` and ``min_count`` as in
    :class:`~tracer.readers.habits.patterns.PatternThresholds` (whose defaults these are);
    ``earlier``: what correct answers were paid before these rows
    (:func:`~tracer.readers.habits.earned.unearned_flags`)."""
    from tracer.readers.habits.near_dup import SAMPLE, repeated_share

    rows = [r for r in rows if num(r.get("step")) is not None]
    val = [r for r in rows if r.get("validate")]
    rows = [r for r in rows if not r.get("validate") and (r.get("behaviour")
                                                         or r.get("signature"))]  # fmt: skip
    unearned = unearned_flags(rows, earned_by, earned, earlier)
    groups: dict[tuple[int, str], Group] = {}
    seen: dict[tuple[int, str], tuple[set[Any], set[Any]]] = {}
    answers: dict[tuple[int, str], list[tuple[str, Any, Any]]] = defaultdict(list)
    totals: dict[int, StepTotal] = {}
    for row, bad in zip(rows, unearned, strict=True):
        step = int(row["step"])
        sig = row.get("behaviour") or row["signature"]
        key = (step, str(sig))
        reward, correct = num(row.get("reward")), correctness(row, earned_by)
        length = num(row.get("response_tokens"))
        if length is None and isinstance(row.get("response_text"), str):
            length = float(len(row["response_text"]))
        g = groups.get(key)
        if g is None:
            text = sig if row.get("behaviour") else row.get("signature_text")
            g = groups[key] = Group(step, key[1], str(text or ""), example=str(row["trace_id"]),
                                    template=str(row.get("signature_text") or ""))  # fmt: skip
            seen[key] = (set(), set())
        total = totals.setdefault(step, StepTotal(step))
        for acc in (g, total):
            acc.add(reward, length, correct, bad)
        g.calls += int(num(row.get("num_tool_calls")) or 0)
        total.calls += int(num(row.get("num_tool_calls")) or 0)
        g.errors += int(num(row.get("num_tool_errors")) or 0)
        if str(row["trace_id"]) < g.example:
            g.example, g.template = str(row["trace_id"]), str(row.get("signature_text") or "")
        prompt = row.get("prompt") if row.get("prompt") is not None else row.get("sample_key")
        for values, value in zip(seen[key], (prompt, row.get("response_text")), strict=True):
            if value is not None:  # as SQL's count(DISTINCT ...) FILTER (... IS NOT NULL)
                values.add(value)
        answers[key].append((str(row["trace_id"]), prompt, row.get("response_text")))
    for key, g in groups.items():
        g.prompts, g.answers = len(seen[key][0]), len(seen[key][1])
        if needs_near_dups(g, totals[key[0]], min_count):
            # the sample DuckDB reads: the first answers by trace id
            sample = sorted(answers[key], key=lambda a: a[0])[:SAMPLE]
            g.repeated = repeated_share([(p, t) for _, p, t in sample])
    _validation(val, totals)
    return list(groups.values()), totals


def _validation(rows: list[Mapping[str, Any]], totals: dict[int, StepTotal]) -> None:
    """Each validation pass's reward over the prompts every pass has (as patterns_sql)."""
    by_step: dict[int, list[tuple[Any, float | None]]] = defaultdict(list)
    for r in rows:
        prompt = r.get("prompt") if r.get("prompt") is not None else r.get("sample_key")
        by_step[int(r["step"])].append((prompt, num(r.get("reward"))))
    prompts = [{p for p, _ in v if p is not None} for v in by_step.values()]
    common = set.intersection(*prompts) if prompts else set()
    for step, values in by_step.items():
        t = totals.setdefault(step, StepTotal(step))
        paid = [v for p, v in values if p in common and v is not None]
        t.val_n, t.val_sum, t.val_sq = len(paid), sum(paid), sum(v * v for v in paid)
