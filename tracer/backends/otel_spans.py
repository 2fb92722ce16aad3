"""TrajectoryRecord -> finished OpenTelemetry ``ReadableSpan`` objects, shared by the MLflow and
OTLP backends.

Every span carries MLflow's attributes (``mlflow.spanType``, ``mlflow.spanInputs``,
``mlflow.spanOutputs``; on the root span ``mlflow.traceTag.<key>`` for every
``record.tags()`` entry and the reward), so an OTLP stream lands well in an MLflow server. With
``conventions`` holding ``"genai"`` (the OTLP backend) spans also carry the OpenTelemetry GenAI
semantic conventions, read by Langfuse, Jaeger and MLflow alike (``"openinference"`` adds
Phoenix's, see :mod:`tracer.backends.openinference`):

=========== ========================== ==================================================
kind        ``gen_ai.operation.name``  other attributes
=========== ========================== ==================================================
trajectory  invoke_agent               gen_ai.agent.name
generate    chat                       gen_ai.usage.input_tokens / output_tokens,
                                       gen_ai.input.messages / output.messages,
                                       gen_ai.response.finish_reasons, gen_ai.request.model
tool        execute_tool               gen_ai.tool.name, gen_ai.tool.call.id,
                                       gen_ai.tool.call.arguments / result
=========== ========================== ==================================================

Generate spans whose inputs hold a ``messages`` list also carry ``mlflow.chat.messages``: the
conversation as OpenAI-style chat messages (roles ``system``/``user``/``assistant``/``tool``,
string content, ``tool_calls`` with an id and JSON-string arguments) followed by the assistant's
reply (``response_text``, else the text in the outputs). MLflow's trace UI renders this attribute
as the span's Chat tab; malformed messages would make it fall back to raw JSON, so every
message is normalized to the shape the UI accepts. The root span's outputs gain an OpenAI
``choices`` entry with the final reply (its tail when long): MLflow shows it as the trace's
response in the traces list and as the root span's assistant output.

A tool span's name follows the conventions asked for: with ``"openinference"`` it is the tool's
name (``tool_name``: ``calculator``, as Phoenix's tree shows tools), with ``"genai"`` alone
``execute_tool calculator`` (the GenAI span name), with neither (the MLflow backend) the op's
own name (``call_tool``, as recorded; MLflow's ``span.name`` and verl's names stay as they are).

Attribute values are built as plain Python values and then encoded by ``encode``: the MLflow
backend JSON-encodes every value (MLflow's in-process span format); the OTLP backend keeps
strings, numbers and booleans as they are and JSON-encodes the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from tracer.backends.openinference import add_io, openinference_attributes
from tracer.chat import chat_message, dumps, output_text, parsed_tool_calls
from tracer.record import KINDS, SpanRecord, TrajectoryRecord

SCOPE_NAME = "rollout-tracer"

_OPERATION = {"trajectory": "invoke_agent", "generate": "chat", "tool": "execute_tool"}
_JSON_KEYS = frozenset(
    {
        "mlflow.spanInputs",
        "mlflow.spanOutputs",
        "mlflow.chat.messages",
        "gen_ai.input.messages",
        "gen_ai.output.messages",
        "gen_ai.tool.call.arguments",
        "gen_ai.tool.call.result",
    }
)


# OpenInference's payload keys, and MLflow's keys that hold the same object.
_SAME = {"input.value": "mlflow.spanInputs", "output.value": "mlflow.spanOutputs"}


def encode_all_json(key: str, value: Any) -> Any:
    """MLflow's in-process convention: every attribute value is a JSON string."""
    return dumps(value)


def encode_otlp(key: str, value: Any) -> Any:
    """OTLP: primitives stay primitive; MLflow's payload keys and containers become JSON."""
    if key in _JSON_KEYS:
        return value if isinstance(value, str) and key.startswith("gen_ai.") else dumps(value)
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    return dumps(value)


def root_inputs(record: TrajectoryRecord) -> Any:
    """The root span's inputs: what the pipeline put there (the first child's inputs), else
    the trajectory's identity."""
    if record.spans and record.root.inputs is not None:
        return record.root.inputs
    return {
        "step": record.step,
        "sample_index": record.sample_index,
        "rollout_n": record.rollout_n,
        "validate": record.validate,
        **({"attributes": record.attributes} if record.attributes else {}),
    }


def root_outputs(record: TrajectoryRecord) -> Any:
    """The root span's outputs: what the pipeline put there (reward and last output), else a
    summary with the reward."""
    if record.spans and record.root.outputs is not None:
        return record.root.outputs
    return {"reward": record.reward, "num_spans": len(record.spans), "status": record.status}


