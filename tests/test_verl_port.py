"""verl's own test of its tracer (verl-project/verl, tests/utils/test_rollout_trace_on_cpu.py),
ported to ``from tracer import ...``: the same classes, calls and checks.

verl checks what it hands to mocked ``weave``/``mlflow``/``trackio`` modules. Here every check
is made on what a real backend stored: the Weave calls the real WeaveClient sent to the
in-process Weave server, the traces in a real MLflow sqlite store read back with
``MlflowClient``, the traces in trackio's local store read back with trackio's storage API.
The two tests verl skips unless a real Weave / MLflow is configured run here, on those.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

import tracer
from tests.conftest import search_traces
from tracer import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op


@pytest.fixture(autouse=True)
def reset_rollout_trace_config_singleton() -> Any:
    RolloutTraceConfig.reset()
    yield
    RolloutTraceConfig.reset()


@pytest.fixture
def mlflow_env(mlflow_uri: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """verl's mlflow backend writes where MLFLOW_TRACKING_URI says; so does the shim."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    return mlflow_uri


class TracedClass:
    @rollout_trace_op
    async def my_method(self, a: Any, b: Any = "default") -> str:
        return f"result: {a}, {b}"

    @rollout_trace_op
    async def middle_method(self, a: Any, b: Any = "default") -> str:
        await self.my_method("test_a1", b="test_b1")
        return f"result: {a}, {b}"

    @rollout_trace_op
    async def my_method_with_exception(self) -> None:
        raise ValueError("Test Exception")

    async def upper_method(self) -> bool:
        await self.my_method("test_a0", b="test_b0")
        await self.middle_method("test_a2", b="test_b2")
        return True


class UntracedClass:
    @rollout_trace_op
    async def my_method(self, x: int) -> int:
        return x * 2


class ChatTraceClass:
    @rollout_trace_op
    async def run(self, messages: list[dict[str, str]], sampling_params: dict[str, Any]) -> Any:
        return {"prompt_ids": [1, 2, 3], "response_ids": [4], "response_text": "4", "reward": 1.0}


class GeneratedTokenOutput(BaseModel):
    token_ids: list[int]


class FakeTokenizer:
    def decode(self, token_ids: list[int]) -> str:  # no skip_special_tokens argument
        return "decoded:" + ",".join(str(token_id) for token_id in token_ids)


class LLMGenerateTraceClass:
    def __init__(self) -> None:
        self.tokenizer = FakeTokenizer()

    @rollout_trace_op
    async def generate(self, *, prompt_ids: list[int]) -> GeneratedTokenOutput:
        return GeneratedTokenOutput(token_ids=[3, 4])


def op_calls(server: Any, op: str) -> list[dict[str, Any]]:
    return [c for c in server.calls() if c["display_name"] == op]


def trackio_traces(project: str, run: str = "my-experiment") -> list[dict[str, Any]]:
    """What trackio stored, read with trackio's own storage API. trackio writes in the
    background: read after ``trackio.finish()`` (the tracer's shutdown calls it)."""
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_traces(project, run=run, sort="request_time_asc")


# --------------------------------------------------------------------------- verl's tests
async def test_rollout_trace_on_untraced_class(tmp_path: Path) -> None:
    instance = UntracedClass()
    assert await instance.my_method(10) == 20
    assert RolloutTraceConfig.get_backend() is None
    assert not (tmp_path / "mlflow.db").exists()  # nothing configured: nothing written


async def test_rollout_trace_with_tracer(weave_server: Any) -> None:
    RolloutTraceConfig.init(
        project_name="my-project", experiment_name="my-experiment", backend="weave"
    )
    instance = TracedClass()
    client = RolloutTraceConfig.get_client()
    assert client is not None and client.project == "my-project"

    result = await instance.my_method("test_a", b="test_b")
    assert tracer.flush(30)

    assert result == "result: test_a, test_b"
    [call] = weave_server.calls()  # an op outside rollout_trace_attr: a trace of its own
    assert call["display_name"] == "TracedClass.my_method"
    assert "TracedClass.my_method" in call["op_name"]
    assert call["project_id"].endswith("/my-project")
    assert call["inputs"] == {"a": "test_a", "b": "test_b"}
    assert call["output"] == result
    assert call["exception"] is None


