"""OTLP backend: GenAI semantic-convention attributes (checked with the OTel SDK's
InMemorySpanExporter fed by our conversion), and a real lean ``mlflow server`` receiving the
stream over OTLP/HTTP, read back with MLflow's own client."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

import tracer
from tests._servers import MlflowServer
from tracer.backends.otlp_backend import OtlpExporter, resolve_endpoint
from tracer.config import TraceConfig
from tracer.testing import InMemoryExporter

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

EXP = "otlp-tests"


@tracer.trace_op(kind="generate")
def generate(messages: list[dict[str, Any]], prompt_ids: list[int]) -> dict[str, Any]:
    return {"content": "CALL add 2 3", "response_ids": [7, 8, 9], "finish_reason": "stop"}


@tracer.trace_op(kind="parse")
def parse(text: str) -> list[dict[str, Any]]:
    return [{"name": "add", "arguments": {"a": 2, "b": 3}}]


@tracer.trace_op(kind="tool")
def call_tool(name: str, arguments: dict[str, Any], tool_call_id: str) -> str:
    return str(arguments["a"] + arguments["b"])


@tracer.trace_op(kind="reward")
def compute_reward(answer: str) -> float:
    return 1.0 if answer == "5" else 0.0


class CharTokenizer:
    """A tiny real-behaving tokenizer for token2text: id -> chr(id + 96)."""

    def __len__(self) -> int:
        return 128

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i + 96) for i in ids)


def run_rollout(step: int, sample_index: int, rollout_n: int = 0) -> None:
    with tracer.trace_attr(step=step, sample_index=sample_index, rollout_n=rollout_n):
        messages = [{"role": "user", "content": "2+3?"}]
        out = generate(messages, prompt_ids=[1, 2, 3, 4])
        calls = parse(out["content"])
        answer = call_tool(calls[0]["name"], calls[0]["arguments"], tool_call_id="call_0")
        compute_reward(answer)


def test_genai_semconv_attributes() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    tracer.init({"backend": "memory", "token2text": True, "raise_internal_errors": True})
    tracer.register_tokenizer(CharTokenizer())
    run_rollout(step=1, sample_index=4, rollout_n=2)
    assert tracer.flush(timeout_s=30)
    [record] = InMemoryExporter.latest().records

    memory = InMemorySpanExporter()
    exporter = OtlpExporter(TraceConfig(backend="memory"), span_exporter=memory)
    assert exporter.export([record]).value == "success"
    spans = {s.name: s for s in memory.get_finished_spans()}
    # the tool span is named after the tool it ran, not the op that dispatched it
    assert list(spans) == ["trajectory", "generate", "parse", "add", "compute_reward"]
    root, gen, tool = spans["trajectory"], spans["generate"], spans["add"]
    assert root.parent is None
    children = [s for n, s in spans.items() if n != "trajectory"]
    assert all(s.parent is not None and s.parent.span_id == root.context.span_id for s in children)
    assert len({s.context.trace_id for s in spans.values()}) == 1
    assert f"{root.context.trace_id:032x}" == record.trace_id

    assert root.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert root.attributes["mlflow.spanType"] == "AGENT"
    assert root.attributes["mlflow.traceTag.step"] == "1"
    assert root.attributes["mlflow.traceTag.sample_index"] == "4"
    assert root.attributes["mlflow.traceTag.rollout_n"] == "2"
    assert root.attributes["mlflow.traceTag.attempt"] == "0"
    assert root.attributes["mlflow.traceTag.reward"] == "1.0"
    for key in record.tags():
        assert f"mlflow.traceTag.{key}" in root.attributes
    assert json.loads(root.attributes["mlflow.spanOutputs"])["reward"] == 1.0

    assert gen.attributes["gen_ai.operation.name"] == "chat"
    assert gen.attributes["mlflow.spanType"] == "CHAT_MODEL"
    assert gen.attributes["gen_ai.usage.input_tokens"] == 4
    assert gen.attributes["gen_ai.usage.output_tokens"] == 3
    assert list(gen.attributes["gen_ai.response.finish_reasons"]) == ["stop"]
    messages = json.loads(gen.attributes["gen_ai.input.messages"])
    assert messages == [{"role": "user", "parts": [{"type": "text", "content": "2+3?"}]}]
    out_messages = json.loads(gen.attributes["gen_ai.output.messages"])
    assert out_messages[0]["parts"][0]["content"] == "ghi"  # token2text of [7, 8, 9]
    assert json.loads(gen.attributes["mlflow.spanInputs"])["prompt_ids"] == [1, 2, 3, 4]

    assert tool.attributes["gen_ai.operation.name"] == "execute_tool"
    assert tool.attributes["mlflow.spanType"] == "TOOL"
    assert tool.attributes["gen_ai.tool.name"] == "add"
    assert tool.attributes["gen_ai.tool.call.id"] == "call_0"
    assert json.loads(tool.attributes["mlflow.spanOutputs"]) == "5"
    # no schema given: no OpenInference tool.parameters; the values are the span's input
    assert "tool.parameters" not in tool.attributes
    assert json.loads(tool.attributes["input.value"])["arguments"] == {"a": 2, "b": 3}
    assert "gen_ai.operation.name" not in spans["parse"].attributes
    assert spans["parse"].attributes["mlflow.spanType"] == "PARSER"
    assert spans["compute_reward"].attributes["mlflow.spanType"] == "EVALUATOR"


@pytest.mark.parametrize(
    ("conventions", "name"),
    [(["genai"], "execute_tool add"), (["openinference"], "add"), ([], "call_tool")],
)
def test_tool_span_name_follows_the_conventions(conventions: list[str], name: str) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    tracer.init({"backend": "memory", "raise_internal_errors": True})
    run_rollout(step=1, sample_index=0)
    assert tracer.flush(timeout_s=30)
    [record] = InMemoryExporter.latest().records
    memory = InMemorySpanExporter()
    config = TraceConfig(backend="memory", otlp_conventions=conventions)
    assert OtlpExporter(config, span_exporter=memory).export([record]).value == "success"
    [tool] = [s for s in memory.get_finished_spans() if s.attributes["mlflow.spanType"] == "TOOL"]
    assert tool.name == name
    # the record keeps the op's name (JSONL, MLflow), with the tool's as an attribute
    [span] = [s for s in record.spans if s.kind == "tool"]
    assert span.name == "call_tool" and span.attributes["tool_name"] == "add"


def test_endpoint_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    base = TraceConfig(backend=None, otlp_endpoint="http://collector:4318")
    assert resolve_endpoint(base) == "http://collector:4318/v1/traces"
    full = TraceConfig(backend=None, otlp_endpoint="http://c:5000/v1/traces")
    assert resolve_endpoint(full) == "http://c:5000/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://envhost:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-env=1,x-both=env")
    exporter = OtlpExporter(TraceConfig(backend=None, otlp_headers={"x-both": "config"}))
    assert exporter.endpoint == "http://envhost:4318/v1/traces"
    headers = exporter.span_exporter._client._headers
    assert headers["x-env"] == "1" and headers["x-both"] == "config"


def test_otlp_to_real_mlflow_server(mlflow_server: MlflowServer) -> None:
    from mlflow.tracking import MlflowClient

    exp_id = mlflow_server.experiment_id(EXP)
    tracer.init(
        {
            "backend": "otlp",
            "project_name": EXP,
            "otlp_endpoint": f"{mlflow_server.url}/v1/traces",
            "otlp_headers": {"x-mlflow-experiment-id": exp_id},
            "raise_internal_errors": True,
        }
    )
    for i in range(3):
        run_rollout(step=1, sample_index=i)
    run_rollout(step=2, sample_index=0)
    assert tracer.flush(timeout_s=60)
    assert tracer.metrics()["tracer/otlp/exported"] == 4
    assert tracer.metrics()["tracer/otlp/failed"] == 0

    client = MlflowClient(tracking_uri=mlflow_server.url)
    deadline = time.monotonic() + 30
    while True:
        traces = client.search_traces(locations=[exp_id], filter_string="tags.step = '1'")
        if len(traces) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(traces) == 3
    assert sorted(t.info.tags["sample_index"] for t in traces) == ["0", "1", "2"]
    for trace in traces:
        assert trace.info.tags["reward"] == "1.0"
        assert trace.info.tags["rollout_n"] == "0"
        spans = {s.name: s for s in trace.data.spans}
        assert {n: s.span_type for n, s in spans.items()} == {
            "trajectory": "AGENT",
            "generate": "CHAT_MODEL",
            "parse": "PARSER",
            "add": "TOOL",
            "compute_reward": "EVALUATOR",
        }
        assert spans["add"].inputs == {
            "name": "add",
            "arguments": {"a": 2, "b": 3},
            "tool_call_id": "call_0",
        }
        assert spans["add"].outputs == "5"
        assert spans["generate"].inputs["messages"] == [{"role": "user", "content": "2+3?"}]
        assert spans["generate"].outputs["content"] == "CALL add 2 3"
        assert spans["trajectory"].inputs == spans["generate"].inputs
        assert spans["trajectory"].outputs["reward"] == 1.0
        assert spans["parse"].outputs == [{"name": "add", "arguments": {"a": 2, "b": 3}}]
    step2 = client.search_traces(locations=[exp_id], filter_string="tags.step = '2'")
    assert len(step2) == 1
