"""One processed trajectory as the live analysis keeps it: the few columns of the export's
``trajectories`` row that the behaviour rules (:mod:`tracer.readers.habits.patterns_py`) and
the time breakdown (:mod:`tracer.readers.timing.breakdown`) read, made by the export's own
functions from the same record, so the live numbers are those ``rollout-tracer flags`` and the
export's ``steps`` table give afterwards.

Texts are cut (:data:`TEXT_CHARS`): they serve only the count of distinct answers and
prompts and the near-duplicate evidence of runs without a correctness signal; the behaviour and
the signature are made from the whole text first.
"""

from __future__ import annotations

from typing import Any

from tracer.readers.habits.behaviour import behaviour
from tracer.readers.habits.signature import scored_text, signature
from tracer.readers.rows import _accuracy, _prompt, _reward_parts, tool_row, turn_row
from tracer.readers.timing.breakdown import record_timing
from tracer.record import SpanRecord, TrajectoryRecord, plain

TEXT_CHARS = 1000  # of an answer or a prompt kept per trajectory
# the breakdown's columns that step_summaries reads (timing/breakdown.py)
TIMING = ("generate_ms", "tool_ms", "reward_ms", "other_ms", "gap_ms", "tool_ms_by_name",
          "slow_span_id", "slow_span_kind", "slow_span_name", "slow_span_detail",
          "slow_span_ms")  # fmt: skip


def _cut(text: Any) -> Any:
    if isinstance(text, str) and len(text) > TEXT_CHARS:
        half = TEXT_CHARS // 2
        return text[:half] + " … " + text[-half:]
    return text


def _decoded(span: SpanRecord) -> SpanRecord:
    """The span with its inputs and outputs as Python values (a copy: the record the
    backends get stays as it is)."""
    inputs, outputs = plain(span.inputs), plain(span.outputs)
    if inputs is span.inputs and outputs is span.outputs:
        return span
    return SpanRecord(span.span_id, span.parent_id, span.name, span.kind, span.start_ns,
                      span.end_ns, span.status, span.error, inputs, outputs,
                      span.attributes)  # fmt: skip


def live_row(record: TrajectoryRecord) -> dict[str, Any]:
    """The live analysis's row of one trajectory (plain JSON data)."""
    spans = sorted(record.spans[1:], key=lambda s: s.start_ns)
    spans = [_decoded(s) if s.kind in ("generate", "tool", "reward") else s for s in spans]
    generates = [s for s in spans if s.kind == "generate"]
    turns = [turn_row(record, i, s) for i, s in enumerate(generates)]
    tools = [tool_row(record, i, 0, s) for i, s in enumerate(s for s in spans
                                                            if s.kind == "tool")]  # fmt: skip
    first = turns[0] if turns else {}
    last = turns[-1] if turns else {}
    messages = generates[0].inputs.get("messages") if generates and isinstance(
        generates[0].inputs, dict) else None  # fmt: skip
    counts = [t["response_tokens"] for t in turns if t["response_tokens"] is not None]
    tokens = sum(counts) if counts else None
    reward = next((s for s in reversed(spans) if s.kind == "reward"), None)
    scored = scored_text(reward.inputs) if reward is not None else None
    calls = [(t["name"], t["error"] is not None) for t in tools]
    sig = signature(calls, last.get("finish_reason"), scored, last.get("response_text"))
    row: dict[str, Any] = {
        "trace_id": record.trace_id,
        "step": record.step,
        "validate": bool(record.validate),
        "sample_key": None if record.sample_index is None else str(record.sample_index),
        "prompt": _cut(_prompt(messages, first.get("prompt_text"))),
        "response_text": _cut(last.get("response_text")),
        "response_tokens": tokens,
        "reward": record.reward,
        "accuracy": _accuracy(spans),
        "reward_parts": _reward_parts(spans),
        "num_tool_calls": len(tools),
        "num_tool_errors": sum(t["error"] is not None for t in tools),
        "signature_text": sig.text,
        "behaviour": behaviour((t["name"] for t in tools), last.get("finish_reason"),
                               scored or last.get("response_text"), tokens),
        "latency_ms": max(record.end_ns - record.start_ns, 0) / 1e6,
        "end_ns": record.end_ns,
    }  # fmt: skip
    timing = record_timing(record)
    for key in TIMING:
        row[key] = timing.get(key)
    return row
