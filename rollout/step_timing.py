"""Per-step ``timing/*`` tracker metrics of ``rollout-tracer run``: where the step's time went
(wall-time percentiles, tail ratio, the wait for the last trajectory, generate/tool/reward/gap
shares, a share per tool, stragglers), computed by the reader
(:func:`~.breakdown.step_summaries`) from the spans of the step's own trajectories,
which the worker cut into parts as each ended (``out.extra["timing"]``, rollout/worker.py), so
the numbers a tracker shows during the run are those the export's ``steps`` table holds."""

from __future__ import annotations

from typing import Any

from tracer.readers.timing.breakdown import step_summaries, tracker_metrics


def step_timing(result: Any) -> dict[str, float]:
    """``timing/*`` of one step's result; empty when its trajectories were not traced."""
    rows = [out.extra["timing"] for out in result.outputs if "timing" in out.extra]
    for summary in step_summaries(rows):
        if summary["step"] == int(result.step) and not summary["validate"]:
            return tracker_metrics(summary)
    return {}
