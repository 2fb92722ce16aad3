"""Where a rollout's time goes: one trajectory's wall time cut into parts, and a step's tail.

A trajectory's wall time (its root span) is cut into ``generate``, ``tool`` (per tool name),
``reward``, ``other`` (parse, interaction, ...) and ``gap`` (no span open: queueing, the engine's
scheduling, the agent loop's own code). Each instant goes to exactly one part, the most specific
span open then (a tool call over a generate call over a reward over the rest), so the parts add
up to the wall time exactly, even when spans overlap (parallel tool calls: an instant two of
them share goes to the one that opened first, whatever order the spans are listed in). The span
that made the trajectory slow is the one with the longest own work: its time less what its
children cover, so a leaf (a tool call: its name and arguments; a generate call: its token
count), or a reward's own work, never a helper span that only waits on a tool call or a reward
that only waits on an LLM judge. When the time with no span open outweighs it, the slow part is
``gap``, and no span is named.

Per step (:func:`step_summaries`): the wall-time distribution (p50, p90, p99, max), the tail
ratio p99/p50, how long the step waited for its last trajectory after the 90th percentile had
finished, the parts' shares of the summed wall time, and the stragglers: trajectories over
``STRAGGLER_FACTOR`` times the step's median (and ``STRAGGLER_MIN_EXCESS_MS`` over it), slowest
first, each with its slow span. The same functions serve stored records (the export's
``trajectories`` columns and ``steps`` table, the report, the explorer) and trajectories the
rollout holds in memory (``rollout-tracer run``'s ``timing/*`` tracker metrics).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from tracer.readers.timing.drops import step_drops
from tracer.snapshot import plain

PARTS = ("generate", "tool", "reward", "other", "gap")
# which span an instant belongs to when several are open: the most specific work wins
_PRIORITY = {"tool": 4, "generate": 3, "reward": 2}
_CONTAINERS = frozenset({"trajectory"})  # nested agent-loop spans: covered by their children
STRAGGLER_FACTOR = 3.0
STRAGGLER_MIN_EXCESS_MS = 25.0
_DETAIL_CHARS = 300
GAP_DETAIL = "no span open: the loop's own code, queueing, scheduling"


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
    count until ``end_ns``. Cost: n log n in the spans (sorts and a heap)."""
    end_ns = max(end_ns, start_ns)
    spans = [s for s in spans if s.kind not in _CONTAINERS]  # covered by their children
    ends = [s.end_ns or end_ns for s in spans]
    parts, by_tool = _attribute(start_ns, end_ns, spans, ends)
    out: dict[str, Any] = {f"{k}_ms": v / 1e6 for k, v in parts.items()}
    out["tool_ms_by_name"] = json.dumps({k: v / 1e6 for k, v in sorted(by_tool.items())})
    slow, own_ns = _slow_span(spans, ends)
    if slow is None or parts["gap"] > own_ns:
        # the time between spans outweighs any span's own work: name the gap, not a span
        gap = parts["gap"]
        out.update(slow_span_id=None, slow_span_kind="gap" if gap else None,
                   slow_span_name="gap" if gap else None,
                   slow_span_detail=GAP_DETAIL if gap else None,
                   slow_span_ms=gap / 1e6 if gap else None)  # fmt: skip
        return out
    sid = slow.span_id
    out.update(
        slow_span_id=f"{sid:016x}" if isinstance(sid, int) else sid,
        slow_span_kind=slow.kind,
        slow_span_name=tool_name(slow) if slow.kind == "tool" else slow.name,
        slow_span_detail=span_detail(slow),
        slow_span_ms=own_ns / 1e6,
    )
    return out


def _attribute(start_ns: int, end_ns: int, spans: list[Any], ends: list[int]
               ) -> tuple[dict[str, int], dict[str, int]]:  # fmt: skip
    """Each instant of [start_ns, end_ns) to one part: the open span of the highest priority,
    the earliest opened among equals; an instant no span covers is ``gap``. When no two spans
    overlap (a sequential agent loop: generate, parse, tool, ... one after the other, the usual
    case) each span has its whole clipped time and the rest is gap; otherwise a sweep
    (:func:`_sweep`)."""
    opens: list[tuple[int, int, int, int, int]] = []  # (from, -priority, open time, index, to)
    for i, span in enumerate(spans):
        a = span.start_ns if span.start_ns > start_ns else start_ns
        b = ends[i] if ends[i] < end_ns else end_ns
        if b > a:
            opens.append((a, -_PRIORITY.get(span.kind, 1), span.start_ns, i, b))
    opens.sort()
    if all(x[4] <= y[0] for x, y in itertools.pairwise(opens)):  # none overlaps the next
        time_of = {o[3]: o[4] - o[0] for o in opens}
        return _parts(spans, time_of, end_ns - start_ns - sum(time_of.values()))
    return _sweep(start_ns, end_ns, spans, opens)


