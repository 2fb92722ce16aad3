"""A trajectory's spans as the events of an Inspect sample, which ``inspect view`` shows in its
Transcript tab: a ``ModelEvent`` per generate span (the chat so far as its input, the reply as
its output, token counts as its usage), a ``ToolEvent`` per tool span (the call's arguments, its
result or error), a ``ScoreEvent`` for the reward and, when the trajectory raised, an
``ErrorEvent``. Each event has the span's own start and end times; ``working_start`` counts
seconds from the trajectory's start.

Built from the messages :mod:`tracer.readers.inspect_log` already made for the sample, so the
events and the sample's messages are the same objects (Inspect's writer stores them once).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from tracer.chat import tool_arguments, tool_message
from tracer.record import SpanRecord, TrajectoryRecord

STOP: dict[str, Any] = {"stop": "stop", "length": "max_tokens", "tool_calls": "tool_calls"}


def sample_events(
    record: TrajectoryRecord,
    conversation: list[tuple[dict[str, Any], SpanRecord | None]],
    messages: list[Any],
    model: str,
    error: Any,
) -> list[Any]:
    """The events of one sample, in the order their spans opened. ``conversation`` is
    :func:`tracer.chat.conversation` of ``record`` and ``messages`` its Inspect messages;
    ``error`` the sample's ``EvalError`` or None."""
    from inspect_ai.event import ErrorEvent, ScoreEvent
    from inspect_ai.scorer import Score

    at = {id(span): i for i, (_, span) in enumerate(conversation) if span is not None}
    events: list[Any] = []
    seen = 0  # messages up to the latest event's: a span not in the chat sees these
    for span in record.spans:
        i = at.get(id(span))
        if span.kind == "generate":
            events.append(_model_event(record, span, messages, i, seen, model))
        elif span.kind == "tool":
            message = conversation[i][0] if i is not None else tool_message(span, None)
            chat = messages[i] if i is not None else None
            events.append(_tool_event(record, span, message, chat))
        if i is not None:
            seen = max(seen, i + 1)
    if record.reward is not None:
        scored = [s for s in record.spans if s.kind == "reward" and "reward" in s.attributes]
        end = scored[-1].end_ns if scored else record.end_ns
        events.append(
            ScoreEvent(score=Score(value=float(record.reward)), target="", scorer="reward",
                       **_times(record, end))
        )  # fmt: skip
    if error is not None:
        events.append(ErrorEvent(error=error, **_times(record, record.end_ns)))
    return events


def _times(record: TrajectoryRecord, ns: int) -> dict[str, Any]:
    return {"timestamp": _utc(ns), "working_start": (ns - record.start_ns) / 1e9}


def _utc(ns: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.timezone.utc)


def _model_event(record: TrajectoryRecord, span: SpanRecord, messages: list[Any],
                 i: int | None, seen: int, model: str) -> Any:  # fmt: skip
    from inspect_ai.event import ModelEvent
    from inspect_ai.model import GenerateConfig, ModelOutput, ModelUsage

    inputs = span.inputs if isinstance(span.inputs, dict) else {}
    asked = inputs.get("model")
    name = asked if isinstance(asked, str) else model
    finish = span.attributes.get("finish_reason")
    if i is not None:
        stop: Any = STOP.get(finish, "unknown") if isinstance(finish, str) else "unknown"
        output = ModelOutput.from_message(messages[i], stop_reason=stop)
    else:  # no reply in the chat (the call raised, or its reply could not be placed)
        output = ModelOutput(model=name)
    output.model = name
    usage = _usage(span)
    if usage is not None:
        output.usage = ModelUsage(input_tokens=usage[0], output_tokens=usage[1],
                                  total_tokens=usage[0] + usage[1])  # fmt: skip
    failed = span.error
    return ModelEvent(
        model=name, input=messages[: seen if i is None else i], tools=[], tool_choice="auto",
        config=GenerateConfig(), output=output,
        error=f"{failed.get('type', 'Error')}: {failed.get('message', '')}" if failed else None,
        traceback=failed.get("traceback") if failed else None,
        completed=_utc(span.end_ns), working_time=(span.end_ns - span.start_ns) / 1e9,
        **_times(record, span.start_ns),
    )  # fmt: skip


def _usage(span: SpanRecord) -> tuple[int, int] | None:
    """(prompt, response) token counts: token2text's counts, else the id lists' lengths."""
    counts = []
    for key, payload, ids in (("prompt_tokens", span.inputs, "prompt_ids"),
                              ("response_tokens", span.outputs, "response_ids")):  # fmt: skip
        value = span.attributes.get(key)
        if not isinstance(value, int) and isinstance(payload, dict):
            value = len(payload[ids]) if isinstance(payload.get(ids), list) else None
        counts.append(value)
    prompt, response = counts
    if isinstance(prompt, int) and isinstance(response, int):
        return prompt, response
    return None


def arguments(value: Any) -> dict[str, Any]:
    """A tool call's arguments as the dict Inspect wants (JSON text parsed; a non-object kept
    under ``value``, unparsable text under ``raw``)."""
    try:
        value = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        return {"raw": value}
    return value if isinstance(value, dict) else {"value": value}


def tool_error(span: SpanRecord) -> Any:
    """The ``ToolCallError`` of a tool span: the exception it raised, else the ``error`` its
    result reports (a tool registry that returns its failures), else None."""
    from inspect_ai.tool import ToolCallError

    if span.error is not None:
        return ToolCallError("unknown", str(span.error.get("message", "")))
    outputs = span.outputs
    if isinstance(outputs, dict) and outputs.get("error") not in (None, ""):
        return ToolCallError("unknown", str(outputs["error"]))
    return None


def _tool_event(record: TrajectoryRecord, span: SpanRecord, message: dict[str, Any],
                chat_message: Any) -> Any:  # fmt: skip
    from inspect_ai.event import ToolEvent

    error = chat_message.error if chat_message is not None else tool_error(span)
    return ToolEvent(
        id=str(message.get("tool_call_id") or span.span_id), function=str(message["name"]),
        arguments=arguments(tool_arguments(span.inputs)), result=message["content"] or "",
        error=error, failed=True if span.error is not None else None,
        completed=_utc(span.end_ns), working_time=(span.end_ns - span.start_ns) / 1e9,
        **_times(record, span.start_ns),
    )  # fmt: skip
