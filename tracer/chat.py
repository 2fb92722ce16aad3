"""Chat messages out of a trajectory's spans, in one normalized OpenAI-style shape.

Neutral on purpose: the span writers (MLflow and OpenTelemetry attributes, OpenInference) and
the readers (the Inspect eval-log export) both use it, neither imports the other. A message
here has a ``role`` in system/user/assistant/tool, string ``content`` (or None), and when it
has tool calls, ``tool_calls`` entries ``{"id", "type": "function", "function": {"name",
"arguments": <JSON string>}}``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from tracer.json_text import encode_function
from tracer.record import SpanRecord, TrajectoryRecord

# json.dumps(value, ensure_ascii=False, default=str), with the encoder built once: json.dumps
# builds a new one on every call that passes options (the MLflow writers call this ~150 times
# a trajectory). The encoder keeps no state between calls, so threads can share it.
# ``dumps`` is the encoding function itself, not a function calling it: a frame less per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, default=str)
dumps: Callable[[Any], str] = encode_function(_ENCODER)


_CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
_ROLE_ALIASES = {"developer": "system", "function": "tool", "ipython": "tool"}


def chat_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """One message in the shape MLflow's chat view accepts (anything else is kept as text)."""
    role = str(message.get("role", "user"))
    role = _ROLE_ALIASES.get(role, role)
    content = chat_text(message.get("content"))
    if role not in _CHAT_ROLES:  # keep the message, say what it was
        content = f"[{role}] {content or ''}"
        role = "user"
    out: dict[str, Any] = {"role": role, "content": content}
    calls = message.get("tool_calls")
    if isinstance(calls, list) and calls:
        out["tool_calls"] = [_chat_tool_call(c, f"call_{index}_{j}") for j, c in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        value = message.get(key)
        if isinstance(value, str):
            out[key] = value
    return out


def chat_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return dumps(content)


def _chat_tool_call(call: Any, default_id: str) -> dict[str, Any]:
    call = call if isinstance(call, dict) else {"function": {"name": str(call)}}
    function = call.get("function")
    fn: dict[str, Any] = function if isinstance(function, dict) else call
    arguments = fn.get("arguments")
    call_id = call.get("id")
    return {
        "id": str(call_id) if call_id is not None else default_id,
        "type": "function",
        "function": {
            "name": str(fn.get("name", "")),
            "arguments": arguments if isinstance(arguments, str) else dumps(arguments or {}),
        },
    }


def output_text(span: SpanRecord) -> str | None:
    """The generated text: ``response_text`` (token2text), else the text in the outputs."""
    text = span.attributes.get("response_text")
    outputs = span.outputs
    if not isinstance(text, str) and isinstance(outputs, dict):
        for key in ("content", "text", "response_text"):
            if isinstance(outputs.get(key), str):
                text = outputs[key]
                break
    if not isinstance(text, str) and isinstance(outputs, str):
        text = outputs
    return text if isinstance(text, str) else None


def tool_calls_of(outputs: Any) -> list[Any] | None:
    """The tool calls in a span's outputs (an engine that returns OpenAI-style ``tool_calls``,
    or a parser's result), else None."""
    if isinstance(outputs, dict):
        outputs = outputs.get("tool_calls")
    if isinstance(outputs, list) and outputs and all(isinstance(c, dict) for c in outputs):
        return [c for c in outputs if c.get("name") or c.get("function")] or None
    return None


def parsed_tool_calls(record: TrajectoryRecord) -> dict[str, Any]:
    """For each generate span's id, the tool calls of the first parse span that follows it
    (before the next generate): the agent loop parses the reply after the engine call returns,
    so the calls are not in the generate span's own outputs."""
    out: dict[str, Any] = {}
    last: str | None = None
    for span in record.spans:
        if span.kind == "generate":
            last = span.span_id
        elif span.kind == "parse" and last is not None:
            calls = tool_calls_of(span.outputs)
            if calls:
                out[last] = calls
            last = None
    return out


def reply_message(span: SpanRecord, parsed: dict[str, Any]) -> dict[str, Any] | None:
    """A generate span's reply as an assistant message (its text and tool calls), or None."""
    calls = tool_calls_of(span.outputs) or parsed.get(span.span_id)
    text = output_text(span)
    if text is None and not calls:
        return None
    reply: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        reply["tool_calls"] = calls
    return reply


def conversation(record: TrajectoryRecord) -> list[tuple[dict[str, Any], SpanRecord | None]]:
    """The trajectory's whole chat, each message with the span it came from (a generate span
    for the assistant's replies, a tool span for tool results, else None).

    The conversation so far is the last generate span's input ``messages`` plus its reply and
    the results of the tool spans after it (a trajectory can end on a tool call: the turn
    limit came before the next generate); the earlier replies are matched to the earlier
    generate spans in order. A trajectory whose generate spans hold no messages (token ids
    only) becomes the decoded prompt, then each reply followed by the results of the tool
    spans after it."""
    parsed = parsed_tool_calls(record)
    gens = [s for s in record.spans if s.kind == "generate"]
    with_messages = [s for s in gens if isinstance(_inputs(s).get("messages"), list)]
    out: list[tuple[dict[str, Any], SpanRecord | None]] = []
    if with_messages:
        last = with_messages[-1]
        at = next(i for i, s in enumerate(record.spans) if s is last)
        before = [s for s in record.spans[:at] if s.kind == "tool"]
        after = [s for s in record.spans[at:] if s.kind == "tool"]
        messages = [m for m in _inputs(last)["messages"] if isinstance(m, dict)]
        replies = iter(gens)
        matched = sum(m.get("role") == "tool" for m in messages) == len(before)
        results = iter(before) if matched else None
        for i, message in enumerate(messages):
            msg = chat_message(message, i)
            source = None
            if msg["role"] == "assistant":
                source = next(replies, None)
            elif msg["role"] == "tool" and results is not None:
                source = next(results, None)
            out.append((msg, source))
        reply = reply_message(last, parsed)
        if reply is not None:
            out.append((chat_message(reply, len(messages)), last))
        _add_results(out, after)
        return out
    first = gens[0] if gens else None
    prompt = first.attributes.get("prompt_text") if first is not None else None
    if isinstance(prompt, str):
        out.append(({"role": "user", "content": prompt}, None))
    pending: list[SpanRecord] = []
    for span in record.spans:
        if span.kind == "generate":
            _add_results(out, pending)
            pending = []
            reply = reply_message(span, parsed)
            if reply is not None:
                out.append((chat_message(reply, len(out)), span))
        elif span.kind == "tool":
            pending.append(span)
    _add_results(out, pending)
    return out


def _add_results(out: list[tuple[dict[str, Any], SpanRecord | None]],
                 tools: list[SpanRecord]) -> None:  # fmt: skip
    """Append a tool message per tool span, each answering the next tool call of the last
    assistant message (by its id) in order."""
    if not tools:
        return
    calls: list[Any] = []
    for message, _ in reversed(out):
        if message["role"] == "assistant":
            calls = message.get("tool_calls") or []
            break
    for k, span in enumerate(tools):
        call_id = calls[k]["id"] if k < len(calls) else None
        out.append((tool_message(span, call_id), span))


def tool_name(span: SpanRecord) -> str:
    """The tool a tool span ran: its ``tool_name`` attribute (the record builder sets it),
    else a ``name`` in its inputs, else the op's name."""
    name = span.attributes.get("tool_name")
    if not isinstance(name, str) and isinstance(span.inputs, dict):
        name = span.inputs.get("name") or span.inputs.get("tool_name")
    return name if isinstance(name, str) and name else span.name


def tool_arguments(inputs: Any) -> Any:
    """The arguments a tool span's inputs hold: their ``arguments`` (or verl's ``parameters``),
    else the inputs without the receiver and the tool's name."""
    if isinstance(inputs, dict):
        for key in ("arguments", "parameters"):  # parameters: verl's BaseTool.execute
            if key in inputs:
                return inputs[key]
        return {k: v for k, v in inputs.items() if k not in ("self", "name", "tool_name")}
    return inputs


def tool_result(outputs: Any) -> Any:
    """The result a tool span's outputs hold: the text of verl's ToolResponse, a ``content``
    (``result``, ``output``) field, else the outputs themselves."""
    if isinstance(outputs, list) and outputs and isinstance(outputs[0], dict):
        # verl's BaseTool.execute returns (ToolResponse, reward, metrics)
        text = outputs[0].get("text")
        if text is not None:
            return text
    if isinstance(outputs, dict):
        for key in ("content", "result", "output"):
            if outputs.get(key) is not None:
                return outputs[key]
        return {k: v for k, v in outputs.items() if k != "__type__"}
    return outputs


def tool_message(span: SpanRecord, call_id: str | None) -> dict[str, Any]:
    """A tool span as the tool message that answers call ``call_id``: its result as text, or
    the error it raised."""
    result = tool_result(span.outputs)
    if result is None and span.error is not None:
        result = f"{span.error.get('type', 'Error')}: {span.error.get('message', '')}"
    content = result if isinstance(result, str) else dumps(result)
    message: dict[str, Any] = {"role": "tool", "content": content, "name": tool_name(span)}
    if call_id is not None:
        message["tool_call_id"] = call_id
    return message


def _inputs(span: SpanRecord) -> dict[str, Any]:
    return span.inputs if isinstance(span.inputs, dict) else {}
