"""The right slow span (tracer/readers/timing/breakdown.py): the span with the longest own work,
a leaf or a reward's own time, never a helper that only waits on a tool call or a reward that
waits on an LLM judge; overlapping spans go to the one that opened first, whatever the list
order; ``gap`` is named as a gap; 10,000 spans are read right (the cost: benchmarks/bench_time.py
``--spans``)."""

from __future__ import annotations

import itertools
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest

import tracer
from tracer.readers import export
from tracer.readers.timing.breakdown import GAP_DETAIL, breakdown, step_summaries
from tracer.record import SpanRecord

pd = pytest.importorskip("pandas")
MS = 1_000_000


def _traced_row(tmp_path: Path, rollout: Any) -> Any:
    path = tmp_path / "t.jsonl"
    tracer.init(backend="jsonl", jsonl_path=str(path))
    with tracer.trace_attr(step=1, sample_index=0, rollout_n=0):
        rollout()
    assert tracer.flush(30)
    export("jsonl", str(tmp_path / "out"), path=str(path))
    return pd.read_parquet(tmp_path / "out" / "trajectories.parquet").iloc[0]


def test_a_helper_around_a_tool_call_names_the_tool(tmp_path: Path) -> None:
    @tracer.trace_op(kind="tool")
    def python(code: str) -> str:
        time.sleep(0.6)
        return "42"

    @tracer.trace_op(kind="other")
    def execute_tool_calls(calls: list[dict[str, Any]]) -> list[str]:
        return [python(c["code"]) for c in calls]

    row = _traced_row(tmp_path, lambda: execute_tool_calls([{"code": "print(6 * 7)"}]))
    assert (row["slow_span_kind"], row["slow_span_name"]) == ("tool", "python")
    assert json.loads(row["slow_span_detail"]) == {"code": "print(6 * 7)"}
    assert row["slow_span_ms"] >= 600


def test_a_reward_waiting_on_an_llm_judge_names_the_judge(tmp_path: Path) -> None:
    @tracer.trace_op(kind="generate")
    def judge(prompt_ids: list[int]) -> dict[str, Any]:
        time.sleep(0.3)
        return {"response_ids": [1, 2, 3, 4, 5]}

    @tracer.trace_op(kind="reward")
    def reward(answer: str) -> float:
        return float(len(judge([1, 2])["response_ids"]) == 5)

    row = _traced_row(tmp_path, lambda: reward("4"))
    assert (row["slow_span_kind"], row["slow_span_name"]) == ("generate", "judge")
    assert row["slow_span_detail"] == "5 tokens"
    assert row["generate_ms"] >= 300 and row["reward_ms"] < row["generate_ms"]


def _span(sid: str, kind: str, start_ms: float, end_ms: float, parent: str = "root",
          name: str | None = None) -> SpanRecord:  # fmt: skip
    return SpanRecord(sid, parent, name or sid, kind, int(start_ms * MS), int(end_ms * MS),
                      inputs={"name": name or sid, "arguments": {"id": sid}})  # fmt: skip


def test_a_reward_owns_only_its_own_work() -> None:
    spans = [_span("rw", "reward", 0, 100), _span("judge", "generate", 10, 50, parent="rw"),
             _span("tool", "tool", 100, 150)]  # fmt: skip
    out = breakdown(0, 150 * MS, spans)
    # the reward's own time is 60 ms (100 less the judge's 40): more than the tool's 50
    assert (out["slow_span_id"], out["slow_span_ms"]) == ("rw", 60)
    assert (out["reward_ms"], out["generate_ms"], out["tool_ms"]) == (60, 40, 50)


def test_overlapping_spans_go_to_the_one_that_opened_first_in_any_list_order() -> None:
    a = _span("a", "tool", 0, 100, name="python")
    b = _span("b", "tool", 40, 160, name="search")
    g = _span("g", "generate", 150, 200)
    for order in itertools.permutations([a, b, g]):
        out = breakdown(0, 200 * MS, list(order))
        assert json.loads(out["tool_ms_by_name"]) == {"python": 100, "search": 60}
        assert (out["tool_ms"], out["generate_ms"], out["gap_ms"]) == (160, 40, 0)
        assert out["slow_span_id"] == "b"  # the longest own work: 120 ms


