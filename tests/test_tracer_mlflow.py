"""The tracer core against a real MLflow sqlite store, read back with MLflow's own client."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import pytest

import tracer
from tests.conftest import search_traces
from tracer.token_lists import FULL_LISTS_ATTRIBUTE, restore_lists

pytest.importorskip("mlflow")

EXP = "core-tests"


@dataclass
class GenOut:
    response_ids: list[int]
    finish_reason: str = "stop"


@dataclass
class ToyLoop:
    """A verl-shaped agent loop over a scripted 'engine': 3 turns, 2 tool calls."""

    tokenizer: Any
    replies: list[str] = field(default_factory=list)

    @tracer.trace_op(kind="generate")
    async def generate(self, prompt_ids: list[int], messages: list[dict[str, Any]]) -> GenOut:
        text = self.replies[len([m for m in messages if m["role"] == "assistant"])]
        return GenOut(self.tokenizer.encode(text, add_special_tokens=False))

    @tracer.trace_op(kind="parse")
    def parse(self, text: str) -> list[dict[str, Any]]:
        if "CALL " not in text:
            return []
        expr = text.split("CALL ", 1)[1].strip()
        return [{"name": "calculator", "arguments": {"expression": expr}}]

    @tracer.trace_op(kind="tool")
    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        a, b = arguments["expression"].split("+")
        return str(int(a) + int(b))

    @tracer.trace_op(kind="reward")
    def reward(self, text: str, answer: str) -> float:
        return 1.0 if text.strip().endswith(answer) else 0.0

    @tracer.trace_op(kind="trajectory")
    async def run(self, question: str, answer: str) -> dict[str, Any]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
        text = ""
        for _ in range(3):
            prompt_ids = self.tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=True
            )
            if not isinstance(prompt_ids, list):
                prompt_ids = list(prompt_ids["input_ids"])
            out = await self.generate(prompt_ids, messages)
            text = self.tokenizer.decode(out.response_ids)
            messages.append({"role": "assistant", "content": text})  # mutates after the call
            calls = self.parse(text)
            if not calls:
                break
            for call in calls:
                result = await self.call_tool(call["name"], call["arguments"])
                messages.append({"role": "tool", "content": result})
        return {"reward": self.reward(text, answer), "turns": len(messages)}


REPLIES = ["Let me add. CALL 2+3", "Now the rest. CALL 5+4", "The answer is 9"]


def test_three_turn_trajectory_span_tree_tags_and_text(mlflow_uri: str, smollm2_tokenizer: Any):
    tracer.init(
        backend="mlflow",
        tracking_uri=mlflow_uri,
        project_name=EXP,
        experiment_name="exp-a",
        token2text=True,
        raise_internal_errors=True,
    )
    loop = ToyLoop(smollm2_tokenizer, REPLIES)

    async def main() -> None:
        with tracer.trace_attr(step=3, sample_index=7, rollout_n=1, validate=False):
            await loop.run("What is 2+3+4?", "9")

    asyncio.run(main())
    assert tracer.flush(60)

    [trace] = search_traces(mlflow_uri, EXP, "tags.step = '3'")
    tags = trace.info.tags
    assert (tags["step"], tags["sample_index"], tags["rollout_n"]) == ("3", "7", "1")
    assert tags["validate"] == "false" and tags["experiment_name"] == "exp-a"
    spans = trace.data.spans
    by_id = {s.span_id: s for s in spans}
    root = next(s for s in spans if s.parent_id is None)
    assert root.name == "trajectory" and root.span_type == "AGENT"
    names = sorted(s.name for s in spans)
    assert names == sorted(
        [
            "trajectory",
            "run",
            "generate",
            "generate",
            "generate",
            "parse",
            "parse",
            "parse",
            "call_tool",
            "call_tool",
            "reward",
        ]
    )
    types = {s.name: s.span_type for s in spans}
    assert types == {
        "trajectory": "AGENT",
        "run": "AGENT",
        "generate": "CHAT_MODEL",
        "parse": "PARSER",
        "call_tool": "TOOL",
        "reward": "EVALUATOR",
    }
    run = next(s for s in spans if s.name == "run")
    assert run.parent_id == root.span_id
    assert all(
        by_id[s.parent_id].name == "run" for s in spans if s.name not in ("trajectory", "run")
    )

    gens = sorted((s for s in spans if s.name == "generate"), key=lambda s: s.start_time_ns)
    # token2text on every generate span, equal to the tokenizer's own decode
    for gen, reply in zip(gens, REPLIES, strict=True):
        # the UI shows a long id list compactly; the whole list is in one span attribute
        shown = gen.inputs["prompt_ids"]
        inputs, _ = restore_lists(gen.inputs, gen.outputs, gen.get_attribute(FULL_LISTS_ATTRIBUTE))
        ids = inputs["prompt_ids"]
        assert shown == f"{len(ids)} items: [{str(ids[:5])[1:-1]}, …, {str(ids[-5:])[1:-1]}]"
        assert gen.inputs["prompt_text"] == smollm2_tokenizer.decode(ids, skip_special_tokens=False)
        assert gen.outputs["response_text"] == reply
        assert gen.get_attribute("response_text") == reply
        assert gen.get_attribute("prompt_tokens") == len(ids)
    # snapshots: the message list as it was at each call, not as it ended
    assert [len(g.inputs["messages"]) for g in gens] == [1, 3, 5]
    tools = sorted((s for s in spans if s.name == "call_tool"), key=lambda s: s.start_time_ns)
    assert [t.inputs for t in tools] == [
        {"name": "calculator", "arguments": {"expression": "2+3"}},
        {"name": "calculator", "arguments": {"expression": "5+4"}},
    ]
    assert [t.outputs for t in tools] == ["5", "9"]
    # reward: a number on the evaluator span, an MLflow feedback, and a trace tag
    reward = next(s for s in spans if s.name == "reward")
    assert reward.outputs == 1.0
    assert [(a.name, a.value) for a in trace.info.assessments] == [("reward", 1.0)]
    assert tags["reward"] == "1.0"
    assert len(search_traces(mlflow_uri, EXP, "tags.step = '4'")) == 0


def test_exception_is_recorded_and_reraised(mlflow_uri: str):
    tracer.init(
        backend="mlflow", tracking_uri=mlflow_uri, project_name=EXP, raise_internal_errors=True
    )

    class ToolError(RuntimeError):
        pass

    @tracer.trace_op(kind="tool")
    def flaky(x: int) -> int:
        raise ToolError(f"bad input {x}")

    with (
        pytest.raises(ToolError, match="bad input 5") as info,
        tracer.trace_attr(step=1, sample_index=0),
    ):
        flaky(5)
    assert type(info.value) is ToolError  # unchanged, not wrapped
    assert tracer.flush(60)
    [trace] = search_traces(mlflow_uri, EXP)
    tool = next(s for s in trace.data.spans if s.name == "flaky")
    assert tool.status.status_code == "ERROR"
    assert tool.inputs == {"x": 5}
    [event] = [e for e in tool.events if e.name == "exception"]
    assert event.attributes["exception.type"] == "ToolError"
    assert "bad input 5" in event.attributes["exception.message"]
    assert "raise ToolError" in event.attributes["exception.stacktrace"]
    root = next(s for s in trace.data.spans if s.parent_id is None)
    assert root.status.status_code == "ERROR"
    assert trace.info.state == "ERROR"


def test_trace_false_disables_nested_ops(mlflow_uri: str):
    tracer.init(
        backend="mlflow", tracking_uri=mlflow_uri, project_name=EXP, raise_internal_errors=True
    )

    @tracer.trace_op(kind="generate")
    def gen(x: int) -> int:
        return x + 1

    with tracer.trace_attr(step=1, sample_index=0, trace=False):
        assert gen(1) == 2
        with tracer.trace_attr(step=1, sample_index=1):  # nested: still off
            gen(2)
    with tracer.trace_attr(step=1, sample_index=2):
        gen(3)
    assert tracer.flush(60)
    traces = search_traces(mlflow_uri, EXP)
    assert [t.info.tags["sample_index"] for t in traces] == ["2"]


def _run_sampled_rollout(order: list[int], n_samples: int, rollout_n: int) -> None:
    @tracer.trace_op(kind="generate")
    async def gen(i: int) -> int:
        await asyncio.sleep(0)
        return i

    async def one(sample: int, k: int) -> None:
        with tracer.trace_attr(step=2, sample_index=sample, rollout_n=k):
            await gen(sample)

    async def main() -> None:
        await asyncio.gather(*[one(s, k) for s in order for k in range(rollout_n)])

    asyncio.run(main())


def test_sampling_is_deterministic_and_keeps_whole_groups(tmp_path):
    kept_sets = []
    for run in range(2):
        uri = f"sqlite:///{tmp_path / f'run{run}.db'}"
        order = list(range(20))
        random.Random(run).shuffle(order)  # a rerun starts samples in another order
        tracer.init(
            backend="mlflow",
            tracking_uri=uri,
            project_name=EXP,
            max_samples_per_step_per_worker=3,
            raise_internal_errors=True,
        )
        _run_sampled_rollout(order, 20, rollout_n=4)
        assert tracer.flush(60)
        traces = search_traces(uri, EXP, "tags.step = '2'")
        groups: dict[str, set[str]] = {}
        for t in traces:
            groups.setdefault(t.info.tags["sample_index"], set()).add(t.info.tags["rollout_n"])
        assert len(groups) == 3  # exactly N samples
        assert all(g == {"0", "1", "2", "3"} for g in groups.values())  # whole GRPO groups
        kept_sets.append(set(groups))
        tracer.reset()
    assert kept_sets[0] == kept_sets[1]


def test_sampling_zero_and_none(mlflow_uri: str):
    tracer.init(
        backend="mlflow",
        tracking_uri=mlflow_uri,
        project_name=EXP,
        max_samples_per_step_per_worker=None,
        raise_internal_errors=True,
    )
    _run_sampled_rollout(list(range(5)), 5, rollout_n=2)
    assert tracer.flush(60)
    assert len(search_traces(mlflow_uri, EXP)) == 10
    tracer.init(
        backend="mlflow",
        tracking_uri=mlflow_uri,
        project_name=EXP,
        max_samples_per_step_per_worker=0,
    )
    _run_sampled_rollout(list(range(5)), 5, rollout_n=2)
    assert tracer.flush(60)
    assert len(search_traces(mlflow_uri, EXP)) == 10


def test_thousand_trajectories_of_five_spans_all_stored(mlflow_uri: str):
    tracer.init(
        backend="mlflow", tracking_uri=mlflow_uri, project_name=EXP, raise_internal_errors=True
    )

    @tracer.trace_op(kind="generate")
    def gen(prompt: str) -> str:
        return prompt.upper()

    @tracer.trace_op(kind="tool")
    def tool(x: int) -> int:
        return x * 2

    @tracer.trace_op(kind="reward")
    def reward(x: int) -> float:
        return float(x % 2)

    for i in range(1000):
        with tracer.trace_attr(step=i // 100, sample_index=i % 100):
            gen(f"prompt {i}")
            tool(i)
            gen("again")
            reward(i)
    assert tracer.flush(300)
    traces = search_traces(mlflow_uri, EXP)
    assert len(traces) == 1000
    assert len({t.info.trace_id for t in traces}) == 1000
    assert all(len(t.data.spans) == 5 for t in traces)
    m = tracer.metrics()
    assert m["tracer/mlflow/exported"] == 1000 and m["tracer/dropped_buffer_full"] == 0
