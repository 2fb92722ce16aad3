"""OpenInference attributes on the OTLP backend's spans (what Arize Phoenix reads), checked on
the spans the OTel SDK's InMemorySpanExporter receives, with every attribute name taken from
the ``openinference-semantic-conventions`` package itself."""

from __future__ import annotations

import json
from typing import Any

import pytest

import tracer
from tests import tool_rollout
from tracer.backends.openinference import SPAN_KINDS
from tracer.backends.otlp_backend import OtlpExporter
from tracer.config import ConfigError, TraceConfig
from tracer.record import KINDS
from tracer.testing import InMemoryExporter

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
semconv = pytest.importorskip("openinference.semconv.trace")
SA = semconv.SpanAttributes
MA = semconv.MessageAttributes
TC = semconv.ToolCallAttributes


def traced_record() -> Any:
    tracer.init({"backend": "memory", "raise_internal_errors": True})
    tool_rollout.run(step=3, samples=1, rollout_n=1)
    assert tracer.flush(timeout_s=30)
    [record] = InMemoryExporter.latest().records
    return record


def export_spans(record: Any, **config: Any) -> dict[str, list[Any]]:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    exporter = OtlpExporter(TraceConfig(backend="memory", **config), span_exporter=memory)
    assert exporter.export([record]).value == "success"
    spans: dict[str, list[Any]] = {}
    for span in memory.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    return spans


def test_span_kinds_are_openinference_kinds() -> None:
    valid = {v.value for v in semconv.OpenInferenceSpanKindValues}
    assert set(SPAN_KINDS) == set(KINDS)  # every kind of ours has a mapping
    assert set(SPAN_KINDS.values()) <= valid


