"""The live per-step analysis: the numbers a trainer's trackers show every step, computed once,
by the tracer, from every trajectory its processing thread builds (the sampled ones; all of
them with keep rules), never on the rollout's thread.

    import tracer
    tracer.step_metrics(3)          # this process: {"patterns/unearned_reward_share": 0.0, ...}

    part = tracer.live.partial(3)   # in each worker: plain JSON data
    m = tracer.live.metrics(tracer.live.merge(parts))  # in the driver: the same numbers, all

What it holds, per step (tracer/live/row.py: one small row per trajectory, the export's own
columns made by the export's own functions):

- **behaviour groups and the earned-reward share** (``patterns/*``): the readers' grouping
  (:func:`tracer.readers.habits.patterns_py.aggregate`) and rules
  (:func:`tracer.readers.habits.patterns.analyze`) over the step and the steps before it that
  the rules look back over, so a step is flagged here when ``rollout-tracer flags`` flags it
  afterwards;
- **where the step's time went** (``timing/*``):
  :func:`tracer.readers.timing.breakdown.step_summaries`;
- **stuck rollouts** (``tracer/stuck_trajectories``: the watchdog's, every rollout, sampled
  or not) and **the tracer's own counters** (``tracer/*``).

A partial merges across processes: rows are concatenated (a trace id counted once), and
counters are kept per process (the latest step's of each: a process's counters are running
totals) and added up (``*_alive`` the smallest, ``*_per_*`` and ``durability_lag_s`` the
largest) only by :func:`metrics`, which is where shares are made: never before merging.
Memory is bounded: ``live_steps`` steps per process (default 16), 4,096 rows a step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

VERSION = 1
_MAX = ("tracer/durability_lag_s",)


def _process_entry(step: int, counters: Mapping[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = {"step": step, "sum": {}, "max": {}, "min": {}}
    for key, value in counters.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        how = "min" if key.endswith("_alive") else "max" if (
            key in _MAX or "_per_" in key) else "sum"  # fmt: skip
        entry[how][key] = value
    return entry


def partial(step: int, *, validate: bool = False, history: bool = True,
            timeout_s: float = 10.0) -> dict[str, Any]:  # fmt: skip
    """This process's part of ``step`` (``validate``: its validation pass), plain JSON-able
    data that :func:`merge` combines with other processes'. It first waits (at most
    ``timeout_s``) until the trajectories finished so far are processed (not exported).
    ``history=False`` leaves out the earlier steps the rules look back over: for a driver that
    merges every step's parts into what it kept (``merge([kept, *parts])``)."""
    from tracer.core import get_tracer

    t = get_tracer()
    pipeline = t.pipeline
    rows: list[dict[str, Any]] = []
    if pipeline is not None:
        pipeline.processed(timeout_s)
        if pipeline.live is not None:
            rows = pipeline.live.rows(int(step), history)
    worker = str(t.config.worker_id)
    return {"version": VERSION, "step": int(step), "validate": bool(validate), "rows": rows,
            "processes": {worker: _process_entry(int(step), t.metrics())}}  # fmt: skip


def merge(parts: Iterable[Mapping[str, Any]], keep_steps: int = 16) -> dict[str, Any]:
    """One partial of several processes' (or of earlier merges): the latest step of them,
    every trajectory once, each process's latest counters; rows of steps older than the last
    ``keep_steps`` are let go."""
    parts = list(parts)
    if not parts:
        raise ValueError("tracer.live.merge needs at least one partial")
    step = max(int(p["step"]) for p in parts)
    rows: list[dict[str, Any]] = []
    seen: set[Any] = set()
    processes: dict[str, dict[str, Any]] = {}
    for p in parts:
        for row in p.get("rows") or ():
            tid = row.get("trace_id")
            if tid not in seen:
                seen.add(tid)
                rows.append(row)
        for name, entry in (p.get("processes") or {}).items():
            if name not in processes or entry["step"] >= processes[name]["step"]:
                processes[name] = entry
    kept = sorted({int(r["step"]) for r in rows if int(r["step"]) <= step})[-keep_steps:]
    rows = [r for r in rows if kept and kept[0] <= int(r["step"]) <= step]
    return {"version": VERSION, "step": step, "validate": bool(parts[0].get("validate")),
            "rows": rows, "processes": processes}  # fmt: skip


def _counters(part: Mapping[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for entry in (part.get("processes") or {}).values():
        for key, value in entry.get("sum", {}).items():
            out[key] = out.get(key, 0.0) + float(value)
        for key, value in entry.get("max", {}).items():
            out[key] = max(out.get(key, float(value)), float(value))
        for key, value in entry.get("min", {}).items():
            out[key] = min(out.get(key, float(value)), float(value))
    return out


def _patterns(part: Mapping[str, Any], thresholds: Any = None) -> Any:
    """The pattern rules' verdict on the part's step (None: no training trajectory in it)."""
    from tracer.readers.habits.patterns import PatternThresholds, aggregate, analyze

    th = thresholds or PatternThresholds()
    step = int(part["step"])
    first = step - (th.window + th.smooth)  # the rules look no further back
    rows = [r for r in part.get("rows") or () if first < int(r["step"]) <= step]
    groups, totals = aggregate(rows, th.earned_by, th.earned, th.min_count)
    if step not in totals or not totals[step].n:
        return None
    return analyze(groups, totals, th, last_only=True)


def metrics(part: Mapping[str, Any], thresholds: Any = None) -> dict[str, float]:
    """A (merged) partial as tracker numbers: ``patterns/*`` (training steps), ``timing/*``,
    ``tracer/*`` (``tracer/stuck_trajectories`` among them); ``thresholds``: the pattern
    rules' (:class:`~tracer.readers.habits.patterns.PatternThresholds`)."""
    from tracer.readers.timing.breakdown import step_summaries, tracker_metrics

    step, validate = int(part["step"]), bool(part.get("validate"))
    m: dict[str, float] = {}
    if not validate:
        found = _patterns(part, thresholds)
        if found is not None:
            m.update(found.step_metrics(step))
    mine = [r for r in part.get("rows") or ()
            if int(r["step"]) == step and bool(r.get("validate")) == validate]  # fmt: skip
    for summary in step_summaries(mine):
        m.update(tracker_metrics(summary))
    m["tracer/live_step_trajectories"] = float(len(mine))
    m.update(_counters(part))
    return m


def top_pattern(part: Mapping[str, Any], thresholds: Any = None) -> str | None:
    """The step's most common behaviour in words (``"62.5% of step 3: tools: none | ..."``),
    for trackers that take text; None without training trajectories."""
    found = _patterns(part, thresholds)
    step = int(part["step"])
    top = found.top.get(step) if found is not None else None
    return f"{100 * top[0].share:.1f}% of step {step}: {top[0].text}" if top else None


def step_metrics(step: int, *, validate: bool = False, timeout_s: float = 10.0) -> dict[str, float]:
    """This process's live numbers for ``step``: ``metrics(partial(step))``. A single-process
    job (decorators, TRL on one device, ``rollout-tracer run``) logs them beside its own.

    Example::

        for step in range(steps):
            run_rollouts(step)
            logger.log(tracer.step_metrics(step), step=step)
    """
    return metrics(partial(step, validate=validate, timeout_s=timeout_s))


__all__ = ["merge", "metrics", "partial", "step_metrics", "top_pattern"]