async def test_token2text_decodes_llm_generate_input_and_output(mlflow_env: str) -> None:
    RolloutTraceConfig.init(
        project_name="my-project",
        experiment_name="my-experiment",
        backend="mlflow",
        token2text=True,
    )

    instance = LLMGenerateTraceClass()
    result = await instance.generate(prompt_ids=[1, 2])
    assert tracer.flush(30)

    assert result == GeneratedTokenOutput(token_ids=[3, 4])
    [trace] = search_traces(mlflow_env, "my-project")
    [span] = trace.data.spans
    assert span.name == "LLMGenerateTraceClass.generate"
    assert span.inputs == {"prompt_ids": [1, 2]}
    assert span.outputs == {
        "token_ids": [3, 4],
        "prompt_text": "decoded:1,2",
        "response_text": "decoded:3,4",
    }


async def test_rollout_trace_with_exception(weave_server: Any) -> None:
    RolloutTraceConfig.init(
        project_name="my-project", experiment_name="my-experiment", backend="weave"
    )
    instance = TracedClass()

    with pytest.raises(ValueError, match="Test Exception"):
        await instance.my_method_with_exception()
    assert tracer.flush(30)

    [call] = weave_server.calls()
    assert call["display_name"] == "TracedClass.my_method_with_exception"
    assert call["ended_at"] is not None
    exception = json.loads(call["exception"])
    assert exception["type"] == "ValueError"
    assert exception["message"] == "Test Exception"


async def test_rollout_trace_with_dummy_backend(weave_server: Any, tmp_path: Path) -> None:
    RolloutTraceConfig.init(
        project_name="my-project", experiment_name="my-experiment", backend="dummy"
    )
    instance = TracedClass()

    await instance.my_method("test_a")
    assert tracer.flush(30)

    assert RolloutTraceConfig.get_backend() == "dummy"
    assert RolloutTraceConfig.get_client() is None
    assert weave_server.calls() == []
    assert not (tmp_path / "mlflow.db").exists()


async def test_rollout_trace_with_trackio_backend(trackio_dir: Path) -> None:
    from trackio import Api

    RolloutTraceConfig.init(
        project_name="my-project", experiment_name="my-experiment", backend="trackio"
    )
    instance = TracedClass()

    with rollout_trace_attr(step=1, sample_index=2, rollout_n=3):
        result = await instance.my_method("test_a", b="test_b")
    assert tracer.flush(30)
    RolloutTraceConfig.reset()  # trackio.finish(): trackio writes what it still holds

    assert result == "result: test_a, test_b"
    [run] = list(Api().runs("my-project"))
    assert run.name == "my-experiment"
    assert (run.config or {}).get("framework") == "verl"
    [trace] = trackio_traces("my-project")
    assert trace["key"] == "rollout_trace/TracedClass.my_method"
    assert trace["messages"][0]["content"] == "verl rollout trace operation: TracedClass.my_method"
    assert trace["metadata"]["step"] == 1
    assert trace["metadata"]["sample_index"] == 2
    assert trace["metadata"]["attempt"] == 0
    assert trace["step"] == 1