def test_gap_is_named_as_a_gap_not_as_a_span() -> None:
    row = breakdown(0, 1000 * MS, [_span("g", "generate", 0, 100), _span("t", "tool", 900, 1000)])
    assert (row["slow_span_kind"], row["slow_span_id"], row["slow_span_ms"]) == ("gap", None, 800)
    assert row["slow_span_detail"] == GAP_DETAIL
    rows = [dict(row, trace_id="slow", step=1, latency_ms=1000.0)]
    rows += [{"trace_id": f"t{i}", "step": 1, "latency_ms": 10.0, "gap_ms": 0.0,
              "slow_span_kind": "generate", "slow_span_ms": 10.0, "slow_span_id": f"s{i}",
              "slow_span_detail": "3 tokens"} for i in range(5)]  # fmt: skip
    [summary] = step_summaries(rows)
    assert summary["top_straggler_cause"] == "gap"
    assert summary["top_straggler_span_id"] is None
    assert summary["top_straggler_detail"] == GAP_DETAIL


_PRIO = {"tool": 4, "generate": 3, "reward": 2}


def _reference(start: int, end: int, spans: list[SpanRecord]) -> tuple[dict[str, int], Any]:
    """The rules read literally, one elementary interval and one span at a time (quadratic)."""
    points = sorted({start, end, *(p for s in spans for p in (s.start_ns, s.end_ns))})
    parts = dict.fromkeys(("generate", "tool", "reward", "other", "gap"), 0)
    for a, b in itertools.pairwise(points):
        open_ = [(i, s) for i, s in enumerate(spans) if s.start_ns <= a and s.end_ns >= b]
        if not open_:
            parts["gap"] += b - a
            continue
        _, win = max(open_, key=lambda x: (_PRIO.get(x[1].kind, 1), -x[1].start_ns, -x[0]))
        parts[win.kind if win.kind in _PRIO else "other"] += b - a
    own = {}
    for s in spans:
        kids = [c for c in spans if c.parent_id == s.span_id]
        covered = sum(b - a for a, b in itertools.pairwise(points) if s.start_ns <= a
                      and b <= s.end_ns and any(c.start_ns <= a and c.end_ns >= b for c in kids))
        own[s.span_id] = s.end_ns - s.start_ns - covered  # fmt: skip
    best = max(spans, key=lambda s: (own[s.span_id], -s.start_ns))
    return parts, (best.span_id, own[best.span_id])


def _random_spans(rng: random.Random, n: int) -> list[SpanRecord]:
    spans: list[SpanRecord] = []
    for i in range(n):
        parent = rng.choice(spans) if spans and rng.random() < 0.4 else None
        lo, hi = (parent.start_ns, parent.end_ns) if parent else (0, 10_000 * MS)
        a = rng.randrange(lo, hi)
        b = rng.randrange(a + 1, min(hi, a + 800 * MS) + 1)
        spans.append(SpanRecord(f"{i:016x}", parent.span_id if parent else "root", f"s{i}",
                                rng.choice(("generate", "tool", "reward", "parse")), a, b))
    rng.shuffle(spans)  # the list order must not matter
    return spans


@pytest.mark.parametrize("seed", range(4))
def test_random_nested_and_overlapping_spans_match_the_rules_read_literally(seed: int) -> None:
    spans = _random_spans(random.Random(seed), 150)
    out = breakdown(0, 10_000 * MS, spans)
    parts, (slow_id, own) = _reference(0, 10_000 * MS, spans)
    assert {p: out[f"{p}_ms"] for p in parts} == {p: v / MS for p, v in parts.items()}
    if own >= parts["gap"]:
        assert (out["slow_span_id"], out["slow_span_ms"]) == (slow_id, own / MS)


def _one_after_another(rng: random.Random, n: int) -> tuple[list[SpanRecord], int]:
    """A sequential agent loop: each span opens when the one before it closed or after a gap."""
    spans, t = [], 0
    for i in range(n):
        t += rng.choice((0, 0, rng.randrange(1, 20 * MS)))
        d = rng.randrange(1, 100 * MS)
        spans.append(SpanRecord(f"{i:016x}", "root", f"s{i}",
                                rng.choice(("generate", "tool", "reward", "parse")), t, t + d))
        t += d
    rng.shuffle(spans)
    return spans, t + rng.randrange(0, 5 * MS)


