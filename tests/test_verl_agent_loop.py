"""verl's agent loop, call for call, on ``from tracer import ...``.

The classes below replay the call sites of verl's agent loop (verl-project/verl,
``verl/experimental/agent_loop/agent_loop.py``, ``tool_agent_loop.py``, ``tool_parser.py``,
``verl/tools/base_tool.py``, ``verl/workers/rollout/llm_server.py``) with verl's signatures
and arguments: the worker's ``RolloutTraceConfig.init`` (positional), its per-call sample
selection from ``get_instance().max_samples_per_step_per_worker``, ``rollout_trace_attr(...,
name="agent_loop", trace=...)``, and inside it ``ToolAgentLoop.run``,
``LLMServerClient.generate(request_id, *, prompt_ids, sampling_params, ...)``,
``HermesToolParser.extract_tool_calls(responses_ids, tools)`` and ``BaseTool.execute(
instance_id, parameters, **kwargs)``. Only the engine is scripted; the tokenizer is SmolLM2's.
Everything is checked on what MLflow (read back with MlflowClient and the export readers) and
trackio (its own storage API) stored.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from typing import Any
from uuid import uuid4

import numpy as np
import pytest
from pydantic import BaseModel

import tracer
from tests.conftest import search_traces
from tracer import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op

PROJECT, EXPERIMENT = "verl-gsm8k", "grpo-run-1"
TOOL_CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
ANSWER = "2 + 2 = 4. The answer is 4."


# ------------------------------------------------------------------ verl's data types (shape)
class TokenOutput(BaseModel):
    token_ids: list[int]
    log_probs: list[float] | None = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = {}


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolResponse(BaseModel):
    text: str | None = None
    image: Any = None
    video: Any = None


class FunctionSchema(BaseModel):
    name: str
    description: str
    parameters: dict[str, Any]


class OpenAIFunctionToolSchema(BaseModel):
    type: str = "function"
    function: FunctionSchema


class AgentLoopOutput(BaseModel):
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    num_turns: int
    reward_score: float | None = None


# ----------------------------------------------------------- verl's traced methods, replayed
class LLMServerClient:
    """The engine is scripted: the first turn calls the calculator, the next one answers."""

    def __init__(self, engine_tokenizer: Any) -> None:
        self._engine_tokenizer = engine_tokenizer  # token2text's `tokenizer` is set by the worker

    @rollout_trace_op
    async def generate(
        self,
        request_id: str,
        *,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        prompt = self._engine_tokenizer.decode(prompt_ids)
        text = ANSWER if "<|im_start|>tool" in prompt else TOOL_CALL
        ids = self._engine_tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed")


class HermesToolParser:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tool_call_regex = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    @rollout_trace_op
    async def extract_tool_calls(
        self, responses_ids: list[int], tools: list[OpenAIFunctionToolSchema] | None = None
    ) -> tuple[str, list[FunctionCall]]:
        text = self.tokenizer.decode(responses_ids, skip_special_tokens=True)
        calls = []
        for match in self.tool_call_regex.findall(text):
            call = json.loads(match)
            calls.append(FunctionCall(name=call["name"], arguments=json.dumps(call["arguments"])))
        return self.tool_call_regex.sub("", text), calls


class BaseTool:
    def __init__(self, tool_schema: OpenAIFunctionToolSchema) -> None:
        self.tool_schema = tool_schema
        self.name = tool_schema.function.name

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, Any]:
        return instance_id or str(uuid4()), ToolResponse()

    @rollout_trace_op
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


class CalcTool(BaseTool):
    @rollout_trace_op
    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        a, b = parameters["expression"].split("+")
        return ToolResponse(text=str(int(a) + int(b))), 0.0, {"calls": 1}


class RewardManager:
    @rollout_trace_op
    async def compute_score(self, solution_str: str, ground_truth: str) -> float:
        return 1.0 if solution_str.strip().endswith(f"answer is {ground_truth}.") else 0.0


class AgentData:
    def __init__(self, messages: list[dict[str, Any]], prompt_ids: list[int]) -> None:
        self.messages = messages
        self.prompt_ids = prompt_ids
        self.response_ids: list[int] = []


class ToolAgentLoop:
    def __init__(self, server_manager: LLMServerClient, tokenizer: Any) -> None:
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        schema = OpenAIFunctionToolSchema(
            function=FunctionSchema(
                name="calculator",
                description="Adds two numbers",
                parameters={"type": "object", "properties": {"expression": {"type": "string"}}},
            )
        )
        self.tools = {"calculator": CalcTool(schema)}
        self.tool_parser = HermesToolParser(tokenizer)
        self.reward = RewardManager()

    def _encode(self, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        request_id = uuid4().hex
        prompt_ids = self._encode(messages, generation_prompt=True)
        agent_data = AgentData(messages, list(prompt_ids))
        response_mask: list[int] = []
        turns = 0
        while True:
            output = await self.server_manager.generate(
                request_id=request_id,
                prompt_ids=agent_data.prompt_ids,
                sampling_params=sampling_params,
                image_data=None,
                video_data=None,
                audio_data=None,
                mm_processor_kwargs={},
            )
            turns += 1
            agent_data.response_ids = output.token_ids
            agent_data.prompt_ids = agent_data.prompt_ids + output.token_ids
            response_mask += [1] * len(output.token_ids)
            tools = [tool.tool_schema for tool in self.tools.values()]
            content, tool_calls = await self.tool_parser.extract_tool_calls(
                agent_data.response_ids, tools
            )
            messages.append({"role": "assistant", "content": content})
            if not tool_calls or turns >= 3:
                break
            for tool_call in tool_calls:
                tool = self.tools[tool_call.name]
                instance_id, _ = await tool.create(create_kwargs={})
                response, _, _ = await tool.execute(
                    instance_id, json.loads(tool_call.arguments), agent_data=agent_data
                )
                await tool.release(instance_id)
                messages.append({"role": "tool", "content": response.text or ""})
            # verl appends the tool turn's own tokens (its "continuous token" merge)
            tool_turn = f"\n<|im_start|>tool\n{messages[-1]['content']}<|im_end|>\n"
            tool_ids = self.tokenizer.encode(
                tool_turn + "<|im_start|>assistant\n", add_special_tokens=False
            )
            agent_data.prompt_ids = agent_data.prompt_ids + tool_ids
            response_mask += [0] * len(tool_ids)
        score = await self.reward.compute_score(content, kwargs["ground_truth"])
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=agent_data.prompt_ids[len(prompt_ids) :],
            response_mask=response_mask,
            num_turns=turns,
            reward_score=score,
        )


class AgentLoopWorker:
    """verl's AgentLoopWorker: init, per-call selection, one rollout_trace_attr per sample."""

    def __init__(self, trace_config: dict[str, Any], tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.llm_client = LLMServerClient(tokenizer)
        if trace_config.get("token2text", False):
            self.llm_client.tokenizer = self.tokenizer  # type: ignore[attr-defined]
        RolloutTraceConfig.init(
            trace_config["project_name"],
            trace_config["experiment_name"],
            trace_config.get("backend"),
            trace_config.get("token2text", False),
            trace_config.get("max_samples_per_step_per_worker", None),  # noqa: SIM910 (verl verbatim)
        )

    async def generate_sequences(self, batch: dict[str, Any]) -> list[AgentLoopOutput]:
        validate = batch["meta_info"].get("validate", False)
        sampling_params = {"temperature": 0 if validate else 1.0, "top_p": 1.0, "top_k": -1}
        index = np.asarray(batch["index"])
        max_samples_per_worker = RolloutTraceConfig.get_instance().max_samples_per_step_per_worker
        if max_samples_per_worker is not None:
            unique_sample_indices = np.unique(index)
            if max_samples_per_worker < len(unique_sample_indices):
                selected = set(
                    np.random.choice(unique_sample_indices, max_samples_per_worker, replace=False)
                )
                traced_indices = {i for i in range(len(index)) if index[i] in selected}
            else:
                traced_indices = set(range(len(index)))
        else:
            traced_indices = set(range(len(index)))
        seen: Counter[int] = Counter()
        tasks = []
        for i, sample_index in enumerate(index.tolist()):
            trajectory = {
                "step": batch["meta_info"].get("global_steps", -1),
                "sample_index": sample_index,
                "rollout_n": seen[sample_index],
                "validate": validate,
            }
            seen[sample_index] += 1
            kwargs = {"raw_prompt": batch["raw_prompt"][i], "ground_truth": "4"}
            tasks.append(
                asyncio.create_task(
                    self._run_agent_loop(
                        sampling_params, trajectory, trace=i in traced_indices, **kwargs
                    )
                )
            )
        return list(await asyncio.gather(*tasks))

    async def _run_agent_loop(
        self,
        sampling_params: dict[str, Any],
        trajectory: dict[str, Any],
        *,
        trace: bool = True,
        **kwargs: Any,
    ) -> AgentLoopOutput:
        with rollout_trace_attr(
            step=trajectory["step"],
            sample_index=trajectory["sample_index"],
            rollout_n=trajectory["rollout_n"],
            validate=trajectory["validate"],
            name="agent_loop",
            trace=trace,
        ):
            agent_loop = ToolAgentLoop(self.llm_client, self.tokenizer)
            return await agent_loop.run(sampling_params, **kwargs)


def make_batch(indices: list[int], n: int, step: int, validate: bool) -> dict[str, Any]:
    index = [i for i in indices for _ in range(n)]  # verl repeats each sample n times
    prompts = [[{"role": "user", "content": f"Problem {i}: what is 2+2?"}] for i in index]
    return {
        "index": index,
        "raw_prompt": prompts,
        "meta_info": {"global_steps": step, "validate": validate},
    }


def trace_config(backend: str, max_samples: int | None) -> dict[str, Any]:
    return {
        "backend": backend,
        "project_name": PROJECT,
        "experiment_name": EXPERIMENT,
        "token2text": True,
        "max_samples_per_step_per_worker": max_samples,
    }


# ------------------------------------------------------------------------------- the tests
@pytest.mark.slow(seconds=7)
def test_verl_agent_loop_on_mlflow(
    smollm2_tokenizer: Any, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tracer.readers import Selection, iter_records, records_rows

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    tok = smollm2_tokenizer
    np.random.seed(0)
    worker = AgentLoopWorker(trace_config("mlflow", 1), tok)
    assert RolloutTraceConfig.get_instance().max_samples_per_step_per_worker == 1

    async def main() -> None:
        # training step 1: 3 samples x n=2; the worker traces one sample, both its rollouts
        outs = await worker.generate_sequences(make_batch([0, 1, 2], 2, step=1, validate=False))
        assert all(o.reward_score == 1.0 and o.num_turns == 2 for o in outs)
        # validation at step 1, in two batches: verl selects per call, so one sample each
        await worker.generate_sequences(make_batch([10, 11, 12], 1, step=1, validate=True))
        await worker.generate_sequences(make_batch([13, 14, 15], 1, step=1, validate=True))

    asyncio.run(main())
    assert tracer.flush(60)

    train = search_traces(mlflow_uri, PROJECT, "tags.validate = 'False'")
    val = search_traces(mlflow_uri, PROJECT, "tags.validate = 'True'")
    assert len(train) == 2 and len({t.info.tags["sample_index"] for t in train}) == 1
    assert sorted(t.info.tags["rollout_n"] for t in train) == ["0", "1"]
    assert len(val) == 2
    assert {t.info.tags["sample_index"] for t in val} <= {str(i) for i in range(10, 16)}
    assert len({int(t.info.tags["sample_index"]) < 13 for t in val}) == 2  # one per batch

    for trace in train + val:
        tags = trace.info.tags
        assert tags["step"] == "1" and tags["experiment_name"] == EXPERIMENT
        assert tags["mlflow.traceName"] == "agent_loop"
        spans = trace.data.spans
        by_name = Counter(s.name for s in spans)
        assert by_name == {
            "agent_loop": 1,
            "ToolAgentLoop.run": 1,
            "LLMServerClient.generate": 2,
            "HermesToolParser.extract_tool_calls": 2,
            "CalcTool.execute": 1,
            "RewardManager.compute_score": 1,
        }
        types = {s.name: s.span_type for s in spans}
        assert types == {
            "agent_loop": "AGENT",
            "ToolAgentLoop.run": "AGENT",
            "LLMServerClient.generate": "CHAT_MODEL",
            "HermesToolParser.extract_tool_calls": "PARSER",
            "CalcTool.execute": "TOOL",
            "RewardManager.compute_score": "EVALUATOR",
        }
        generates = sorted(
            (s for s in spans if s.name == "LLMServerClient.generate"),
            key=lambda s: s.start_time_ns,
        )
        for span in generates:
            # verl's call, defaulted **kwargs included; token2text in the outputs only
            assert set(span.inputs) == {
                "request_id",
                "prompt_ids",
                "sampling_params",
                "image_data",
                "video_data",
                "audio_data",
                "mm_processor_kwargs",
                "kwargs",
            }
            assert span.inputs["kwargs"] == {}
            assert "__type__" not in span.outputs
            # the UI shows long id lists compactly; the whole lists ride in one attribute
            inputs, outputs = _whole(span)
            assert outputs["prompt_text"] == tok.decode(inputs["prompt_ids"])
            assert outputs["response_text"] == tok.decode(outputs["token_ids"])
        assert generates[0].outputs["response_text"].startswith(TOOL_CALL)
        assert generates[1].outputs["response_text"].startswith(ANSWER)
        assert "<|im_start|>user" in generates[0].outputs["prompt_text"]
        [run] = [s for s in spans if s.name == "ToolAgentLoop.run"]
        assert run.outputs["response_text"] == tok.decode(_whole(run)[1]["response_ids"])
        [tool] = [s for s in spans if s.name == "CalcTool.execute"]
        assert tool.inputs["parameters"] == {"expression": "2+2"}
        assert tool.outputs[0] == {"text": "4", "image": None, "video": None}

    # the export's tables, from what MLflow stored
    pages = iter_records(
        "mlflow", experiment=PROJECT, tracking_uri=mlflow_uri, selection=Selection(validate=True)
    )
    records = [r for page in pages for r in page]
    assert len(records) == 2 and all(r.validate for r in records)
    rows = records_rows(records)
    assert [t["num_turns"] for t in rows.trajectories] == [2, 2]
    assert [t["reward"] for t in rows.trajectories] == [1.0, 1.0]
    assert len(rows.turns) == 4
    for turn in rows.turns:
        assert turn["prompt_text"].startswith("<|im_start|>")
        assert turn["response_text"] in (
            tok.decode(tok.encode(TOOL_CALL + "<|im_end|>", add_special_tokens=False)),
            tok.decode(tok.encode(ANSWER + "<|im_end|>", add_special_tokens=False)),
        )
        assert turn["response_tokens"] > 0
    assert len(rows.tool_calls) == 2
    for call in rows.tool_calls:
        assert call["name"] == "calculator"
        assert json.loads(call["arguments"]) == {"expression": "2+2"}
        assert call["result"] == "4"
        assert call["turn_index"] == 0 and call["error"] is None


def test_verl_agent_loop_on_trackio(smollm2_tokenizer: Any, trackio_dir: Any) -> None:
    from trackio.sqlite_storage import SQLiteStorage

    tok = smollm2_tokenizer
    worker = AgentLoopWorker(trace_config("trackio", None), tok)
    asyncio.run(worker.generate_sequences(make_batch([0], 2, step=3, validate=False)))
    assert tracer.flush(60)
    assert tracer.shutdown(60)  # trackio.finish(): trackio writes what it still holds

    traces = SQLiteStorage.get_traces(PROJECT, run=EXPERIMENT, sort="request_time_asc")
    assert Counter(t["key"] for t in traces) == {
        "rollout_trace/ToolAgentLoop.run": 2,
        "rollout_trace/LLMServerClient.generate": 4,
        "rollout_trace/HermesToolParser.extract_tool_calls": 4,
        "rollout_trace/CalcTool.execute": 2,
        "rollout_trace/RewardManager.compute_score": 2,
    }
    for trace in traces:
        meta = trace["metadata"]
        assert trace["step"] == 3 and meta["step"] == 3 and meta["sample_index"] == 0
        assert meta["validate"] is False and meta["experiment_name"] == EXPERIMENT
        assert meta["status"] == "success"
    generates = [t for t in traces if t["key"].endswith("generate")]
    for trace in generates:
        output = trace["metadata"]["output"]
        assert output["response_text"] == tok.decode(output["token_ids"])
        assert trace["messages"][-1] == {"role": "assistant", "content": output["response_text"]}
        assert "prompt_ids" in trace["metadata"]["inputs"]
    assert sorted(t["metadata"]["rollout_n"] for t in traces if t["key"].endswith(".run")) == [0, 1]


def test_config_typos_name_the_closest_key() -> None:
    from rollout.config import ConfigKeyError, load_config

    with pytest.raises(tracer.ConfigError, match="did you mean `max_samples_per_step_per_worker`"):
        tracer.init({"backend": None, "max_samples": 50})  # a popular verl tutorial's spelling
    with pytest.raises(ConfigKeyError, match="did you mean `max_samples_per_step_per_worker`"):
        load_config(["actor_rollout_ref.rollout.trace.max_samples=50"])
    with pytest.raises(ConfigKeyError, match="did you mean `token2text`"):
        load_config(["actor_rollout_ref.rollout.trace.token_2_text=true"])


def _whole(span: Any) -> tuple[Any, Any]:
    """A span's inputs and outputs with the long id lists the UI shows compactly restored."""
    from tracer.token_lists import FULL_LISTS_ATTRIBUTE, restore_lists

    full = span.attributes.get(FULL_LISTS_ATTRIBUTE)
    if full is None:
        return span.inputs, span.outputs
    return restore_lists(dict(span.inputs), dict(span.outputs), full)
