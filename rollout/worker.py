"""The rollout worker: batches of prompts, ``n`` samples each (GRPO groups), run concurrently
with asyncio, one traced trajectory per sample, for a number of steps."""

from __future__ import annotations

import asyncio
import json
import random
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import tracer
from rollout.agent_loop import SYSTEM_PROMPT, AgentLoopConfig, AgentLoopOutput, ToolAgentLoop
from rollout.engines.base import Engine, SamplingParams
from rollout.rewards import check_mode
from rollout.tools import default_tools

BUILTIN_PREFIX = "builtin://"


def load_dataset(path: str = "builtin://math_problems.jsonl") -> list[dict[str, Any]]:
    """Rows of a JSONL dataset with ``question`` and ``answer``; ``builtin://NAME`` reads the
    file shipped in ``rollout/data``. Each row gets ``index`` (its position)."""
    if path.startswith(BUILTIN_PREFIX):
        text = resources.files("rollout").joinpath("data", path[len(BUILTIN_PREFIX) :])
        lines = text.read_text("utf-8").splitlines()
    else:
        lines = Path(path).expanduser().read_text("utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    for i, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise ValueError(f"{path}: row {i} lacks 'question' or 'answer'")
        row.setdefault("index", i)
    return rows


def iterate_batches(
    rows: list[dict[str, Any]], batch_size: int, seed: int = 0, shuffle: bool = True
) -> Iterator[list[dict[str, Any]]]:
    """Endless batches over ``rows`` (reshuffled each epoch, deterministic for ``seed``)."""
    epoch = 0
    while True:
        order = list(range(len(rows)))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield [rows[i] for i in order[start : start + batch_size]]
        epoch += 1


def config_batches(config: dict[str, Any]) -> Iterator[list[dict[str, Any]]]:
    """The step batches the ``data`` section of a config describes (shared by every runner)."""
    data = config["data"]
    return iterate_batches(
        load_dataset(data["train_files"]), int(data["train_batch_size"]),
        int(data.get("seed", 0)), bool(data.get("shuffle", True)),
    )  # fmt: skip


def _as_list(value: Any) -> list[str]:
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]