def span_attributes(
    record: TrajectoryRecord,
    span: SpanRecord,
    is_root: bool,
    conventions: Collection[str] = (),
    parsed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Plain-valued attributes of one span (not yet encoded). ``conventions``: which semantic
    conventions to add to MLflow's attributes ("genai", "openinference"); ``parsed``: the
    record's :func:`tracer.chat.parsed_tool_calls`, needed for "openinference"."""
    attrs: dict[str, Any] = {
        "mlflow.spanType": KINDS.get(span.kind, "UNKNOWN"),
        "mlflow.spanInputs": root_inputs(record) if is_root else span.inputs,
        "mlflow.spanOutputs": root_outputs(record) if is_root else span.outputs,
        "rollout_tracer.kind": span.kind,
    }
    if span.kind == "generate":
        chat = chat_messages(span)
        if chat:
            attrs["mlflow.chat.messages"] = chat
    elif is_root:
        last = _last_generate(record)
        reply = output_text(last) if last is not None else None
        outputs = attrs["mlflow.spanOutputs"]
        if reply and isinstance(outputs, dict) and not {"messages", "choices"} & outputs.keys():
            attrs["mlflow.spanOutputs"] = {"choices": [_preview_choice(reply)], **outputs}
    attrs.update(span.attributes)
    if is_root:
        for key, value in record.tags().items():
            attrs[f"mlflow.traceTag.{key}"] = value
        if record.reward is not None:
            attrs["mlflow.traceTag.reward"] = repr(float(record.reward))
            attrs["reward"] = record.reward
        attrs["mlflow.traceTag.mlflow.traceName"] = record.name
    if "genai" in conventions:
        attrs.update(genai_attributes(record, span))
    if "openinference" in conventions:
        attrs.update(openinference_attributes(record, span, is_root, parsed or {}))
        add_io(attrs, attrs["mlflow.spanInputs"], attrs["mlflow.spanOutputs"])
    return attrs


def genai_attributes(record: TrajectoryRecord, span: SpanRecord) -> dict[str, Any]:
    """OpenTelemetry GenAI semantic-convention attributes for one span."""
    out: dict[str, Any] = {}
    op = _OPERATION.get(span.kind)
    if op is not None:
        out["gen_ai.operation.name"] = op
    attrs = span.attributes
    inputs = span.inputs if isinstance(span.inputs, dict) else {}
    if span.kind == "trajectory":
        out["gen_ai.agent.name"] = record.name
    elif span.kind == "generate":
        for src, dst in (
            ("prompt_tokens", "gen_ai.usage.input_tokens"),
            ("response_tokens", "gen_ai.usage.output_tokens"),
        ):
            if isinstance(attrs.get(src), int):
                out[dst] = attrs[src]
        model = inputs.get("model")
        if isinstance(model, str):
            out["gen_ai.request.model"] = model
        finish = attrs.get("finish_reason")
        if isinstance(finish, str):
            out["gen_ai.response.finish_reasons"] = [finish]
        messages = _input_messages(inputs.get("messages"))
        if messages:
            out["gen_ai.input.messages"] = messages
        output = _output_messages(span, finish if isinstance(finish, str) else None)
        if output:
            out["gen_ai.output.messages"] = output
    elif span.kind == "tool":
        name = attrs.get("tool_name")
        if isinstance(name, str):
            out["gen_ai.tool.name"] = name
        for key in ("tool_call_id", "call_id", "id"):
            value = inputs.get(key)
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                out["gen_ai.tool.call.id"] = str(value)
                break
        if span.inputs is not None:
            out["gen_ai.tool.call.arguments"] = span.inputs
        if span.outputs is not None:
            out["gen_ai.tool.call.result"] = span.outputs
    if span.error is not None:
        out["error.type"] = str(span.error.get("type", "Exception"))
    return out


# MLflow (OSS) keeps the first 1000 characters of a trace's response as its preview in the
# traces list (mlflow.tracing.constant.TRACE_REQUEST_RESPONSE_PREVIEW_MAX_LENGTH_OSS).
PREVIEW_CHARS = 1000


def _last_generate(record: TrajectoryRecord) -> SpanRecord | None:
    for span in reversed(record.spans):
        if span.kind == "generate":
            return span
    return None


def _preview_choice(reply: str) -> dict[str, Any]:
    """The final reply as an OpenAI ``choices`` entry, which MLflow reads for the trace's
    response preview. MLflow cuts previews at the head; the answer is usually at the end of
    a long reply, so a long reply keeps its tail here (the full text is in the spans)."""
    if len(reply) > PREVIEW_CHARS:
        reply = "[...] " + reply[-(PREVIEW_CHARS - 6) :]
    return {"index": 0, "message": {"role": "assistant", "content": reply}}


def chat_messages(span: SpanRecord) -> list[dict[str, Any]] | None:
    """``mlflow.chat.messages`` of a generate span: its input ``messages`` as OpenAI-style chat
    messages plus the assistant's reply; None when the inputs have no messages list."""
    inputs = span.inputs if isinstance(span.inputs, dict) else {}
    messages = inputs.get("messages")
    if not isinstance(messages, list):
        return None
    out = [chat_message(m, i) for i, m in enumerate(messages) if isinstance(m, dict)]
    if not out:
        return None
    text = output_text(span)
    if text is not None:
        out.append({"role": "assistant", "content": text})
    return out


def _parts(message: dict[str, Any]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    content = message.get("content")
    if message.get("role") == "tool":
        return [
            {
                "type": "tool_call_response",
                "id": message.get("tool_call_id"),
                "response": content,
            }
        ]
    if isinstance(content, str):
        parts.append({"type": "text", "content": content})
    elif content is not None:
        parts.append({"type": "text", "content": dumps(content)})
    for call in message.get("tool_calls") or []:
        if isinstance(call, dict):
            function = call.get("function")
            fn: dict[str, Any] = function if isinstance(function, dict) else call
            parts.append(
                {
                    "type": "tool_call",
                    "id": call.get("id"),
                    "name": fn.get("name"),
                    "arguments": fn.get("arguments"),
                }
            )
    return parts


def _input_messages(messages: Any) -> list[dict[str, Any]] | None:
    if not isinstance(messages, list) or not messages:
        return None
    out = [
        {"role": str(m.get("role", "user")), "parts": _parts(m)}
        for m in messages
        if isinstance(m, dict)
    ]
    return out or None


def _output_messages(span: SpanRecord, finish: str | None) -> list[dict[str, Any]] | None:
    text = output_text(span)
    if text is None:
        return None
    return [
        {
            "role": "assistant",
            "parts": [{"type": "text", "content": text}],
            "finish_reason": finish or "stop",
        }
    ]


def span_name(span: SpanRecord, conventions: Collection[str] = ()) -> str:
    """The span's name under ``conventions``: a tool span is named after its tool (see the
    module's docstring); every other span keeps the op's name."""
    tool = span.attributes.get("tool_name") if span.kind == "tool" else None
    if not isinstance(tool, str) or not tool:
        return span.name
    if "openinference" in conventions:
        return tool
    if "genai" in conventions:
        return f"execute_tool {tool}"
    return span.name


def to_readable_spans(
    record: TrajectoryRecord,
    *,
    conventions: Collection[str] = (),
    encode: Callable[[str, Any], Any] = encode_all_json,
    extra_attributes: dict[str, Any] | None = None,
    resource: Any = None,
) -> list[Any]:
    """Finished ``opentelemetry.sdk.trace.ReadableSpan`` objects for one trajectory (root
    first). ``extra_attributes`` are added to every span as given (already encoded)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

    trace_int = int(record.trace_id, 16)
    if resource is None:
        resource = Resource.get_empty()
    scope = InstrumentationScope(SCOPE_NAME)
    parsed = None
    if "openinference" in conventions:
        parsed = parsed_tool_calls(record)
    out = []
    for i, span in enumerate(record.spans):
        plain = span_attributes(record, span, i == 0, conventions, parsed)
        attrs = dict(extra_attributes or {})
        attrs.update({key: encode(key, value) for key, value in plain.items() if key not in _SAME})
        for key, twin in _SAME.items():  # the same payload under two names: serialized once
            if key in plain:
                same = plain[key] is plain[twin] and not isinstance(plain[key], str)
                attrs[key] = attrs[twin] if same else encode(key, plain[key])
        events = []
        if span.error is not None:
            events.append(
                Event(
                    "exception",
                    {
                        "exception.type": span.error.get("type", ""),
                        "exception.message": span.error.get("message", ""),
                        "exception.stacktrace": span.error.get("traceback", ""),
                    },
                    timestamp=span.end_ns,
                )
            )
        ctx = SpanContext(
            trace_int,
            int(span.span_id, 16),
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )
        parent = (
            SpanContext(trace_int, int(span.parent_id, 16), is_remote=False)
            if span.parent_id
            else None
        )
        status = (
            Status(StatusCode.ERROR, (span.error or {}).get("message", ""))
            if span.status == "ERROR"
            else Status(StatusCode.OK)
        )
        out.append(
            ReadableSpan(
                name=span_name(span, conventions),
                context=ctx,
                parent=parent,
                resource=resource,
                attributes=attrs,
                events=events,
                start_time=span.start_ns,
                end_time=span.end_ns,
                status=status,
                instrumentation_scope=scope,
            )
        )
    return out
