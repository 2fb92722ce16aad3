"""Keep rules (tail sampling): what head sampling left out is stored when a rule says so."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests.conftest import search_traces
from tracer.config import ConfigError
from tracer.record import read_jsonl
from tracer.testing import InMemoryExporter

EXP = "keep-rules"


@tracer.trace_op(kind="generate")
def generate(prompt: str, finish_reason: str = "stop") -> dict[str, Any]:
    return {"text": f"answer to {prompt}", "finish_reason": finish_reason}


@tracer.trace_op(kind="tool")
def call_tool(name: str, fail: bool) -> dict[str, Any]:
    return {"content": "", "error": "division by zero"} if fail else {"content": "42"}


@tracer.trace_op(kind="reward")
def score(value: float) -> float:
    return value


def rollout(
    step: int,
    sample: int,
    n: int,
    reward: float,
    *,
    raises: bool = False,
    tool_error: bool = False,
    finish: str = "stop",
) -> None:
    try:
        with tracer.trace_attr(step=step, sample_index=sample, rollout_n=n):
            generate(f"q{sample}", finish)
            call_tool("calculator", tool_error)
            score(reward)
            if raises:
                raise RuntimeError("env crashed")
    except RuntimeError:
        pass


async def arollout(step: int, sample: int, n: int, reward: float, raises: bool) -> None:
    try:
        async with tracer.trace_attr(step=step, sample_index=sample, rollout_n=n):
            await asyncio.sleep(0.01)  # every rollout of the step starts before one ends
            generate(f"q{sample}")
            score(reward)
            if raises:
                raise RuntimeError("env crashed")
    except RuntimeError:
        pass


def kept(records: list[Any]) -> dict[tuple[int, int, int], str]:
    return {(r.step, r.sample_index, r.rollout_n): r.attributes["kept_by"] for r in records}


def memory(**kw: Any) -> InMemoryExporter:
    tracer.init({"backend": "memory", "raise_internal_errors": True,
                 "max_samples_per_step_per_worker": 1, **kw})  # fmt: skip
    return InMemoryExporter.latest()


def reconciles(backend: str = "memory") -> dict[str, Any]:
    m = tracer.metrics()
    p = f"tracer/{backend}/"
    assert m["tracer/submitted"] == m[p + "exported"] + m[p + "pending"] + m[p + "dropped"], m
    return m


def test_unknown_rule_fails_loudly_with_the_valid_names() -> None:
    with pytest.raises(ConfigError, match=r"did you mean `errors`.*valid rules: errors"):
        tracer.init({"backend": "memory", "keep": ["error"]})
    with pytest.raises(ConfigError, match="keep_predicate"):
        tracer.init({"backend": "memory", "keep": ["predicate"]})


def test_each_rule_keeps_its_trajectories_and_tags_them() -> None:
    out = memory(keep=["errors", "truncated", "tool_errors", "zero_variance_groups"],
                 keep_group_size=2)  # fmt: skip
    # sample 0 is the step's head sample whatever its hash? no: find it, then script the rest
    rewards = {1: (0.0, 1.0), 2: (0.0, 1.0), 3: (0.0, 1.0), 4: (1.0, 1.0), 5: (0.0, 1.0)}
    for s, (r0, r1) in rewards.items():
        rollout(0, s, 0, r0, raises=s == 1)
        rollout(0, s, 1, r1, finish="length" if s == 2 else "stop", tool_error=s == 3)
    assert tracer.flush(10)
    got = kept(out.records)
    head = [k for k, v in got.items() if v.startswith("sampled")]
    assert len({k[1] for k in head}) == 1  # one head sample (its whole group)
    tail = {k: v for k, v in got.items() if not v.startswith("sampled")}
    expected = {(0, 1, 0): "errors", (0, 2, 1): "truncated", (0, 3, 0): "tool_errors",
                (0, 3, 1): "tool_errors", (0, 4, 0): "zero_variance_groups",
                (0, 4, 1): "zero_variance_groups"}  # fmt: skip
    head_sample = head[0][1]
    assert tail == {k: v for k, v in expected.items() if k[1] != head_sample}
    m = reconciles()
    assert m["tracer/dropped/not_kept"] == 10 - len(got)
    assert m["tracer/keep/held"] == 0


def test_predicate_sees_the_finished_record() -> None:
    out = memory(keep_predicate=lambda r: r.reward is not None and 0.4 < r.reward < 0.6)
    for s in range(6):
        rollout(0, s, 0, 0.5 if s in (2, 4) else 0.0)
    assert tracer.flush(10)
    tails = {k[1]: v for k, v in kept(out.records).items() if not v.startswith("sampled")}
    assert set(tails) | {k[1] for k, v in kept(out.records).items() if v.startswith("sampled")} \
        >= {2, 4}
    assert all(v == "predicate" for v in tails.values())
    reconciles()


def _run_steps(order_seed: int, steps: int = 4, samples: int = 8) -> list[tuple[Any, ...]]:
    jobs = []
    for step in range(steps):
        for s in range(samples):
            for n in range(2):
                reward = ((step * 7 + s * 3 + n) % 11) / 10
                jobs.append((step, s, n, reward, (s + step) % 5 == 0 and n == 1))
    rng = random.Random(order_seed)
    by_step: dict[int, list[Any]] = {}
    for job in jobs:
        by_step.setdefault(job[0], []).append(job)
    for step in range(steps):
        batch = by_step[step]
        rng.shuffle(batch)  # another arrival order on a rerun

        async def run_step(batch: list[Any] = batch) -> None:
            await asyncio.gather(*(arollout(*job) for job in batch))

        asyncio.run(run_step())
        tracer.end_step(step)
    assert tracer.flush(10)
    return jobs


def test_errors_and_extreme_rewards_of_every_step_are_in_the_mlflow_store(mlflow_uri: str):
    tracer.init({"backend": "mlflow", "tracking_uri": mlflow_uri, "project_name": EXP,
                 "max_samples_per_step_per_worker": 1, "keep": ["errors", "extreme_rewards"],
                 "raise_internal_errors": True})  # fmt: skip
    jobs = _run_steps(0)
    reconciles("mlflow")
    traces = search_traces(mlflow_uri, EXP)
    stored = {(int(t.info.tags["step"]), int(t.info.tags["sample_index"]),
               int(t.info.tags["rollout_n"])): t for t in traces}  # fmt: skip
    for step in range(4):
        rows = [j for j in jobs if j[0] == step]
        errors = {(j[0], j[1], j[2]) for j in rows if j[4]}
        assert errors <= set(stored), (step, errors - set(stored))
        for key in errors:
            assert "errors" in stored[key].info.tags["kept_by"].split(",") or \
                stored[key].info.tags["kept_by"].startswith("sampled")
        hi = max(j[3] for j in rows)
        lo = min(j[3] for j in rows)
        stored_rewards = [j[3] for j in rows if (j[0], j[1], j[2]) in stored]
        assert hi in stored_rewards and lo in stored_rewards
    extreme = [t for t in traces if "extreme_rewards" in t.info.tags["kept_by"]]
    assert 1 <= len(extreme) <= 8  # at most one min and one max per step
    # head sampling still keeps one whole group per step
    heads = [t for t in traces if t.info.tags["kept_by"].startswith("sampled")]
    assert len(heads) == 4 * 2


def test_keep_is_deterministic_on_a_rerun_in_another_order() -> None:
    runs = []
    for order_seed in (1, 2):
        out = memory(keep=["errors", "extreme_rewards", "zero_variance_groups"],
                     keep_max_per_step=3)  # fmt: skip
        _run_steps(order_seed)
        runs.append(kept(out.records))
        reconciles()
        tracer.reset()
    assert runs[0] == runs[1]
    per_step: dict[int, int] = {}
    for key, rules in runs[0].items():
        if not rules.startswith("sampled"):
            per_step[key[0]] = per_step.get(key[0], 0) + 1
    assert per_step and max(per_step.values()) <= 3


def test_candidates_count_against_the_buffer_and_never_crowd_out_head_samples() -> None:
    out = memory(keep=["zero_variance_groups"], max_buffer_trajectories=16,
                 flush_interval_s=60.0)  # fmt: skip
    for s in range(40):  # every group collapsed and never complete: all would be held
        rollout(0, s, 0, 1.0)
    m = tracer.metrics()
    # candidates use at most half the buffer; the rest stays for head-sampled trajectories
    assert m["tracer/keep/held"] + m["tracer/queue_depth"] <= 16
    # no room to wait: their rules ran at once, and past the bound the step was finished
    # early; single-member groups match no rule, so they are not kept
    assert m["tracer/keep/candidates_processed_inline"] > 0
    assert m["tracer/keep/steps_finished_early"] > 0
    assert tracer.flush(10)  # the head sample always had room: nothing lost
    m = reconciles()
    assert m["tracer/keep/held"] == 0 and m["tracer/dropped_buffer_full"] == 0
    assert any(r.attributes["kept_by"] == "sampled" for r in out.records)


def test_every_rule_match_is_stored_with_the_buffer_at_capacity(tmp_path: Path) -> None:
    """Rules first, capacity second: with the candidates' half of the buffer full and the
    processor asleep, every trajectory that raised is still kept under ``keep: [errors]``
    (read back from the JSONL file)."""
    path = tmp_path / "kept.jsonl"
    tracer.init({"backend": "jsonl", "jsonl_path": str(path), "spool_dir": str(tmp_path / "sp"),
                 "raise_internal_errors": True, "max_samples_per_step_per_worker": 1,
                 "keep": ["errors"], "max_buffer_trajectories": 8,
                 "flush_interval_s": 60.0})  # fmt: skip
    for s in range(60):
        rollout(0, s, 0, 0.5, raises=s % 3 == 0)
    assert tracer.flush(30)
    m = reconciles("jsonl")
    records = list(read_jsonl(path))
    stored = {r.sample_index for r in records if "errors" in r.attributes["kept_by"]}
    assert stored == {s for s in range(60) if s % 3 == 0}
    assert m["tracer/keep/candidates_processed_inline"] > 0


def test_without_keep_rules_nothing_changes() -> None:
    out = memory()
    for s in range(4):
        rollout(0, s, 0, 0.0, raises=True)
    assert tracer.flush(10)
    assert len(out.records) == 1 and "kept_by" not in out.records[0].attributes
    m = reconciles()
    assert m.get("tracer/dropped/not_kept", 0) == 0 and "tracer/keep/candidates" not in m
    # one sample kept per step; the other three were either never admitted or evicted later
    assert m["tracer/submitted"] - m["tracer/evicted_by_sampling"] == 1


def test_keep_is_reachable_from_the_rollout_config() -> None:
    from rollout.config import load_config, trace_config

    # this checkout's YAML (an editable install may map rollout._config to another checkout)
    yaml_path = str(Path(__file__).resolve().parents[1] / "config" / "rollout.yaml")
    config = load_config(["actor_rollout_ref.rollout.trace.keep=[errors,truncated]",
                          "actor_rollout_ref.rollout.trace.keep_max_per_step=4"],
                         path=yaml_path)  # fmt: skip
    trace = tracer.TraceConfig.from_mapping(trace_config(config))
    assert trace.keep == ["errors", "truncated"] and trace.keep_max_per_step == 4
    assert trace.keep_group_size == config["actor_rollout_ref"]["rollout"]["n"]