def _sweep(start_ns: int, end_ns: int, spans: list[Any],
           opens: list[tuple[int, int, int, int, int]]
           ) -> tuple[dict[str, int], dict[str, int]]:  # fmt: skip
    """:func:`_attribute` over overlapping spans (``opens``: its sorted clipped spans): a
    sweep over the sorted boundaries with a heap of the open spans (ended ones leave it when
    they reach the top), so the cost is n log n, not n per boundary."""
    points = sorted({start_ns, end_ns, *(o[0] for o in opens), *(o[4] for o in opens)})
    time_of: dict[int, int] = {}  # span index -> the time it won (a span, not a part, per entry)
    gap = 0
    heap: list[tuple[int, int, int, int]] = []  # (-priority, open time, index, to)
    nxt, n = 0, len(opens)
    push, pop = heapq.heappush, heapq.heappop
    for a, b in itertools.pairwise(points):
        while nxt < n and opens[nxt][0] <= a:
            _, prio, opened, i, to = opens[nxt]
            push(heap, (prio, opened, i, to))
            nxt += 1
        while heap and heap[0][3] <= a:
            pop(heap)
        if heap:
            i = heap[0][2]
            time_of[i] = time_of.get(i, 0) + b - a
        else:
            gap += b - a
    return _parts(spans, time_of, gap)


def _parts(spans: list[Any], time_of: dict[int, int], gap: int
           ) -> tuple[dict[str, int], dict[str, int]]:  # fmt: skip
    """The parts' ns and each tool's, from the ns each span won (``time_of``: span index ->
    ns) and the gap."""
    parts = {"generate": 0, "tool": 0, "reward": 0, "other": 0, "gap": gap}
    by_tool: dict[str, int] = {}
    for i, ns in time_of.items():
        part = _part(spans[i])
        if part.startswith("tool:"):
            parts["tool"] += ns
            by_tool[part[5:]] = by_tool.get(part[5:], 0) + ns
        else:
            parts[part] += ns
    return parts, by_tool


def _slow_span(spans: list[Any], ends: list[int]) -> tuple[Any, int]:
    """The span with the longest own work: its duration less the time its children cover (a
    leaf's own time is its duration; a reward that waits on an LLM judge owns only the rest;
    a helper span around a tool call owns almost nothing). Ties go to the span that opened
    first. Returns (span or None, own ns)."""
    children: dict[Any, list[tuple[int, int]]] = {}
    for i, span in enumerate(spans):
        children.setdefault(span.parent_id, []).append((span.start_ns, ends[i]))
    slow: Any = None
    best_own, best_start = -1, 0
    for i, span in enumerate(spans):
        a, b = span.start_ns, ends[i]
        own = b - a if b > a else 0
        kids = children.get(span.span_id)
        if kids:
            own -= _covered(kids, a, b)
        if own > best_own or (own == best_own and a < best_start):
            slow, best_own, best_start = span, own, a
    return slow, best_own if slow is not None else 0


def _covered(intervals: list[tuple[int, int]], lo: int, hi: int) -> int:
    """How much of [lo, hi) the union of ``intervals`` covers."""
    total, reach = 0, lo
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, hi)
        if b > a:
            total += b - a
            reach = b
    return total


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
    kind = row.get("slow_span_kind")
    if not kind or kind == "gap" or _num(row.get("gap_ms")) > _num(row.get("slow_span_ms")):
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
    gap = top is not None and cause(top) == "gap"  # no span to point at
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
        "top_straggler_detail": (GAP_DETAIL if gap else top.get("slow_span_detail")) if top
                                else None,
        "top_straggler_span_id": top.get("slow_span_id") if top and not gap else None,
        "top_straggler_ms": _num(top.get("latency_ms")) if top else None,
        **step_drops(rows),  # what the step lost (timing/drops.py)
        "straggler_list": [dict(r) for r in slow],  # all of them: readers decide what to show
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
    m["timing/dropped"] = float(summary.get("dropped") or 0)
    m["timing/incomplete_groups"] = float(summary.get("incomplete_groups") or 0)
    if summary.get("dropped_token_share") is not None:
        m["timing/dropped_token_share"] = float(summary["dropped_token_share"])
    return m
