"""A :class:`~tracer.record.TrajectoryRecord` -> rows of the three tables (plain dicts).

Pure Python: the same function serves every source (MLflow, JSONL, ...), which is what makes
their exports comparable row by row. Column meanings are in :mod:`tracer.readers.schema`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tracer.annotations import token_values
from tracer.chat import tool_arguments as _tool_arguments
from tracer.chat import tool_result as _tool_result
from tracer.readers.habits.behaviour import behaviour
from tracer.readers.habits.earned import reward_parts, truth
from tracer.readers.habits.signature import scored_text, signature
from tracer.readers.health import FLAGS, TAG_PREFIX, trajectory_flags
from tracer.readers.timing.breakdown import record_timing
from tracer.record import END_REASONS, SpanRecord, TrajectoryRecord, end_reason_of
from tracer.tokens import LOGPROBS_ATTR, decode_floats, kl_series, summarize

Row = dict[str, Any]


@dataclass
class Rows:
    """Rows of the four tables for a batch of trajectories."""

    trajectories: list[Row] = field(default_factory=list)
    turns: list[Row] = field(default_factory=list)
    tool_calls: list[Row] = field(default_factory=list)
    tokens: list[Row] = field(default_factory=list)

    def extend(self, other: Rows) -> None:
        self.trajectories.extend(other.trajectories)
        self.turns.extend(other.turns)
        self.tool_calls.extend(other.tool_calls)
        self.tokens.extend(other.tokens)

    def table(self, name: str) -> list[Row]:
        rows: list[Row] = getattr(self, name)
        return rows


def _json(value: Any) -> str | None:
    if value is None:
        return None
    return json.dumps(value, ensure_ascii=False, default=str, sort_keys=True)


def _int_or_none(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError:
        return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else _json(value)


def _us(ns: int) -> int:
    return ns // 1000


def _ms(span: SpanRecord) -> float:
    return max(span.end_ns - span.start_ns, 0) / 1e6


def _error_message(span: SpanRecord) -> str | None:
    if span.error is None:
        return None
    return str(span.error.get("message") or span.error.get("type") or "error")


def _field(value: Any, *names: str) -> Any:
    if isinstance(value, dict):
        for name in names:
            if value.get(name) is not None:
                return value[name]
    return None


def _count(value: Any) -> int | None:
    return len(value) if isinstance(value, list) else None


def _logprobs(span: SpanRecord) -> list[float] | None:
    """The engine's log-probs of a generate span: the encoded attribute (tracer.tokens), else
    a plain list in the outputs (traces written before the attribute existed)."""
    encoded = decode_floats(span.attributes.get(LOGPROBS_ATTR))
    if encoded is not None:
        return encoded
    value = _field(span.outputs, "logprobs")
    if not isinstance(value, list):
        return None
    out = [float(v) for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return out if out or not value else None


def _prompt(messages: Any, prompt_text: str | None) -> str | None:
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, dict) and message.get("role") == "user":
                return _text(message.get("content"))
    return prompt_text


def turn_row(record: TrajectoryRecord, index: int, span: SpanRecord) -> Row:
    attrs = span.attributes
    inputs, outputs = span.inputs, span.outputs
    response_text = attrs.get("response_text")
    if response_text is None:
        response_text = _field(outputs, "text", "content", "response_text")
        if response_text is None and isinstance(outputs, str):
            response_text = outputs
    prompt_tokens = attrs.get("prompt_tokens")
    if prompt_tokens is None:
        prompt_tokens = _count(_field(inputs, "prompt_ids", "input_ids", "token_ids"))
    response_tokens = attrs.get("response_tokens")
    if response_tokens is None:
        response_tokens = _count(_field(outputs, "response_ids", "output_ids", "token_ids"))
    return {
        "trace_id": record.trace_id,
        "step": record.step,
        "turn_index": index,
        "span_id": span.span_id,
        "name": span.name,
        "start_time": _us(span.start_ns),
        "latency_ms": _ms(span),
        "prompt_text": _text(attrs.get("prompt_text")),
        "response_text": _text(response_text),
        "reasoning": _text(_field(outputs, "reasoning_content", "reasoning")),
        "prompt_tokens": _int_or_none(prompt_tokens),
        "response_tokens": _int_or_none(response_tokens),
        "finish_reason": _text(attrs.get("finish_reason") or _field(outputs, "finish_reason")),
        "logprobs": _logprobs(span),
        "status": span.status,
        "error": _error_message(span),
    }


def tool_row(record: TrajectoryRecord, index: int, turn_index: int, span: SpanRecord) -> Row:
    outputs = span.outputs
    error = _error_message(span)
    if error is None and isinstance(outputs, dict) and outputs.get("error") not in (None, ""):
        error = _text(outputs["error"])
    result = _tool_result(outputs)
    name = span.attributes.get("tool_name") or _field(span.inputs, "name", "tool_name")
    return {
        "trace_id": record.trace_id,
        "step": record.step,
        "call_index": index,
        "turn_index": turn_index,
        "span_id": span.span_id,
        "name": _text(name or span.name),
        "arguments": _json(_tool_arguments(span.inputs)),
        "result": _text(result),
        "error": error,
        "status": span.status,
        "start_time": _us(span.start_ns),
        "latency_ms": _ms(span),
    }


_ID_FIELDS = ("response_ids", "output_ids", "token_ids")
_PER_TOKEN = ("rollout_logprob", "train_logprob", "ref_logprob", "entropy", "advantage")


def _ids(value: Any, names: tuple[str, ...]) -> list[int] | None:
    ids = _field(value, *names)
    if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
        return ids
    return None


def _num(values: list[float] | None, i: int) -> float | None:
    if values is None or i >= len(values):
        return None
    v = values[i]
    return v if math.isfinite(v) else None


def token_rows(record: TrajectoryRecord, generates: list[SpanRecord],
               tokenizer: Any = None) -> list[Row]:  # fmt: skip
    """One row per response token, in verl's response layout: each turn's model tokens
    (``loss_mask`` 1), then the tool/user tokens the next turn's prompt adds (``loss_mask`` 0,
    when that prompt extends the previous one). Per-token values index the model tokens."""
    values = token_values(record.spans)
    mismatch = kl_series(values.get("rollout_logprob"), values.get("train_logprob"), False)
    ref = kl_series(values.get("train_logprob"), values.get("ref_logprob"), True)
    rows: list[Row] = []
    position = model = 0
    for turn, span in enumerate(generates):
        ids = _ids(span.outputs, _ID_FIELDS)
        if ids is None:
            continue
        segments = [(ids, 1)]
        if turn + 1 < len(generates):
            prompt = _ids(span.inputs, ("prompt_ids", "input_ids"))
            nxt = _ids(generates[turn + 1].inputs, ("prompt_ids", "input_ids"))
            if prompt is not None and nxt is not None and nxt[: len(prompt) + len(ids)] == [
                *prompt, *ids
            ]:
                segments.append((nxt[len(prompt) + len(ids):], 0))
        for seg_ids, mask in segments:
            for token_id in seg_ids:
                row: Row = {
                    "trace_id": record.trace_id, "step": record.step,
                    "sample_index": _int_or_none(record.sample_index),
                    "rollout_n": _int_or_none(record.rollout_n), "turn": turn,
                    "position": position, "token_id": token_id,
                    "token": _token_text(tokenizer, token_id), "loss_mask": mask,
                }  # fmt: skip
                m = model if mask else None
                for name in _PER_TOKEN:
                    row[name] = _num(values.get(name), m) if m is not None else None
                for name, pair in (("mismatch_kl", mismatch), ("ref_kl", ref)):
                    row[name] = _num(pair[1], m) if pair and m is not None else None
                    row[f"{name}_k1"] = _num(pair[0], m) if pair and m is not None else None
                rows.append(row)
                position += 1
                model += mask
    return rows


def _token_text(tokenizer: Any, token_id: int) -> str | None:
    if tokenizer is None:
        return None
    try:
        return str(tokenizer.decode([token_id], skip_special_tokens=False))
    except Exception:
        return None


def record_rows(record: TrajectoryRecord, tokenizer: Any = None) -> Rows:
    """The rows one trajectory contributes to each table (``tokenizer``: the ``tokens``
    table's ``token`` text; None leaves it empty)."""
    spans = sorted(record.spans[1:], key=lambda s: s.start_ns)
    generates = [s for s in spans if s.kind == "generate"]
    turns = [turn_row(record, i, s) for i, s in enumerate(generates)]
    tools: list[Row] = []
    for span in spans:
        if span.kind != "tool":
            continue
        turn_index = sum(g.start_ns <= span.start_ns for g in generates) - 1
        tools.append(tool_row(record, len(tools), turn_index, span))
    first = generates[0] if generates else None
    messages = _field(first.inputs, "messages") if first else None
    first_turn = turns[0] if turns else {}
    last_turn = turns[-1] if turns else {}
    response_counts = [t["response_tokens"] for t in turns if t["response_tokens"] is not None]
    root = record.spans[0] if record.spans else None
    trajectory = {
        "trace_id": record.trace_id,
        "experiment": record.project_name,
        "experiment_name": record.experiment_name,
        "name": record.name,
        "step": record.step,
        "sample_index": _int_or_none(record.sample_index),
        "sample_key": None if record.sample_index is None else str(record.sample_index),
        "rollout_n": _int_or_none(record.rollout_n),
        "validate": bool(record.validate),
        "attempt": record.attempt,
        "policy_version": None if record.policy_version is None else str(record.policy_version),
        "worker_id": record.worker_id,
        "status": record.status,
        "start_time": _us(record.start_ns),
        "latency_ms": max(record.end_ns - record.start_ns, 0) / 1e6,
        "prompt": _prompt(messages, first_turn.get("prompt_text")),
        "prompt_text": first_turn.get("prompt_text"),
        "response_text": last_turn.get("response_text"),
        "messages": _json(messages),
        "reward": record.reward,
        "num_turns": len(turns),
        "num_tool_calls": len(tools),
        "num_tool_errors": sum(t["error"] is not None for t in tools),
        "finish_reason": last_turn.get("finish_reason"),
        "prompt_tokens": first_turn.get("prompt_tokens"),
        "response_tokens": sum(response_counts) if response_counts else None,
        "error": _error_message(root) if root is not None else None,
        "accuracy": _accuracy(spans),
        "flags": _flags(record, turns, tools),
        "kept_by": _text(record.attributes.get("kept_by")),
        "end_reason": _end_reason(record, root),
    }
    summary = summarize(token_values(record.spans))
    for name in TOKEN_SUMMARY:
        trajectory[name] = summary.get(name)
    reward = next((s for s in reversed(spans) if s.kind == "reward"), None)
    sig = signature([(t["name"], t["error"] is not None) for t in tools],
                    last_turn.get("finish_reason"), scored_text(reward.inputs) if reward
                    else None, last_turn.get("response_text"))  # fmt: skip
    trajectory["signature"], trajectory["signature_text"] = sig.key, sig.text
    trajectory["reward_parts"] = _reward_parts(spans)
    trajectory["behaviour"] = behaviour(
        (t["name"] for t in tools), last_turn.get("finish_reason"),
        (scored_text(reward.inputs) if reward else None) or last_turn.get("response_text"),
        sum(response_counts) if response_counts else None)
    trajectory.update(record_timing(record))  # where its wall time went (timing/breakdown.py)
    return Rows([trajectory], turns, tools, token_rows(record, generates, tokenizer))


def _end_reason(record: TrajectoryRecord, root: SpanRecord | None) -> str:
    """Why the trajectory ended: as the tracer recorded it, else (a trace written before
    ``end_reason`` existed) from the root span's error type."""
    reason = record.attributes.get("end_reason")
    if reason is None and root is not None:
        reason = root.attributes.get("end_reason")
    if isinstance(reason, str) and reason in END_REASONS:
        return reason
    error = root.error if root is not None else None
    return end_reason_of(str(error.get("type")) if error else None)


# per-trajectory aggregates of the per-token values (tracer.tokens.summarize), k3 for KL
TOKEN_SUMMARY = ("mismatch_kl_mean", "mismatch_kl_max", "ref_kl_mean", "ref_kl_max",
                 "logprob_min", "logprob_mean", "entropy_mean")  # fmt: skip


def _accuracy(spans: list[SpanRecord]) -> float | None:
    for span in reversed(spans):
        if span.kind == "reward" and span.status == "OK":
            # verl's reward functions say acc (DAPO's a bool: 0/1); TRL's built-in reward
            # function is accuracy_reward
            value = truth(_field(span.outputs, "accuracy", "acc", "accuracy_reward"))
            if value is not None:
                return value
    return None


def _reward_parts(spans: list[SpanRecord]) -> dict[str, float] | None:
    """The last reward span's numeric outputs, by name (None: no reward span)."""
    for span in reversed(spans):
        if span.kind == "reward" and span.status == "OK":
            return reward_parts(span.outputs)
    return None


def _flags(record: TrajectoryRecord, turns: list[Row], tools: list[Row]) -> list[str]:
    """Trajectory flags from its own rows, plus any stored as ``flag.<name>`` tags (written
    back by ``rollout-tracer flags --write-tags``: step flags too)."""
    flags = trajectory_flags(record.reward, turns, tools)
    for key, value in record.attributes.items():
        name = key[len(TAG_PREFIX):] if key.startswith(TAG_PREFIX) else None
        if name in FLAGS and str(value).lower() == "true" and name not in flags:
            flags.append(name)
    return sorted(flags, key=FLAGS.index)


def tokenizer_name(record: TrajectoryRecord) -> str | None:
    """The tokenizer token2text decoded the trajectory with, as its generate spans name it
    (``name_or_path``: a model name or a folder), or None."""
    for span in record.spans:
        name = span.attributes.get("tokenizer") if span.kind == "generate" else None
        if isinstance(name, str) and name:
            return name
    return None


def records_rows(records: list[TrajectoryRecord], tokenizer: Any = None,
                 tokenizers: Callable[[str | None], Any] | None = None) -> Rows:  # fmt: skip
    """The rows of ``records``; the tokens table's text comes from ``tokenizer``, else from
    ``tokenizers(name)`` with the name each trajectory's token2text recorded (None when it
    recorded none), which returns a tokenizer or None."""
    rows = Rows()
    for record in records:
        tok = tokenizer
        if tok is None and tokenizers is not None:
            tok = tokenizers(tokenizer_name(record))
        rows.extend(record_rows(record, tok))
    return rows