def test_multi_turn_tool_rollout_attributes() -> None:
    record = traced_record()
    spans = export_spans(record)
    [root] = [s for group in spans.values() for s in group if s.parent is None]
    [agent] = spans["agent"]
    # the tool spans are named after the tool, not the op that dispatched them (call_tool)
    gens, tools = spans["generate"], spans["calculator"]
    assert "call_tool" not in spans
    assert len(gens) == 3 and len(tools) == 2
    kind = SA.OPENINFERENCE_SPAN_KIND
    assert root.attributes[kind] == "AGENT" and agent.attributes[kind] == "AGENT"
    assert {g.attributes[kind] for g in gens} == {"LLM"}
    assert {t.attributes[kind] for t in tools} == {"TOOL"}
    assert spans["parse"][0].attributes[kind] == "CHAIN"
    assert spans["score"][0].attributes[kind] == "EVALUATOR"

    # the second LLM call: system, user, assistant with a tool call, the tool's result
    second = gens[1].attributes
    prefix = f"{SA.LLM_INPUT_MESSAGES}.2."
    assert [second[f"{SA.LLM_INPUT_MESSAGES}.{i}.{MA.MESSAGE_ROLE}"] for i in range(4)] == [
        "system", "user", "assistant", "tool"
    ]  # fmt: skip
    assert second[f"{SA.LLM_INPUT_MESSAGES}.1.{MA.MESSAGE_CONTENT}"] == tool_rollout.QUESTION
    call = f"{prefix}{MA.MESSAGE_TOOL_CALLS}.0."
    assert second[call + TC.TOOL_CALL_FUNCTION_NAME] == "calculator"
    assert json.loads(second[call + TC.TOOL_CALL_FUNCTION_ARGUMENTS_JSON]) == {
        "expression": "17 * 23"
    }
    assert second[call + TC.TOOL_CALL_ID] == "call_0_0"
    assert second[f"{SA.LLM_INPUT_MESSAGES}.3.{MA.MESSAGE_CONTENT}"] == "391"
    assert second[f"{SA.LLM_INPUT_MESSAGES}.3.{MA.MESSAGE_TOOL_CALL_ID}"] == "call_0_0"
    # its reply: the text, and the tool call the parse span found in it
    out = f"{SA.LLM_OUTPUT_MESSAGES}.0."
    assert second[out + MA.MESSAGE_ROLE] == "assistant"
    assert second[out + MA.MESSAGE_CONTENT].startswith("Now add four.")
    out_call = f"{out}{MA.MESSAGE_TOOL_CALLS}.0."
    assert second[out_call + TC.TOOL_CALL_FUNCTION_NAME] == "calculator"
    assert json.loads(second[out_call + TC.TOOL_CALL_FUNCTION_ARGUMENTS_JSON]) == {
        "expression": "391 + 4"
    }
    last = gens[2].attributes
    assert last[out + MA.MESSAGE_CONTENT] == "The answer is 395."
    assert f"{out}{MA.MESSAGE_TOOL_CALLS}.0.{TC.TOOL_CALL_FUNCTION_NAME}" not in last
    assert second[SA.LLM_TOKEN_COUNT_PROMPT] == 27 and second[SA.LLM_TOKEN_COUNT_COMPLETION] == 5
    assert second[SA.LLM_TOKEN_COUNT_TOTAL] == 32
    assert second[SA.INPUT_MIME_TYPE] == "application/json"
    assert json.loads(second[SA.INPUT_VALUE])["prompt_ids"][:3] == [1, 2, 3]

    tool = tools[1].attributes
    assert tool[SA.TOOL_NAME] == "calculator"
    # tool.parameters is the tool's JSON schema (the rollout gave it); the values are the input
    assert json.loads(tool[SA.TOOL_PARAMETERS]) == tool_rollout.CALCULATOR_SCHEMA
    assert json.loads(tool[SA.INPUT_VALUE])["arguments"] == {"expression": "391 + 4"}
    assert tool[SA.OUTPUT_VALUE] == "395" and tool[SA.OUTPUT_MIME_TYPE] == "text/plain"
    # the payload under MLflow's name and OpenInference's is one serialization
    assert tool[SA.INPUT_VALUE] == tool["mlflow.spanInputs"]

    rootattrs = root.attributes
    assert rootattrs[SA.SESSION_ID] == "default/train/step-3/sample-0"
    assert {"step=3", "sample_index=0", "rollout_n=0", "validate=false"} <= set(
        rootattrs[SA.TAG_TAGS]
    )
    metadata = json.loads(rootattrs[SA.METADATA])
    assert metadata["step"] == "3" and metadata["rollout_n"] == "0"
    assert metadata["reward"] == 1.0 and rootattrs["reward"] == 1.0
    assert spans["score"][0].attributes["reward"] == 1.0
    assert rootattrs[SA.AGENT_NAME] == record.name
    # GenAI attributes are still there next to them
    assert gens[1].attributes["gen_ai.operation.name"] == "chat"


@pytest.mark.parametrize(
    ("conventions", "genai", "openinference"),
    [(["genai"], True, False), (["openinference"], False, True), ([], False, False)],
)
def test_conventions_switch(conventions: list[str], genai: bool, openinference: bool) -> None:
    spans = export_spans(traced_record(), otlp_conventions=conventions)
    gen = spans["generate"][1].attributes
    assert ("gen_ai.operation.name" in gen) is genai
    assert (SA.OPENINFERENCE_SPAN_KIND in gen) is openinference
    assert (f"{SA.LLM_INPUT_MESSAGES}.0.{MA.MESSAGE_ROLE}" in gen) is openinference
    assert gen["mlflow.spanType"] == "CHAT_MODEL"  # MLflow's attributes always


def test_default_is_both_and_bad_names_fail() -> None:
    assert TraceConfig(backend=None).otlp_conventions == ["genai", "openinference"]
    assert TraceConfig(backend=None, otlp_conventions="GenAI").otlp_conventions == ["genai"]
    with pytest.raises(ConfigError, match=r"openinferense.*openinference.*accepts: genai, open"):
        TraceConfig(backend=None, otlp_conventions=["genai", "openinferense"])
    with pytest.raises(ConfigError, match="must be a name or a list"):
        TraceConfig(backend=None, otlp_conventions=3)  # type: ignore[arg-type]
