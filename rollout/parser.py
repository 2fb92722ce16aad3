"""Hermes / Qwen tool-call parsing: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    """One parsed tool call. ``error`` is set when the call could not be parsed; the agent loop
    then answers it with an error tool response instead of running a tool."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None

    def to_message_dict(self) -> dict[str, Any]:
        """OpenAI-style ``tool_calls`` entry."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParseResult:
    """Output of :func:`parse_tool_calls`: the text outside tool-call tags and the calls."""

    content: str
    tool_calls: list[ToolCall]


def _parse_one(raw: str) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCall(name="", raw=raw, error=f"invalid JSON in tool call: {exc.msg}")
    if not isinstance(obj, dict):
        return ToolCall(name="", raw=raw, error="tool call must be a JSON object")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(name="", raw=raw, error="tool call has no 'name' string")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(name=name, raw=raw, error=f"invalid JSON in arguments: {exc.msg}")
    if not isinstance(args, dict):
        return ToolCall(name=name, raw=raw, error="'arguments' must be a JSON object")
    return ToolCall(name=name, arguments=args, raw=raw)


def parse_tool_calls(text: str) -> ParseResult:
    """Extract tool calls from model output text.

    Unterminated ``<tool_call>`` blocks (e.g. at the length limit) are parsed up to the end
    of the text. Malformed calls are returned with ``error`` set, never raised.
    """
    calls = [_parse_one(m.group(1)) for m in _TOOL_CALL_RE.finditer(text)]
    content = _TOOL_CALL_RE.sub("", text).strip()
    return ParseResult(content=content, tool_calls=calls)
