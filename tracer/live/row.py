"""One processed trajectory as the live analysis keeps it: the columns of the export's
``trajectories`` row (tracer/readers/rows.py: ``record_rows``) that the behaviour rules
(:mod:`tracer.readers.habits.patterns_py`) and the time breakdown
(:mod:`tracer.readers.timing.breakdown`) read, made with the readers' own functions (behaviour,
reward parts, the time parts), so the live numbers are those ``rollout-tracer flags`` and the
export's ``steps`` table give afterwards (tests/test_live.py compares the rows).

It runs on the processing thread for every trajectory, so it reads only what those columns
need: the export decodes every span's inputs and outputs and its turn and tool rows, this
decodes one field at a time (a generate call's prompt ids and log-probs, most of a
trajectory's bytes, stay as they are). Texts are cut (:data:`TEXT_CHARS`): they serve only the
count of distinct answers and prompts and the near-duplicate evidence of runs without a
correctness signal; the behaviour is made from the whole text first.
"""

from __future__ import annotations

from typing import Any

from tracer.readers.habits.behaviour import behaviour
from tracer.readers.habits.signature import scored_text
from tracer.readers.rows import _accuracy, _end_reason, _reward_parts
from tracer.readers.timing.breakdown import record_timing
from tracer.record import SpanRecord, TrajectoryRecord, plain

TEXT_CHARS = 400  # of an answer or a prompt kept per trajectory (a row: at most ~3 kB)
# the breakdown's columns that step_summaries reads (timing/breakdown.py)
TIMING = ("generate_ms", "tool_ms", "reward_ms", "other_ms", "gap_ms", "tool_ms_by_name",
          "slow_span_id", "slow_span_kind", "slow_span_name", "slow_span_detail",
          "slow_span_ms")  # fmt: skip
_IDS = ("response_ids", "output_ids", "token_ids")


def _cut(text: Any) -> Any:
    if isinstance(text, str) and len(text) > TEXT_CHARS:
        half = TEXT_CHARS // 2
        return text[:half] + " ... " + text[-half:]  # ASCII: a 1-byte string
    return text


def _decoded(span: SpanRecord) -> SpanRecord:
    """A copy of the span with its inputs and outputs as Python values."""
    return SpanRecord(span.span_id, span.parent_id, span.name, span.kind, span.start_ns,
                      span.end_ns, span.status, span.error, plain(span.inputs),
                      plain(span.outputs), span.attributes)  # fmt: skip


def _field(value: Any, *names: str) -> Any:
    """The first of ``names`` a dict holds (not None), decoded: rows.py's ``_field`` on a
    snapshot whose values are still JSON fragments."""
    if isinstance(value, dict):
        for name in names:
            found = value.get(name)
            if found is not None:
                return plain(found)
    return None


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    import json

    return json.dumps(value, ensure_ascii=False, default=str, sort_keys=True)


def _turn(span: SpanRecord) -> tuple[Any, Any, int | None]:
    """A generate call's (response text, finish reason, response tokens), as ``turn_row``."""
    attrs, outputs = span.attributes, span.outputs
    text = attrs.get("response_text")
    if text is None:
        text = _field(outputs, "text", "content", "response_text")
        if text is None and isinstance(outputs, str):
            text = outputs
    finish = attrs.get("finish_reason") or _field(outputs, "finish_reason")
    n = attrs.get("response_tokens")
    if n is None:
        ids = _field(outputs, *_IDS)
        n = len(ids) if isinstance(ids, list) else None
    return _text(text), _text(finish), n if isinstance(n, int) else None


def _tool(span: SpanRecord) -> tuple[str, bool]:
    """A tool call's (name, failed), as ``tool_row``."""
    failed = span.error is not None or _field(span.outputs, "error") not in (None, "")
    name = span.attributes.get("tool_name") or _field(span.inputs, "name", "tool_name")
    return str(name or span.name), failed


def _prompt(generate: SpanRecord | None) -> Any:
    """The last user message of the first generate call's messages (else its prompt text)."""
    if generate is None:
        return None
    messages = _field(generate.inputs, "messages")
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                return _text(message.get("content"))
    return generate.attributes.get("prompt_text")


def live_row(record: TrajectoryRecord) -> dict[str, Any]:
    """The live analysis's row of one trajectory (plain JSON data)."""
    spans = sorted(record.spans[1:], key=lambda s: s.start_ns)
    generates = [s for s in spans if s.kind == "generate"]
    turns = [_turn(s) for s in generates]
    tools = [_tool(s) for s in spans if s.kind == "tool"]
    answer, finish, _ = turns[-1] if turns else (None, None, None)
    counts = [n for _, _, n in turns if n is not None]
    tokens = sum(counts) if counts else None
    rewards = [_decoded(s) for s in spans if s.kind == "reward"]  # small: decoded whole
    scored = scored_text(rewards[-1].inputs) if rewards else None
    row: dict[str, Any] = {
        "trace_id": record.trace_id,
        "step": record.step,
        "validate": bool(record.validate),
        "sample_key": None if record.sample_index is None else str(record.sample_index),
        "rollout_n": record.rollout_n if isinstance(record.rollout_n, int) else None,
        # drops (timing/drops.py): why it ended; response_tokens is its length so far
        "end_reason": _end_reason(record, record.spans[0] if record.spans else None),
        "prompt": _cut(_prompt(generates[0] if generates else None)),
        "response_text": _cut(answer),
        "response_tokens": tokens,
        "reward": record.reward,
        "accuracy": _accuracy(rewards),  # the export's own: correctness, one notion
        "reward_parts": _reward_parts(rewards),
        "num_tool_calls": len(tools),
        "num_tool_errors": sum(failed for _, failed in tools),
        "behaviour": behaviour((name for name, _ in tools), finish, scored or answer, tokens),
        "latency_ms": max(record.end_ns - record.start_ns, 0) / 1e6,
        "end_ns": record.end_ns,
    }  # fmt: skip
    timing = record_timing(record)
    for key in TIMING:
        row[key] = timing.get(key)
    return row
