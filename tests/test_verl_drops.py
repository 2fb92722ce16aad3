"""verl's agent loop where it drops rollouts, on ``from tracer import ...`` (the classes of
tests/test_verl_agent_loop.py, verl's call sites replayed). verl 0.9.1 ends a rollout early in two
ways: its fully async rollouter cancels the generation task (``generation_task.cancel()``,
fully_async_rollouter.py), which ``asyncio.gather`` passes to every ``_run_agent_loop`` task
still running; and a weight sync aborts the engine's requests (``abort_all_requests``), whose
``generate`` then returns ``TokenOutput(token_ids=[], stop_reason="aborted")``
(vllm_async_server.py) and, without partial rollout, is not retried (llm_server.py). Both are
kept and counted."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tracer
from tests.test_verl_agent_loop import (
    AgentLoopWorker,
    LLMServerClient,
    TokenOutput,
    make_batch,
    trace_config,
)
from tracer import rollout_trace_op
from tracer.readers import export

pd = pytest.importorskip("pandas")


class StallingServer(LLMServerClient):
    """Sample 1's second turn never comes back (its engine request hangs) until cancelled;
    sample 2's second turn comes back aborted by a weight sync."""

    def __init__(self, engine_tokenizer: Any, stalled: asyncio.Event) -> None:
        super().__init__(engine_tokenizer)
        self.stalled = stalled

    @rollout_trace_op
    async def generate(self, request_id: str, *, prompt_ids: list[int],
                       sampling_params: dict[str, Any], **kwargs: Any) -> TokenOutput:  # fmt: skip
        prompt = self._engine_tokenizer.decode(prompt_ids)
        second = "<|im_start|>tool" in prompt
        if second and "Problem 1:" in prompt:
            self.stalled.set()
            await asyncio.Event().wait()  # never set: only the cancel ends it
        if second and "Problem 2:" in prompt:
            return TokenOutput(token_ids=[], log_probs=None, stop_reason="aborted")
        return await LLMServerClient.generate.__wrapped__(  # type: ignore[attr-defined]
            self, request_id, prompt_ids=prompt_ids, sampling_params=sampling_params, **kwargs)


def test_verl_cancelled_and_aborted_rollouts_are_kept_and_counted(
    smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    np.random.seed(0)
    config = trace_config("jsonl", None)
    worker = AgentLoopWorker(config, smollm2_tokenizer)  # RolloutTraceConfig.init, as verl
    # the jsonl backend's default file, under the test's working directory
    path = tmp_path / "traces" / config["project_name"] / f"{config['experiment_name']}.jsonl"
    stalled = asyncio.Event()
    worker.llm_client = StallingServer(smollm2_tokenizer, stalled)
    worker.llm_client.tokenizer = smollm2_tokenizer  # type: ignore[attr-defined]

    async def main() -> tuple[bool, bool]:
        batch = make_batch([0, 1, 2], 2, step=5, validate=False)
        task = asyncio.create_task(worker.generate_sequences(batch))  # the generation task
        await stalled.wait()
        for _ in range(50):  # let the others finish (they never wait on anything real)
            await asyncio.sleep(0)
        task.cancel()  # what the fully async rollouter does
        try:
            await task
        except asyncio.CancelledError:
            return task.cancelled(), True
        return task.cancelled(), False

    assert asyncio.run(main()) == (True, True)  # the cancel reached verl's code unchanged
    assert tracer.flush(30)
    export("jsonl", str(tmp_path / "out"), path=str(path))
    traj = pd.read_parquet(tmp_path / "out" / "trajectories.parquet")
    got = {(int(r.sample_index), int(r.rollout_n)): r.end_reason for r in traj.itertuples()}
    assert got == {(0, 0): "completed", (0, 1): "completed", (1, 0): "cancelled",
                   (1, 1): "cancelled", (2, 0): "cancelled", (2, 1): "cancelled"}  # fmt: skip
    status = {int(r.sample_index): r.status for r in traj.itertuples()}
    assert status == {0: "OK", 1: "ERROR", 2: "OK"}  # 2 ran to its end, its engine aborted
    cut = traj[traj["sample_index"] == 1].iloc[0]
    first = traj[traj["sample_index"] == 0].iloc[0]
    assert cut["num_turns"] == 2 and cut["response_tokens"] > 0  # the first turn, kept
    assert cut["response_tokens"] < first["response_tokens"]
    steps = pd.read_parquet(tmp_path / "out" / "steps.parquet").iloc[0]
    assert (steps["dropped"], steps["dropped_cancelled"], steps["incomplete_groups"]) == (4, 4, 2)
