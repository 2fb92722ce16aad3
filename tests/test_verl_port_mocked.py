"""verl's trackio tests (verl-project/verl, tests/utils/test_rollout_trace_on_cpu.py) as verl
writes them: its fixture replaces the ``trackio`` module with a ``MagicMock`` and the checks
are made on what the backend handed to it. Ported to ``from tracer import ...``; the rest of
verl's suite is ported onto real stores in tests/test_verl_port.py.

The backend must get there through trackio's public API alone: a mock answers any private
name too, but cannot say when it "stored" anything, so a flush that reads trackio's internals
never returns True here. verl logs on the op's thread; ours exports in the background, hence
the flush before verl's checks.
"""

from __future__ import annotations

import sys
import types
from typing import Any
from unittest.mock import MagicMock, patch

import pytest

import tracer
from tests.test_verl_port import (  # noqa: F401  (the autouse fixture resets verl's singleton)
    ChatTraceClass,
    TracedClass,
    reset_rollout_trace_config_singleton,
)
from tracer import RolloutTraceConfig, rollout_trace_attr


@pytest.fixture
def mock_trackio_client() -> Any:
    """Mocks the trackio module, yielding the mock module (verl's fixture)."""
    mock_trackio = MagicMock()
    mock_trackio.context_vars = types.SimpleNamespace(current_run=MagicMock())
    mock_trackio.context_vars.current_run.get.return_value = None
    mock_trackio.Trace.side_effect = lambda messages, metadata=None: {
        "_type": "trackio.trace",
        "messages": messages,
        "metadata": metadata or {},
    }

    with patch.dict(sys.modules, {"trackio": mock_trackio}):
        yield mock_trackio


async def test_rollout_trace_with_mocked_trackio_module(mock_trackio_client: Any) -> None:
    """verl's ``test_rollout_trace_with_trackio_backend``."""
    RolloutTraceConfig.init(project_name="my-project", experiment_name="my-experiment",
                            backend="trackio")  # fmt: skip
    instance = TracedClass()

    with rollout_trace_attr(step=1, sample_index=2, rollout_n=3):
        result = await instance.my_method("test_a", b="test_b")
    assert tracer.flush(30)

    assert result == "result: test_a, test_b"
    mock_trackio_client.init.assert_called_once_with(
        project="my-project", name="my-experiment", config={"framework": "verl"}
    )
    mock_trackio_client.Trace.assert_called_once()
    trace_kwargs = mock_trackio_client.Trace.call_args.kwargs
    assert trace_kwargs["messages"][0]["content"] == (
        "verl rollout trace operation: TracedClass.my_method"
    )
    assert trace_kwargs["metadata"]["step"] == 1
    assert trace_kwargs["metadata"]["sample_index"] == 2
    mock_trackio_client.log.assert_called_once()
    log_kwargs = mock_trackio_client.log.call_args.kwargs
    assert log_kwargs["step"] == 1
    RolloutTraceConfig.reset()  # ours: the run it started is finished with trackio.finish()
    mock_trackio_client.finish.assert_called_once_with()


async def test_mocked_trackio_module_gets_chat_messages_when_available(
    mock_trackio_client: Any,
) -> None:
    """verl's ``test_trackio_backend_uses_chat_messages_when_available``."""
    RolloutTraceConfig.init(project_name="my-project", experiment_name="my-experiment",
                            backend="trackio")  # fmt: skip
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

    trace_kwargs = mock_trackio_client.Trace.call_args.kwargs
    assert trace_kwargs["messages"] == [*input_messages, {"role": "assistant", "content": "4"}]
    assert trace_kwargs["metadata"]["inputs"] == {
        "sampling_params": {"temperature": 0.0, "max_tokens": 16}
    }
    assert trace_kwargs["metadata"]["output"]["prompt_ids"] == [1, 2, 3]
    assert trace_kwargs["metadata"]["output"]["response_text"] == "4"
