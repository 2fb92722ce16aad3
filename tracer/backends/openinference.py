"""OpenInference span attributes (Arize Phoenix's conventions), written by the OTLP backend next
to the OpenTelemetry GenAI ones when ``TraceConfig.otlp_conventions`` holds ``"openinference"``.

Names mirror the ``openinference-semantic-conventions`` package (``openinference.semconv.trace``);
tests/test_openinference.py checks every name here against that package, which the tracer
itself does not need at run time.

=========== ======================= ====================================================
kind        openinference.span.kind  attributes
=========== ======================= ====================================================
trajectory  AGENT                   agent.name, session.id, tag.tags, metadata (tags and
                                    reward as JSON), reward
generate    LLM                     llm.input_messages.N.message.role / content / name /
                                    tool_call_id / tool_calls.K.tool_call.id / .function.name
                                    / .function.arguments; llm.output_messages.0.message.*
                                    (tool calls from the outputs or the parse span after it),
                                    llm.token_count.prompt / completion / total,
                                    llm.model_name
tool        TOOL                    tool.name; tool.parameters, the JSON schema of the tool's
                                    parameters, where the rollout gave it (the span's
                                    ``tool_schema`` attribute, see
                                    ``tracer.set_span_attributes``), else omitted; the call's
                                    argument values are in input.value
reward      EVALUATOR               reward (when the outputs hold a number)
parse       CHAIN
=========== ======================= ====================================================

The OTLP stream names a tool span after its tool (:func:`tracer.backends.otel_spans.span_name`).
Every span also carries ``input.value`` / ``output.value`` with ``input.mime_type`` /
``output.mime_type``: text as ``text/plain``, anything else as ``application/json``. The session
id groups a step's rollouts of one sample (a GRPO group): Phoenix's Sessions view then shows the
``rollout_n`` siblings side by side.
"""

from __future__ import annotations

from typing import Any

from tracer.chat import chat_message, reply_message
from tracer.record import SpanRecord, TrajectoryRecord

SPAN_KIND_KEY = "openinference.span.kind"
SPAN_KINDS = {
    "trajectory": "AGENT",
    "generate": "LLM",
    "parse": "CHAIN",
    "tool": "TOOL",
    "reward": "EVALUATOR",
    "interaction": "EVALUATOR",
    "retrieve": "RETRIEVER",
    "other": "UNKNOWN",
}
TEXT = "text/plain"
JSON = "application/json"


def session_id(record: TrajectoryRecord) -> str:
    """One GRPO group: the rollouts of one sample in one step of one experiment."""
    split = "val" if record.validate else "train"
    return f"{record.experiment_name}/{split}/step-{record.step}/sample-{record.sample_index}"


def openinference_attributes(
    record: TrajectoryRecord, span: SpanRecord, is_root: bool, parsed: dict[str, Any]
) -> dict[str, Any]:
    """Plain-valued OpenInference attributes of one span. ``parsed`` maps a generate span's id
    to the tool calls its reply was parsed into (:func:`tracer.chat.parsed_tool_calls`)."""
    out: dict[str, Any] = {SPAN_KIND_KEY: SPAN_KINDS.get(span.kind, "UNKNOWN")}
    attrs = span.attributes
    if span.kind == "generate":
        inputs = span.inputs if isinstance(span.inputs, dict) else {}
        messages = inputs.get("messages")
        if isinstance(messages, list):
            for i, message in enumerate(m for m in messages if isinstance(m, dict)):
                _message(out, f"llm.input_messages.{i}.", chat_message(message, i))
        reply = reply_message(span, parsed)
        if reply is not None:
            _message(out, "llm.output_messages.0.", chat_message(reply, len(messages or [])))
        prompt = _count(attrs.get("prompt_tokens"), inputs, "prompt_ids")
        completion = _count(attrs.get("response_tokens"), span.outputs, "response_ids")
        if isinstance(prompt, int):
            out["llm.token_count.prompt"] = prompt
        if isinstance(completion, int):
            out["llm.token_count.completion"] = completion
        if isinstance(prompt, int) and isinstance(completion, int):
            out["llm.token_count.total"] = prompt + completion
        if isinstance(inputs.get("model"), str):
            out["llm.model_name"] = inputs["model"]
    elif span.kind == "tool":
        name = attrs.get("tool_name")
        if isinstance(name, str):
            out["tool.name"] = name
        schema = attrs.get("tool_schema")
        if isinstance(schema, (dict, str)):
            out["tool.parameters"] = schema
    elif span.kind in ("reward", "interaction"):
        score = _score(span.outputs)
        if score is not None:
            out["reward"] = score
    if is_root:
        out["agent.name"] = record.name
        out["session.id"] = session_id(record)
        tags = record.tags()
        out["tag.tags"] = [f"{key}={value}" for key, value in tags.items()]
        metadata: dict[str, Any] = dict(tags)
        if record.reward is not None:
            metadata["reward"] = record.reward
        out["metadata"] = metadata
    return out


def add_io(out: dict[str, Any], inputs: Any, outputs: Any) -> None:
    """``input.value`` / ``output.value`` and their mime types (the span's payloads, the same
    objects MLflow's attributes carry, so the encoder can serialize each once)."""
    for prefix, value in (("input", inputs), ("output", outputs)):
        if value is not None:
            out[f"{prefix}.value"] = value
            out[f"{prefix}.mime_type"] = TEXT if isinstance(value, str) else JSON


def _message(out: dict[str, Any], prefix: str, message: dict[str, Any]) -> None:
    out[prefix + "message.role"] = message["role"]
    if message.get("content") is not None:
        out[prefix + "message.content"] = message["content"]
    for key in ("name", "tool_call_id"):
        if key in message:
            out[f"{prefix}message.{key}"] = message[key]
    for k, call in enumerate(message.get("tool_calls") or ()):
        call_prefix = f"{prefix}message.tool_calls.{k}.tool_call."
        out[call_prefix + "id"] = call["id"]
        out[call_prefix + "function.name"] = call["function"]["name"]
        out[call_prefix + "function.arguments"] = call["function"]["arguments"]


def _count(decoded: Any, payload: Any, key: str) -> int | None:
    """The token count token2text found, else the length of the id list in the payload."""
    if isinstance(decoded, int):
        return decoded
    ids = payload.get(key) if isinstance(payload, dict) else None
    return len(ids) if isinstance(ids, list) else None


def _score(outputs: Any) -> float | None:
    if isinstance(outputs, dict):
        for key in ("score", "reward"):
            if key in outputs:
                outputs = outputs[key]
                break
    if isinstance(outputs, (int, float)) and not isinstance(outputs, bool):
        return float(outputs)
    return None