@pytest.mark.parametrize("seed", range(4))
def test_spans_one_after_another_take_the_short_way_to_the_same_parts(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No two spans overlap (the usual rollout): each gets its whole time without the sweep,
    and the parts are the rules' (the sweep stays for overlapping spans, tested above)."""
    from tracer.readers.timing import breakdown as module

    spans, end = _one_after_another(random.Random(seed), 60)

    def no_sweep(*args: Any) -> Any:
        raise AssertionError("the sweep ran on spans that do not overlap")

    monkeypatch.setattr(module, "_sweep", no_sweep)
    out = breakdown(0, end, spans)
    parts, _ = _reference(0, end, spans)
    assert {p: out[f"{p}_ms"] for p in parts} == {p: v / MS for p, v in parts.items()}


def test_ten_thousand_spans() -> None:
    """2,500 turns, each a helper span around a generate call and a tool call with a gap
    between turns; one tool call is planted slowest. (Its cost: bench_time.py --spans.)"""
    rng = random.Random(7)
    spans, t, tool_total, gen_total = [], 0, 0, 0
    slow_turn = 1234
    for turn in range(2500):
        g, k = rng.randrange(1, 50) * MS, (200 if turn == slow_turn else rng.randrange(1, 50)) * MS
        h = f"h{turn}"
        spans += [SpanRecord(h, "root", "execute", "other", t, t + g + k + MS),
                  SpanRecord(f"g{turn}", h, "generate", "generate", t, t + g),
                  SpanRecord(f"t{turn}", h, "call_tool", "tool", t + g, t + g + k,
                             inputs={"name": "python", "arguments": {"turn": turn}}),
                  SpanRecord(f"p{turn}", f"t{turn}", "parse", "parse", t + g, t + g + 1)]
        tool_total += k
        gen_total += g
        t += g + k + MS + 1000  # 1 ms of the helper's own work, 1 µs of gap
    rng.shuffle(spans)
    out = breakdown(0, t, spans)
    assert out["slow_span_id"] == f"t{slow_turn}" and out["slow_span_ms"] == pytest.approx(200)
    assert json.loads(out["slow_span_detail"]) == {"turn": slow_turn}
    assert out["gap_ms"] == pytest.approx(2.5) and out["generate_ms"] == pytest.approx(
        gen_total / MS)
    # the helpers' own 1 ms each; a parse inside a tool call is the tool call's time
    assert out["other_ms"] == pytest.approx(2500) and out["tool_ms"] == pytest.approx(
        tool_total / MS)
    total = sum(out[f"{p}_ms"] for p in ("generate", "tool", "reward", "other", "gap"))
    assert total == pytest.approx(t / MS, abs=1e-6)


def test_the_report_lists_every_straggler_or_says_how_many_more() -> None:
    from tracer.readers.timing.report import LISTED_STRAGGLERS, time_panel

    def row(i: int, step: int, ms: float) -> dict[str, Any]:
        return {"trace_id": f"{step}-{i}", "step": step, "validate": False, "latency_ms": ms,
                "generate_ms": ms, "tool_ms": 0.0, "reward_ms": 0.0, "other_ms": 0.0,
                "gap_ms": 0.0, "tool_ms_by_name": "{}", "slow_span_kind": "generate",
                "slow_span_name": "generate", "slow_span_ms": ms, "slow_span_id": f"s{i}",
                "slow_span_detail": "3 tokens"}  # fmt: skip

    many = LISTED_STRAGGLERS + 5
    rows = [row(i, 1, 10.0) for i in range(40)] + [row(100 + i, 1, 500.0 + i) for i in range(many)]
    rows += [row(i, 2, 10.0) for i in range(40)] + [row(100 + i, 2, 500.0) for i in range(8)]
    html, linked = time_panel(pd.DataFrame(rows))
    one = html.split('<tr data-step="1">', 1)[1].split("</tr>", 1)[0]
    two = html.split('<tr data-step="2">', 1)[1].split("</tr>", 1)[0]
    assert one.count('class="straggler-link"') == LISTED_STRAGGLERS
    assert '5 more in the explorer\'s Time tab' in one and '/#/time?step=1"' in one
    assert two.count('class="straggler-link"') == 8 and "more in the explorer" not in two
    assert len(linked) == LISTED_STRAGGLERS + 8
