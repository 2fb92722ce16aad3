"""Where a rollout's time goes: one trajectory's wall time cut into parts, and a step's tail.

A trajectory's wall time (its root span) is cut into ``generate``, ``tool`` (per tool name),
``reward``, ``other`` (parse, interaction, ...) and ``gap`` (no span open: queueing, the engine's
scheduling, the agent loop's own code). Each instant goes to exactly one part, the most specific
span open then (a tool call over a generate call over a reward over the rest), so the parts add
up to the wall time exactly, even when spans overlap (parallel tool calls: an instant two of
them share goes to the one that opened first). The span that made
the trajectory slow is its longest leaf span: a tool call (its name and arguments) or a generate
call (its token count).

Per step (:func:`step_summaries`): the wall-time distribution (p50, p90, p99, max), the tail
ratio p99/p50, how long the step waited for its last trajectory after the 90th percentile had
finished, the parts' shares of the summed wall time, and the stragglers: trajectories over
``STRAGGLER_FACTOR`` times the step's median (and ``STRAGGLER_MIN_EXCESS_MS`` over it), slowest
first, each with its slow span. The same functions serve stored records (the export's
``trajectories`` columns and ``steps`` table, the report, the explorer) and trajectories the
rollout holds in memory (``rollout-tracer run``'s ``timing/*`` tracker metrics).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from tracer.snapshot import plain

PARTS = ("generate", "tool", "reward", "other", "gap")
# which span an instant belongs to when several are open: the most specific work wins
_PRIORITY = {"tool": 4, "generate": 3, "reward": 2}
_CONTAINERS = frozenset({"trajectory"})  # nested agent-loop spans: covered by their children
STRAGGLER_FACTOR = 3.0
STRAGGLER_MIN_EXCESS_MS = 25.0
MAX_STRAGGLERS = 5  # per step
_DETAIL_CHARS = 300



def tool_name(span: Any) -> str:
    """A tool span's tool: the ``tool_name`` attribute, else its ``name`` argument, else the
    span's name."""
    attrs = getattr(span, "attributes", None) or {}
    name = attrs.get("tool_name")
    inputs = getattr(span, "inputs", None)
    if name is None and isinstance(inputs, dict):
        name = inputs.get("name", inputs.get("tool_name"))
    return str(plain(name) if name is not None else span.name)


def _part(span: Any) -> str:
    kind = span.kind
    if kind in ("generate", "reward"):
        return str(kind)
    if kind == "tool":
        return "tool:" + tool_name(span)
    return "other"


def span_detail(span: Any) -> str:
    """What a slow span did: a tool call's arguments (JSON), a generate call's token count."""
    if span.kind == "tool":  # (a generate call's inputs, its prompt ids, are not decoded)
        inputs = plain(getattr(span, "inputs", None))
        args = inputs.get("arguments", inputs) if isinstance(inputs, dict) else inputs
        text = json.dumps(args, ensure_ascii=False, default=str, sort_keys=True)
        return text if len(text) <= _DETAIL_CHARS else text[: _DETAIL_CHARS - 1] + "…"
    if span.kind == "generate":
        attrs = getattr(span, "attributes", None) or {}
        n = attrs.get("response_tokens")
        if n is None:
            out = plain(getattr(span, "outputs", None))
            ids = out.get("response_ids", out.get("token_ids")) if isinstance(out, dict) else None
            n = len(ids) if isinstance(ids, list) else None
        return f"{n} tokens" if n is not None else ""
    return ""