def validation_rows(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The fixed validation set of a config: the first ``data.val_max_samples`` rows of
    ``data.val_files`` (default: the train files), unshuffled."""
    data = config.get("data") or {}
    rows = load_dataset(data.get("val_files") or data["train_files"])
    limit = data.get("val_max_samples")
    return rows[: int(limit)] if limit is not None else rows


def validation_steps(config: dict[str, Any], total_steps: int) -> tuple[bool, set[int]]:
    """verl's schedule: (validate before step 1, the steps validated after): every
    ``trainer.test_freq`` steps and the last one; nothing when ``test_freq`` is 0."""
    trainer = config.get("trainer") or {}
    freq = int(trainer.get("test_freq") or 0)
    if freq <= 0:
        return False, set()
    after = {s for s in range(1, total_steps + 1) if s % freq == 0 or s == total_steps}
    return bool(trainer.get("val_before_train")), after


def done_line(results: list[StepResult], validations: list[StepResult]) -> str:
    """The run's summary: training and validation trajectories, each counted on its own."""
    train = sum(len(r.outputs) for r in results)
    val = sum(len(r.outputs) for r in validations)
    return f"done: {train} training + {val} validation trajectories"


@dataclass
class StepResult:
    """All trajectories of one step and their summary metrics."""

    step: int
    outputs: list[AgentLoopOutput]
    elapsed_s: float = 0.0  # wall time of the step (rollout/metrics.py: throughput)
    validate: bool = False  # a validation pass (trainer.test_freq / val_before_train)

    def metrics(self) -> dict[str, float]:
        """Mean score/accuracy, turns, tool calls and response length of the step."""
        n = max(1, len(self.outputs))
        scores = [o.reward["score"] for o in self.outputs if o.reward]
        accs = [o.reward["accuracy"] for o in self.outputs if o.reward]
        return {
            "score": sum(scores) / max(1, len(scores)),
            "accuracy": sum(accs) / max(1, len(accs)),
            "turns": sum(o.num_assistant_turns for o in self.outputs) / n,
            "tool_calls": sum(o.tool_calls for o in self.outputs) / n,
            "response_tokens": sum(len(o.response_ids) for o in self.outputs) / n,
        }


class RolloutWorker:
    """Runs GRPO-style rollout steps with one engine and one tool agent loop."""

    def __init__(self, config: dict[str, Any], engine: Engine) -> None:
        self.config = config
        self.engine = engine
        rollout = config["actor_rollout_ref"]["rollout"]
        multi = rollout.get("multi_turn") or {}
        enable = bool(multi.get("enable", True))
        reward = config.get("reward") or {}
        self.loop_config = AgentLoopConfig(
            max_assistant_turns=int(multi.get("max_assistant_turns", 4)) if enable else 1,
            prompt_length=int(rollout["prompt_length"]),
            response_length=int(rollout["response_length"]),
            max_tool_response_length=int(multi.get("max_tool_response_length", 512)),
            tool_response_truncate_side=multi.get("tool_response_truncate_side", "right"),
            use_tools=enable,
            interaction=multi.get("interaction") if enable else None,
            tool_choice=_as_list(multi.get("tool_choice") or "auto"),
            reward_mode=check_mode(str(reward.get("mode", "strict"))),
            format_weight=float(reward.get("format_weight", 0.1)),
        )
        tools = default_tools(multi.get("tools")) if enable else None
        self.agent = ToolAgentLoop(engine, tools, self.loop_config)
        self.n = int(rollout["n"])
        self.sampling = SamplingParams(
            max_tokens=int(rollout.get("max_tokens_per_turn") or rollout["response_length"]),
            temperature=float(rollout.get("temperature", 1.0)),
            top_p=float(rollout.get("top_p", 1.0)),
            logprobs=bool(rollout.get("calculate_log_probs", False)),
        )
        self.seed = int(config.get("trainer", {}).get("seed", 0))
        # validation, verl-style: actor_rollout_ref.rollout.val_kwargs (n, temperature, top_p,
        # do_sample), a fixed set of prompts (data.val_files, first data.val_max_samples rows)
        val = rollout.get("val_kwargs") or {}
        self.val_n = int(val.get("n", 1))
        greedy = not bool(val.get("do_sample", False))
        self.val_sampling = SamplingParams(**{
            **self.sampling.__dict__,
            "temperature": 0.0 if greedy else float(val.get("temperature", 1.0)),
            "top_p": float(val.get("top_p", 1.0)),
        })  # fmt: skip
        self._val_rows: list[dict[str, Any]] | None = None
        # Extra attributes on every trajectory this worker traces (tags in the store): a Ray
        # worker puts its node's id and IP here (rollout/ray_workers.py), so a trace says
        # where it ran.
        self.trace_attributes: dict[str, Any] = {}

    def validation_rows(self) -> list[dict[str, Any]]:
        """The fixed validation set: the same prompts at every validation step."""
        if self._val_rows is None:
            self._val_rows = validation_rows(self.config)
        return self._val_rows

    def messages_for(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The chat messages for one dataset row."""
        return [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": row["question"]}]  # fmt: skip

    async def run_sample(
        self, step: int, row: dict[str, Any], k: int, validate: bool = False, attempt: int = 0
    ) -> AgentLoopOutput:
        """One trajectory: sample ``k`` of the GRPO group of ``row`` at ``step`` (a validation
        sample with ``validate``: val_kwargs sampling, traced with ``validate=True``).
        ``attempt`` counts re-runs of the same sample (0: the first), e.g. after the node that
        ran it was lost: a new trajectory, tagged ``attempt``, never an overwrite."""
        params = SamplingParams(**{**(self.val_sampling if validate else self.sampling).__dict__})
        key = f"{self.seed}:{step}:{row['index']}:{k}{':val' if validate else ''}".encode()
        params.seed = zlib.crc32(key)
        with tracer.trace_attr(
            step=step, sample_index=row["index"], rollout_n=k, validate=validate,
            name="trajectory", policy_version=step, attempt=attempt, **self.trace_attributes,
        ):  # fmt: skip
            out = await self.agent.run(
                self.messages_for(row), params, ground_truth=row["answer"],
                request_id=f"{'v' if validate else 's'}{step}-i{row['index']}-n{k}",
            )  # fmt: skip
        out.extra.update(step=step, sample_index=row["index"], rollout_n=k, policy_version=step,
                         validate=validate, attempt=attempt)  # fmt: skip
        return out

    async def run_step(
        self,
        step: int,
        batch: list[dict[str, Any]],
        on_done: Callable[[AgentLoopOutput], None] | None = None,
        validate: bool = False,
        attempt: int = 0,
    ) -> StepResult:
        """All ``len(batch) * n`` trajectories of one step, concurrently (``val_kwargs.n`` per
        prompt with ``validate``)."""

        async def one(row: dict[str, Any], k: int) -> AgentLoopOutput:
            out = await self.run_sample(step, row, k, validate, attempt)
            if on_done is not None:
                on_done(out)
            return out

        n = self.val_n if validate else self.n
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(row, k) for row in batch for k in range(n)))
        return StepResult(step, list(outs), time.perf_counter() - t0, validate)

    async def validate(self, step: int) -> StepResult:
        """Roll out the fixed validation set at ``step`` (traced with ``validate=True``)."""
        return await self.run_step(step, self.validation_rows(), validate=True)

    async def run(
        self,
        total_steps: int,
        on_done: Callable[[AgentLoopOutput], None] | None = None,
        on_step: Callable[[StepResult], None] | None = None,
        on_validate: Callable[[StepResult], None] | None = None,
    ) -> list[StepResult]:
        """Run ``total_steps`` steps over the configured dataset (steps count from 1), and the
        validation set where ``trainer.val_before_train`` (at step 0) and ``trainer.test_freq``
        (every that many steps and the last) say, as verl's trainer does. Validation results
        go to ``on_validate``; the returned list holds the rollout steps."""
        batches = config_batches(self.config)
        before, after = validation_steps(self.config, total_steps)
        results = []
        if before:
            val = await self.validate(0)
            if on_validate is not None:
                on_validate(val)
        for step in range(1, total_steps + 1):
            result = await self.run_step(step, next(batches), on_done)
            results.append(result)
            if on_step is not None:
                on_step(result)
            if step in after:
                val = await self.validate(step)
                if on_validate is not None:
                    on_validate(val)
        return results