async def test_trackio_backend_uses_chat_messages_when_available(trackio_dir: Path) -> None:
    RolloutTraceConfig.init(
        project_name="my-project", experiment_name="my-experiment", backend="trackio"
    )
    instance = ChatTraceClass()
    input_messages = [
        {"role": "system", "content": "You are a concise math assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]

    with rollout_trace_attr(step=1, sample_index=2, rollout_n=3):
        await instance.run(
            messages=input_messages,
            sampling_params={"temperature": 0.0, "max_tokens": 16},
        )
    assert tracer.flush(30)
    RolloutTraceConfig.reset()

    [trace] = trackio_traces("my-project")
    assert trace["messages"] == [*input_messages, {"role": "assistant", "content": "4"}]
    assert trace["metadata"]["inputs"] == {
        "sampling_params": {"temperature": 0.0, "max_tokens": 16}
    }
    assert trace["metadata"]["output"]["prompt_ids"] == [1, 2, 3]
    assert trace["metadata"]["output"]["response_text"] == "4"


async def test_trace_disabled_with_trace_false(weave_server: Any) -> None:
    RolloutTraceConfig.init(
        project_name="my-project", experiment_name="my-experiment", backend="weave"
    )
    instance = TracedClass()

    assert RolloutTraceConfig.get_backend() == "weave"

    with rollout_trace_attr(step=1, sample_index=0, rollout_n=0, trace=False):
        result = await instance.my_method("test_a", b="test_b")
        assert result == "result: test_a, test_b"
    assert tracer.flush(30)

    assert weave_server.calls() == []  # no tracing occurred

    with rollout_trace_attr(step=1, sample_index=0, rollout_n=0):
        result = await instance.my_method("test_a", b="test_b")
        assert result == "result: test_a, test_b"
    assert tracer.flush(30)

    assert len(op_calls(weave_server, "TracedClass.my_method")) == 1


async def test_trace_false_disables_nested_trace_ops(weave_server: Any) -> None:
    RolloutTraceConfig.init(
        project_name="my-project", experiment_name="my-experiment", backend="weave"
    )
    instance = TracedClass()

    with rollout_trace_attr(step=1, sample_index=0, rollout_n=0, trace=False):
        result = await instance.upper_method()  # my_method and middle_method inside
        assert result is True
    assert tracer.flush(30)

    assert weave_server.calls() == []

    with rollout_trace_attr(step=1, sample_index=0, rollout_n=0):
        result = await instance.my_method("test_a", b="test_b")
        assert result == "result: test_a, test_b"
    assert tracer.flush(30)

    assert len(op_calls(weave_server, "TracedClass.my_method")) == 1
    assert op_calls(weave_server, "TracedClass.middle_method") == []


async def test_trace_enabled_restored_after_exception(weave_server: Any) -> None:
    RolloutTraceConfig.init(
        project_name="my-project", experiment_name="my-experiment", backend="weave"
    )
    instance = TracedClass()

    assert RolloutTraceConfig.get_backend() == "weave"

    with (
        pytest.raises(RuntimeError),
        rollout_trace_attr(step=1, sample_index=0, rollout_n=0, trace=False),
    ):
        raise RuntimeError("Test exception with trace disabled")

    with rollout_trace_attr(step=1, sample_index=0, rollout_n=0):
        result = await instance.my_method("test_a", b="test_b")
        assert result == "result: test_a, test_b"
    assert tracer.flush(30)

    assert len(op_calls(weave_server, "TracedClass.my_method")) == 1


async def test_rollout_trace_with_real_weave_backend(weave_server: Any) -> None:
    RolloutTraceConfig.init(
        project_name="my-project", experiment_name="my-experiment", backend="weave"
    )

    instance = TracedClass()

    with rollout_trace_attr(step=1, sample_index=2, rollout_n=3):
        await instance.upper_method()

    with pytest.raises(ValueError, match="Test Exception"):
        await instance.my_method_with_exception()
    assert tracer.flush(30)

    calls = weave_server.calls()
    by_id = {c["id"]: c for c in calls}
    roots = {c["display_name"]: c for c in calls if c["parent_id"] is None}
    assert set(roots) == {"rollout_trace", "TracedClass.my_method_with_exception"}
    attrs = roots["rollout_trace"]["attributes"]
    assert (attrs["step"], attrs["sample_index"], attrs["rollout_n"]) == (1, 2, 3)
    assert attrs["validate"] is False and attrs["experiment_name"] == "my-experiment"
    parents = sorted(
        (c["display_name"], by_id[c["parent_id"]]["display_name"], c["inputs"]["a"])
        for c in calls
        if c["parent_id"] is not None
    )
    assert parents == [
        ("TracedClass.middle_method", "rollout_trace", "test_a2"),
        ("TracedClass.my_method", "TracedClass.middle_method", "test_a1"),
        ("TracedClass.my_method", "rollout_trace", "test_a0"),
    ]
    failed = roots["TracedClass.my_method_with_exception"]
    assert json.loads(failed["exception"])["type"] == "ValueError"


async def test_rollout_trace_with_real_mlflow_backend(mlflow_env: str) -> None:
    RolloutTraceConfig.init(
        project_name="my-project", experiment_name="my-experiment", backend="mlflow"
    )

    instance = TracedClass()

    with rollout_trace_attr(step=1, sample_index=2, rollout_n=3, name="agent_run"):
        assert await instance.upper_method()
    assert tracer.flush(30)

    [trace] = search_traces(mlflow_env, "my-project", "tags.step = '1'")
    tags = trace.info.tags
    assert {k: tags[k] for k in ("step", "sample_index", "rollout_n", "validate")} == {
        "step": "1",
        "sample_index": "2",
        "rollout_n": "3",
        "validate": "False",  # verl: str(validate)
    }
    assert tags["experiment_name"] == "my-experiment"
    spans = {s.span_id: s for s in trace.data.spans}
    [root] = [s for s in trace.data.spans if s.parent_id is None]
    assert root.name == "agent_run"
    tree = sorted(
        (s.name, spans[s.parent_id].name, s.inputs["a"]) for s in trace.data.spans if s is not root
    )
    assert tree == [
        ("TracedClass.middle_method", "agent_run", "test_a2"),
        ("TracedClass.my_method", "TracedClass.middle_method", "test_a1"),
        ("TracedClass.my_method", "agent_run", "test_a0"),
    ]
    assert search_traces(mlflow_env, "my-project", "tags.validate = 'False'") != []


# ------------------------------------------------- verl's RolloutTraceConfig, beyond its test
def test_second_init_is_ignored_until_reset(mlflow_env: str) -> None:
    RolloutTraceConfig.init("p1", "e1", "mlflow", False, 4)
    RolloutTraceConfig.init("p2", "e2", "dummy", True, None)  # ignored, as in verl
    config = RolloutTraceConfig.get_instance()
    assert config is RolloutTraceConfig()  # one instance
    assert (config.project_name, config.experiment_name, config.backend) == ("p1", "e1", "mlflow")
    assert config.max_samples_per_step_per_worker == 4
    assert RolloutTraceConfig.enable_token2text() is False
    import mlflow

    assert RolloutTraceConfig.get_client() is mlflow
    RolloutTraceConfig.reset()
    assert RolloutTraceConfig.get_instance().max_samples_per_step_per_worker is None
    assert RolloutTraceConfig.get_backend() is None
    RolloutTraceConfig.init("p2", "e2", "dummy", True, None)
    assert RolloutTraceConfig.get_backend() == "dummy" and RolloutTraceConfig.enable_token2text()


def test_unknown_backend_still_fails_loudly() -> None:
    with pytest.raises(tracer.ConfigError, match="did you mean `mlflow`"):
        RolloutTraceConfig.init("p", "e", "mlfow")


async def test_trackio_backend_leaves_the_callers_run_of_another_project_alone(
    trackio_dir: Path,
) -> None:
    import trackio
    from trackio import context_vars
    from trackio.sqlite_storage import SQLiteStorage

    metrics_run = trackio.init(project="metrics", name="train")  # the trainer's own tracker
    RolloutTraceConfig.init("my-project", "my-experiment", "trackio")
    assert context_vars.current_run.get() is metrics_run  # not finished, still current
    with rollout_trace_attr(step=2, sample_index=0, rollout_n=0):
        await TracedClass().my_method("x")
    assert tracer.flush(30)
    trackio.log({"loss": 0.5}, step=2)
    trackio.finish()
    RolloutTraceConfig.reset()

    assert [t["key"] for t in trackio_traces("my-project")] == [
        "rollout_trace/TracedClass.my_method"
    ]
    assert [row["loss"] for row in SQLiteStorage.get_logs("metrics", "train")] == [0.5]
