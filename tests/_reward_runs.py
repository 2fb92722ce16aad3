"""Reward outputs of real reward functions traced the way a rollout traces them: one trajectory
per answer, its reward op returning what the framework's reward step returns (verl's reward
manager: ``{"score": ..., **reward_extra_info}``; tracer.trl: one value per reward function
and ``score``), written to JSONL by the tracer and read back through the readers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tracer


def trace_rewards(path: Path, answers: Sequence[tuple[int, int, str, Mapping[str, Any]]]) -> str:
    """``answers``: (step, sample_index, the answer's text, the reward op's output); rollout_n
    numbers the answers of one (step, sample_index). Returns the JSONL path."""
    tracer.init(backend="jsonl", jsonl_path=str(path), raise_internal_errors=True,
                max_samples_per_step_per_worker=10_000)  # fmt: skip

    @tracer.trace_op(kind="reward")
    def compute_score(solution_str: str, output: Mapping[str, Any]) -> dict[str, Any]:
        return dict(output)

    seen: dict[tuple[int, int], int] = {}
    for step, sample, text, output in answers:
        n = seen[step, sample] = seen.get((step, sample), -1) + 1
        with tracer.trace_attr(step=step, sample_index=sample, rollout_n=n,
                               reward=float(output["score"])):  # fmt: skip
            compute_score(text, output)
    assert tracer.flush(30)
    tracer.shutdown()
    return str(path)


def rows_of(jsonl: str) -> list[dict[str, Any]]:
    """The export's trajectory rows of the traced run (``tracer.readers``, no DuckDB)."""
    from tracer.readers import read_tables

    return list(read_tables("jsonl", path=jsonl).trajectories.to_dict("records"))


def verdicts(rows: list[dict[str, Any]], earned_by: str | None = None) -> dict[str, Any]:
    """What the readers conclude: health (flags, notes) and the patterns' summary, by the
    Python grouping the live analysis uses."""
    from tracer.readers.habits.patterns import PatternThresholds, aggregate, analyze
    from tracer.readers.health import analyze as health

    th = PatternThresholds(earned_by=earned_by)
    h = health(rows, earned_by=earned_by)
    groups, totals = aggregate(rows, earned_by, th.earned, th.min_count)
    found = analyze(groups, totals, th)
    return {"flags": h.counts(), "notes": h.notes(), "summary": found.summary(),
            "unearned": found.unearned}  # fmt: skip