def breakdown(start_ns: int, end_ns: int, spans: Iterable[Any]) -> dict[str, Any]:
    """One trajectory's parts in ms (``generate_ms``, ``tool_ms``, ``reward_ms``, ``other_ms``,
    ``gap_ms``, ``tool_ms_by_name``) adding up to ``end_ns - start_ns``, and its slow span
    (``slow_span_id``, ``_kind``, ``_name``, ``_detail``, ``_ms``). Spans still open (no end)
    count until ``end_ns``."""
    end_ns = max(end_ns, start_ns)
    intervals: list[tuple[int, int, int, str]] = []
    slow: Any = None
    slow_ns = -1
    for span in spans:
        if span.kind in _CONTAINERS:
            continue
        s_end = span.end_ns or end_ns
        a, b = max(span.start_ns, start_ns), min(s_end, end_ns)
        if b > a:
            part = _part(span)
            intervals.append((a, b, _PRIORITY.get(part.split(":", 1)[0], 1), part))
        if s_end - span.start_ns > slow_ns:
            slow, slow_ns = span, s_end - span.start_ns
    parts = {"generate": 0, "tool": 0, "reward": 0, "other": 0, "gap": 0}
    by_tool: dict[str, int] = {}
    points = sorted({start_ns, end_ns, *(p for a, b, _, _ in intervals for p in (a, b))})
    for a, b in itertools.pairwise(points):
        best: tuple[int, str] | None = None
        for s, e, prio, part in intervals:
            if s <= a and e >= b and (best is None or prio > best[0]):
                best = (prio, part)
        if best is None:
            parts["gap"] += b - a
        elif best[1].startswith("tool:"):
            parts["tool"] += b - a
            by_tool[best[1][5:]] = by_tool.get(best[1][5:], 0) + b - a
        else:
            parts[best[1]] += b - a
    out: dict[str, Any] = {f"{k}_ms": v / 1e6 for k, v in parts.items()}
    out["tool_ms_by_name"] = json.dumps({k: v / 1e6 for k, v in sorted(by_tool.items())})
    sid = getattr(slow, "span_id", None)
    out.update(
        slow_span_id=(f"{sid:016x}" if isinstance(sid, int) else sid) if slow is not None else None,
        slow_span_kind=slow.kind if slow is not None else None,
        slow_span_name=(tool_name(slow) if slow.kind == "tool" else slow.name)
        if slow is not None else None,
        slow_span_detail=span_detail(slow) if slow is not None else None,
        slow_span_ms=slow_ns / 1e6 if slow is not None else None,
    )  # fmt: skip
    return out


def record_timing(record: Any) -> dict[str, Any]:
    """:func:`breakdown` of a stored :class:`~tracer.record.TrajectoryRecord`."""
    root = record.root
    return breakdown(root.start_ns, root.end_ns, [s for s in record.spans if s is not root])


def trajectory_timing(traj: Any) -> dict[str, Any]:
    """:func:`breakdown` of a finished in-memory trajectory (``with trace_attr(...) as traj``)
    and its identity: what ``rollout-tracer run`` keeps per trajectory for its tracker
    metrics. Read after the trajectory ended; it only reads the spans (not the trace id, which
    the background may be fixing at that moment)."""
    out = breakdown(traj.start_ns, traj.end_ns, list(traj.spans))
    out.update(step=traj.step, validate=bool(traj.validate), sample_index=traj.sample_index,
               rollout_n=traj.rollout_n, latency_ms=(traj.end_ns - traj.start_ns) / 1e6,
               end_ns=traj.end_ns)  # fmt: skip
    return out


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), ``q`` in [0, 100]."""
    if not sorted_values:
        return math.nan
    k = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def _end_ns(row: Mapping[str, Any]) -> float | None:
    if row.get("end_ns") is not None:
        return float(row["end_ns"])
    start = row.get("start_time")
    if start is None or row.get("latency_ms") is None:
        return None
    try:
        if isinstance(start, int):  # the export's rows before Arrow: microseconds
            return start * 1e3 + float(row["latency_ms"]) * 1e6
        return float(start.timestamp()) * 1e9 + float(row["latency_ms"]) * 1e6
    except (AttributeError, TypeError, ValueError):
        return None


def _num(value: Any) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        return 0.0
    return 0.0 if math.isnan(f) else f


def cause(row: Mapping[str, Any]) -> str:
    """``tool python``, ``generate generate``, ``gap``: what made a trajectory slow. Its slow
    span, unless the time between spans outweighs it."""
    if _num(row.get("gap_ms")) > _num(row.get("slow_span_ms")) or not row.get("slow_span_kind"):
        return "gap"
    return f"{row['slow_span_kind']} {row.get('slow_span_name')}"


def step_summaries(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per (step, validate) of trajectory rows (the export's, or
    :func:`trajectory_timing`'s): the columns of the export's ``steps`` table, with
    ``straggler_list`` (the stragglers' rows, slowest first) besides."""
    groups: dict[tuple[Any, bool], list[Mapping[str, Any]]] = {}
    for row in rows:
        step = row.get("step")
        if step is None or (isinstance(step, float) and math.isnan(step)):
            continue
        groups.setdefault((int(step), bool(row.get("validate"))), []).append(row)
    return [_summary(step, validate, rs) for (step, validate), rs in sorted(groups.items())]


