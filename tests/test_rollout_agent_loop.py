"""Scripted multi-turn trajectories with the real SmolLM2 tokenizer, traced into a real MLflow
sqlite store and read back with MLflow's own client."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

import tracer
from rollout.agent_loop import SYSTEM_PROMPT, AgentLoopConfig, ToolAgentLoop
from rollout.config import load_config
from rollout.engines import make_engine
from rollout.engines.base import SamplingParams
from rollout.engines.scripted import ScriptedEngine
from rollout.tools import default_tools
from rollout.trackers import Tracker, Tracking
from rollout.worker import RolloutWorker
from tests.conftest import search_traces

EXP = "rollout-tests"
CALL = '<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{}"}}}}\n</tool_call>'
SCRIPT = {
    "apples": [f"First 3*4.\n{CALL.format('3*4')}", f"Now add 2.\n{CALL.format('12+2')}",
               "So the total is 14.\n#### 14"],
}  # fmt: skip
BAD_CALLS = [
    '<tool_call>{"name": "web", "arguments": {}}</tool_call>',  # unknown tool
    "<tool_call>{not json</tool_call>",  # invalid JSON
    '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',  # bad args
    '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}'
    "</tool_call>",  # unsafe
    '<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>',
    '<tool_call>{"name": "python", "arguments": {"code": "import os; os.abort()"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": "oops"}</tool_call>',
]


def messages(question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def test_three_turn_trajectory_in_mlflow(mlflow_uri: str, smollm2_tokenizer: Any) -> None:
    tracer.init(backend="mlflow", tracking_uri=mlflow_uri, project_name=EXP, token2text=True,
                experiment_name="scripted", raise_internal_errors=True)  # fmt: skip
    loop = ToolAgentLoop(ScriptedEngine(smollm2_tokenizer, SCRIPT), default_tools())

    async def main() -> Any:
        with tracer.trace_attr(step=1, sample_index=5, rollout_n=0, policy_version=1):
            return await loop.run(messages("3 bags of 4 apples and 2 more?"),
                                  SamplingParams(max_tokens=64), ground_truth=14)  # fmt: skip

    out = asyncio.run(main())
    assert out.finish_reason == "stop" and out.num_assistant_turns == 3
    assert (out.tool_calls, out.tool_errors) == (2, 0)
    assert out.reward["score"] == pytest.approx(1.1)
    # response mask: model tokens are exactly the assistant turns
    assert len(out.response_mask) == len(out.response_ids)
    model = [t for t, m in zip(out.response_ids, out.response_mask, strict=True) if m]
    assert model == [t for turn in out.turns if turn.role == "assistant" for t in turn.token_ids]
    assert [t.role for t in out.turns] == ["assistant", "tool", "assistant", "tool", "assistant"]
    # the incremental token stream equals the template rendering of the final conversation
    text = smollm2_tokenizer.decode(out.prompt_ids + out.response_ids)
    # the project's Hermes template: tool responses are a user turn of <tool_response> blocks
    assert ("<|im_start|>user\n<tool_response>\n12\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\nNow add 2.") in text  # fmt: skip
    assert text.endswith("#### 14<|im_end|>")
    assert tracer.flush(60)

    [trace] = search_traces(mlflow_uri, EXP, "tags.step = '1'")
    tags = trace.info.tags
    assert (tags["step"], tags["sample_index"], tags["rollout_n"]) == ("1", "5", "0")
    spans = trace.data.spans
    root = next(s for s in spans if s.parent_id is None)
    assert root.name == "trajectory" and root.span_type == "AGENT"
    run = next(s for s in spans if s.name == "run")
    assert run.parent_id == root.span_id
    # the run span's ids decode with the tokenizer of the trajectory's generate spans
    assert all("token2text_error" not in s.attributes for s in spans)
    assert run.get_attribute("response_text").endswith("#### 14<|im_end|>")
    kinds = sorted((s.name, s.span_type) for s in spans if s.parent_id == run.span_id)
    assert kinds == sorted(
        [("generate", "CHAT_MODEL")] * 3 + [("parse", "PARSER")] * 3
        + [("call_tool", "TOOL")] * 2 + [("reward", "EVALUATOR")]
    )  # fmt: skip
    gens = sorted((s for s in spans if s.name == "generate"), key=lambda s: s.start_time_ns)
    assert [g.outputs["finish_reason"] for g in gens] == ["stop"] * 3
    assert gens[1].outputs["response_text"].startswith("Now add 2.")
    assert [len(g.inputs["messages"]) for g in gens] == [2, 4, 6]
    tools = sorted((s for s in spans if s.name == "call_tool"), key=lambda s: s.start_time_ns)
    assert [t.inputs["arguments"] for t in tools] == [{"expression": "3*4"},
                                                      {"expression": "12+2"}]  # fmt: skip
    assert [t.outputs["content"] for t in tools] == ["12", "14"]
    reward = next(s for s in spans if s.name == "reward")
    assert reward.outputs["score"] == pytest.approx(1.1)


def test_every_bad_tool_call_is_an_error_response(smollm2_tokenizer: Any) -> None:
    from tracer.testing import InMemoryExporter

    tracer.init(backend="memory", token2text=True, raise_internal_errors=True)
    traces = InMemoryExporter.latest()
    script = {"eggs": ["".join(BAD_CALLS), "Sorry.\n#### 0"]}
    tools = default_tools()
    tools.tools["python"].timeout_s = 1.0  # type: ignore[attr-defined]
    config = AgentLoopConfig(response_length=2048)
    loop = ToolAgentLoop(ScriptedEngine(smollm2_tokenizer, script), tools, config)

    async def main() -> Any:
        with tracer.trace_attr(step=0, sample_index=0, rollout_n=0):
            return await loop.run(messages("How many eggs?"), SamplingParams(max_tokens=400))

    out = asyncio.run(main())
    assert out.finish_reason == "stop" and out.num_assistant_turns == 2
    assert out.tool_calls == out.tool_errors == len(BAD_CALLS)
    tool_msgs = [m for m in out.messages if m["role"] == "tool"]
    assert len(tool_msgs) == len(BAD_CALLS)
    assert all(m["content"].startswith("Error: ") for m in tool_msgs)
    joined = "\n".join(m["content"] for m in tool_msgs)
    for needle in (
        "unknown tool 'web'",
        "invalid JSON",
        "missing required argument",
        "unsupported syntax",
        "timed out",
        "exit code",
        "invalid JSON in arguments",
    ):
        assert needle in joined  # fmt: skip
    tracer.flush(30)
    [record] = traces.records
    tool_spans = [s for s in record.spans if s.kind == "tool"]
    assert len(tool_spans) == len(BAD_CALLS) and all(s.status == "OK" for s in tool_spans)


def test_length_and_turn_limits(smollm2_tokenizer: Any) -> None:
    forever = ScriptedEngine(smollm2_tokenizer, lambda prompt, i: CALL.format("1+1"))
    loop = ToolAgentLoop(forever, default_tools(), AgentLoopConfig(max_assistant_turns=2))
    out = asyncio.run(loop.run(messages("q"), SamplingParams(max_tokens=64)))
    assert out.finish_reason == "max_turns" and out.num_assistant_turns == 2
    loop = ToolAgentLoop(forever, default_tools(), AgentLoopConfig(response_length=40))
    out = asyncio.run(loop.run(messages("q"), SamplingParams(max_tokens=64)))
    assert out.finish_reason == "length" and len(out.response_ids) <= 40
    loop = ToolAgentLoop(forever, default_tools(), AgentLoopConfig(prompt_length=50))
    with pytest.raises(ValueError, match="prompt_length=50"):
        asyncio.run(loop.run(messages("q"), SamplingParams(max_tokens=64)))


def test_worker_runs_grpo_groups_with_policy_version(mlflow_uri: str) -> None:
    config = load_config([
        "actor_rollout_ref.rollout.name=scripted", "trainer.total_steps=2",
        "data.train_batch_size=3", "actor_rollout_ref.rollout.n=2",
    ])  # fmt: skip
    tracer.init(backend="mlflow", tracking_uri=mlflow_uri, project_name=EXP,
                token2text=True, raise_internal_errors=True)  # fmt: skip
    engine = make_engine(config, script=lambda p, i: f"{CALL.format('2+2')}" if i % 2 else "#### 4")
    worker = RolloutWorker(config, engine)
    results = asyncio.run(worker.run(2))
    assert [len(r.outputs) for r in results] == [6, 6]
    assert all(o.extra["policy_version"] == r.step for r in results for o in r.outputs)
    assert tracer.flush(60)
    step2 = search_traces(mlflow_uri, EXP, "tags.step = '2' and tags.validate = 'false'")
    assert len(step2) == 6
    groups: dict[str, set[str]] = {}
    for t in step2:
        groups.setdefault(t.info.tags["sample_index"], set()).add(t.info.tags["rollout_n"])
    assert len(groups) == 3 and all(v == {"0", "1"} for v in groups.values())
    # each GRPO group is an MLflow session (the metadata key MLflow's Sessions view reads)
    sessions: dict[str, set[str]] = {}
    for t in step2:
        key = t.info.trace_metadata["mlflow.trace.session"]
        sessions.setdefault(key, set()).add(t.info.tags["sample_index"])
    assert len(sessions) == 3 and all(len(v) == 1 for v in sessions.values())
    assert {f"step-2/sample-{i}" for v in sessions.values() for i in v} == {
        k.split("/", 1)[1] for k in sessions
    }
    # validation (trainer.val_before_train, test_freq=2): the same fixed prompts at steps 0, 2
    val = search_traces(mlflow_uri, EXP, "tags.validate = 'true'")
    seen = {(t.info.tags["step"], t.info.tags["sample_index"]) for t in val}
    assert seen == {("0", "0"), ("0", "1"), ("2", "0"), ("2", "1")}


def test_validation_every_test_freq_steps_and_tracker_table() -> None:
    config = load_config([
        "actor_rollout_ref.rollout.name=scripted", "trainer.total_steps=3",
        "trainer.test_freq=2", "trainer.val_before_train=false", "data.val_max_samples=3",
        "trainer.log_val_generations=2",
    ])  # fmt: skip
    engine = make_engine(config, script=lambda p, i: "#### 4")
    lines: list[str] = []
    tracking = Tracking.from_config(config, write=lines.append)
    tables: list[tuple[int, str, int]] = []

    class Table(Tracker):
        name = "table"

        def log(self, metrics: dict[str, float], step: int) -> None:
            pass

        def log_samples(self, rows: list[dict[str, Any]], step: int, key: str = "") -> None:
            tables.append((step, key, len(rows)))

    tracking.trackers.append(Table())
    vals: list[Any] = []

    def on_validate(result: Any) -> None:
        vals.append(result)
        tracking.log_validation(result)

    asyncio.run(RolloutWorker(config, engine).run(3, on_validate=on_validate))
    assert [(v.step, v.validate, len(v.outputs)) for v in vals] == [(2, True, 3), (3, True, 3)]
    assert [o.extra["sample_index"] for o in vals[0].outputs] == [0, 1, 2]  # the fixed set
    assert tables == [(2, "val/generations", 2), (3, "val/generations", 2)]
    assert [line.split(" |")[0] for line in lines] == ["validation at step 2",
                                                       "validation at step 3"]  # fmt: skip


FEEDBACK = {"name": "gsm8k_feedback", "max_user_turns": 2}


def test_interaction_feedback_turn_in_mlflow(mlflow_uri: str, smollm2_tokenizer: Any) -> None:
    tracer.init(backend="mlflow", tracking_uri=mlflow_uri, project_name=EXP, token2text=True,
                experiment_name="interaction", raise_internal_errors=True)  # fmt: skip
    script = {"apples": ["3 bags of 4 is 12.\n#### 12", f"Let me check.\n{CALL.format('3*4+2')}",
                         "So the total is 14.\n#### 14"]}  # fmt: skip
    config = AgentLoopConfig(response_length=512, interaction=FEEDBACK)
    loop = ToolAgentLoop(ScriptedEngine(smollm2_tokenizer, script), default_tools(), config)

    async def main() -> Any:
        with tracer.trace_attr(step=3, sample_index=1, rollout_n=0):
            return await loop.run(messages("3 bags of 4 apples and 2 more?"),
                                  SamplingParams(max_tokens=64), ground_truth=14)  # fmt: skip

    out = asyncio.run(main())
    # wrong answer -> feedback (user turn) -> tool call -> tool -> right answer -> stop
    assert out.finish_reason == "stop" and out.num_assistant_turns == 3
    assert (out.num_user_turns, out.tool_calls, out.turn_rewards) == (1, 1, [0.0, 1.0])
    assert [m["role"] for m in out.messages] == [
        "system", "user", "assistant", "user", "assistant", "tool", "assistant"]  # fmt: skip
    feedback = out.messages[3]["content"]
    assert feedback.startswith("Your answer 12 is incorrect.") and "#### <number>" in feedback
    assert '"name": "calculator"' in feedback
    assert out.reward["score"] == pytest.approx(1.1)
    assert out.reward["turn_scores"] == [0.0, 0.0, 1.0]
    # response mask: 1 exactly on the assistant turns; the feedback and tool turns are 0
    assert [t.role for t in out.turns] == ["assistant", "user", "assistant", "tool", "assistant"]
    assert out.response_mask == [int(t.role == "assistant") for t in out.turns
                                 for _ in t.token_ids]  # fmt: skip
    assert out.response_ids == [i for t in out.turns for i in t.token_ids]
    user = smollm2_tokenizer.decode(out.turns[1].token_ids)
    assert user == f"\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n"
    text = smollm2_tokenizer.decode(out.prompt_ids + out.response_ids)
    assert f"#### 12<|im_end|>\n<|im_start|>user\n{feedback}<|im_end|>\n" in text
    assert text.endswith("So the total is 14.\n#### 14<|im_end|>")
    assert tracer.flush(60)

    [trace] = search_traces(mlflow_uri, EXP, "tags.step = '3'")
    spans = trace.data.spans
    run = next(s for s in spans if s.name == "run")
    children = sorted((s for s in spans if s.parent_id == run.span_id),
                      key=lambda s: s.start_time_ns)  # fmt: skip
    assert [s.name for s in children] == [
        "generate", "parse", "interaction", "generate", "parse", "call_tool",
        "generate", "parse", "interaction", "reward"]  # fmt: skip
    first, second = (s for s in children if s.name == "interaction")
    assert first.span_type == "EVALUATOR"  # kind "interaction": the environment judges
    assert first.inputs["ground_truth"] == 14 and len(first.inputs["messages"]) == 3
    assert first.outputs["reward"] == 0.0 and first.outputs["should_terminate"] is False
    assert first.outputs["content"] == feedback
    assert second.outputs["reward"] == 1.0 and second.outputs["should_terminate"] is True
    gens = [s for s in children if s.name == "generate"]
    assert [len(g.inputs["messages"]) for g in gens] == [2, 4, 6]
    assert f"<|im_start|>user\n{feedback}<|im_end|>" in gens[1].inputs["prompt_text"]
    reward = next(s for s in spans if s.name == "reward")
    assert reward.outputs["score"] == pytest.approx(1.1)


def test_interaction_limits_and_config(smollm2_tokenizer: Any) -> None:
    wrong = ScriptedEngine(smollm2_tokenizer, lambda prompt, i: f"Attempt {i}.\n#### 7")

    def run(config: AgentLoopConfig, truth: Any = 14) -> Any:
        loop = ToolAgentLoop(wrong, default_tools(), config)
        return asyncio.run(loop.run(messages("q"), SamplingParams(max_tokens=64), truth))

    out = run(AgentLoopConfig(max_assistant_turns=5, response_length=1024, interaction=FEEDBACK))
    assert (out.num_assistant_turns, out.num_user_turns) == (3, 2)
    assert out.finish_reason == "max_turns" and out.turn_rewards == [0.0, 0.0, 0.0]
    out = run(AgentLoopConfig(max_assistant_turns=2, response_length=1024, interaction=FEEDBACK))
    assert (out.num_assistant_turns, out.num_user_turns, out.finish_reason) == (2, 1, "max_turns")
    out = run(AgentLoopConfig(response_length=60, interaction=FEEDBACK))  # feedback would not fit
    assert (out.num_assistant_turns, out.finish_reason) == (1, "length")
    assert len(out.response_ids) < 60 and out.response_mask[-1] == 1
    for off in (AgentLoopConfig(interaction={"name": None}), AgentLoopConfig()):
        out = run(off)
        assert (out.num_assistant_turns, out.turn_rewards, out.finish_reason) == (1, [], "stop")
    out = run(AgentLoopConfig(interaction=FEEDBACK), truth=None)  # nothing to judge against
    assert out.num_assistant_turns == 1 and out.turn_rewards == []
    # a length-truncated turn is judged too, and the model gets another try
    loop_config = AgentLoopConfig(response_length=1024, interaction=FEEDBACK)
    short = ToolAgentLoop(wrong, default_tools(), loop_config)
    cut = asyncio.run(short.run(messages("q"), SamplingParams(max_tokens=3), 14))
    assert cut.turns[0].finish_reason == "length" and cut.num_user_turns == 2
    assert cut.finish_reason == "length"
    text = smollm2_tokenizer.decode(cut.prompt_ids + cut.response_ids)
    assert "<|im_end|>\n<|im_start|>user\nI could not find a final answer." in text

    with pytest.raises(ValueError, match="valid: gsm8k_feedback, null"):
        ToolAgentLoop(wrong, None, AgentLoopConfig(interaction={"name": "x"}))
    with pytest.raises(ValueError, match="valid: gsm8k_feedback, null"):
        load_config(["actor_rollout_ref.rollout.multi_turn.interaction.name=gsm8k"])
    with pytest.raises(ValueError, match="max_user_turns must be an int"):
        load_config(["actor_rollout_ref.rollout.multi_turn.interaction.max_user_turns=-1"])
    config = load_config(["actor_rollout_ref.rollout.multi_turn.interaction.max_user_turns=2",
                          "actor_rollout_ref.rollout.multi_turn.interaction.name=gsm8k_feedback"])
    assert config["actor_rollout_ref"]["rollout"]["multi_turn"]["interaction"] == FEEDBACK
    worker = RolloutWorker(config, wrong)
    assert worker.agent.interaction is not None and worker.agent.interaction.max_user_turns == 2
    out = asyncio.run(worker.run_sample(1, {"index": 0, "question": "q", "answer": 14}, 0))
    assert (out.num_assistant_turns, out.num_user_turns, out.turn_rewards) == (3, 2, [0.0] * 3)
    config = load_config(["actor_rollout_ref.rollout.multi_turn.interaction.name=null"])
    assert RolloutWorker(config, wrong).agent.interaction is None