def _summary(step: int, validate: bool, rows: list[Mapping[str, Any]]) -> dict[str, Any]:
    walls = sorted(_num(r.get("latency_ms")) for r in rows)
    p50, p90, p99 = (percentile(walls, q) for q in (50, 90, 99))
    ends = sorted(e for r in rows if (e := _end_ns(r)) is not None)
    total = sum(walls)
    parts = {p: sum(_num(r.get(f"{p}_ms")) for r in rows) for p in PARTS}
    by_tool: dict[str, float] = {}
    for r in rows:
        for name, ms in json.loads(r.get("tool_ms_by_name") or "{}").items():
            by_tool[name] = by_tool.get(name, 0.0) + float(ms)
    slow = [r for r in rows if _num(r.get("latency_ms")) >= STRAGGLER_FACTOR * p50
            and _num(r.get("latency_ms")) - p50 >= STRAGGLER_MIN_EXCESS_MS]  # fmt: skip
    slow.sort(key=lambda r: -_num(r.get("latency_ms")))
    top = slow[0] if slow else None
    return {
        "step": step,
        "validate": validate,
        "trajectories": len(rows),
        "wall_p50_ms": p50,
        "wall_p90_ms": p90,
        "wall_p99_ms": p99,
        "wall_max_ms": walls[-1],
        "tail_ratio": p99 / p50 if p50 > 0 else None,
        "tail_wait_ms": (ends[-1] - percentile(ends, 90)) / 1e6 if ends else None,
        **{f"{p}_share": (parts[p] / total if total > 0 else None) for p in PARTS},
        "tool_shares": json.dumps({k: v / total for k, v in sorted(by_tool.items())} if total
                                  else {}),
        "stragglers": len(slow),
        "top_straggler_trace_id": top.get("trace_id") if top else None,
        "top_straggler_cause": cause(top) if top else None,
        "top_straggler_detail": top.get("slow_span_detail") if top else None,
        "top_straggler_span_id": top.get("slow_span_id") if top else None,
        "top_straggler_ms": _num(top.get("latency_ms")) if top else None,
        "straggler_list": [dict(r) for r in slow[:MAX_STRAGGLERS]],
    }  # fmt: skip


def tracker_metrics(summary: Mapping[str, Any]) -> dict[str, float]:
    """A step summary as ``timing/*`` tracker metrics (seconds and fractions)."""
    m: dict[str, float] = {}
    for q in ("p50", "p90", "p99", "max"):
        m[f"timing/wall_{q}_s"] = _num(summary.get(f"wall_{q}_ms")) / 1e3
    for key in ("tail_ratio",):
        if summary.get(key) is not None:
            m[f"timing/{key}"] = float(summary[key])
    if summary.get("tail_wait_ms") is not None:
        m["timing/tail_wait_s"] = float(summary["tail_wait_ms"]) / 1e3
    for p in PARTS:
        if summary.get(f"{p}_share") is not None:
            m[f"timing/{p}_share"] = float(summary[f"{p}_share"])
    for name, share in json.loads(summary.get("tool_shares") or "{}").items():
        m[f"timing/tool_share/{name}"] = float(share)
    m["timing/stragglers"] = float(summary.get("stragglers") or 0)
    return m
