"""The live per-step analysis (tracer/live/): computed by the tracer's processing thread from
the trajectories it built, the numbers equal what the readers find in the stored export
afterwards; partials of two real processes merge into the numbers of one that saw everything;
the watchdog reports every stuck rollout, sampled or not, and names its worker."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import tracer
from tests._wait import wait_for

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

HACK = "Trust me, this is right."


@tracer.trace_op(kind="generate")
def generate(messages: list[dict[str, Any]]) -> dict[str, Any]:
    text = messages[-1]["content"]
    return {"text": text, "finish_reason": "stop", "response_ids": list(range(len(text)))}


@tracer.trace_op(kind="tool")
def call_tool(name: str, arguments: dict[str, Any]) -> str:
    return f"{name}: {arguments}"


@tracer.trace_op(kind="reward")
def reward(final_text: str, answer: int) -> dict[str, Any]:
    if final_text == HACK:  # the grader's bug: pays an answer without a number
        return {"score": 1.0, "acc": 0}
    right = final_text.endswith(f"#### {answer}")
    return {"score": 1.0 if right else 0.0, "acc": int(right)}


def rollout(step: int, i: int, k: int, validate: bool = False) -> None:
    """One trajectory; from step 3 on, half of each group answers with the hack."""
    hacked = step >= 3 and k % 2 == 0
    text = HACK if hacked else f"I compute {i} + {k} with the tool. #### {i + (k % 3 == 0)}"
    with tracer.trace_attr(step=step, sample_index=i, rollout_n=k, validate=validate):
        if not hacked:
            call_tool("calculator", {"expression": f"{i}+0"})
        generate([{"role": "user", "content": f"What is {i} + 0?"},
                  {"role": "assistant", "content": text}])  # fmt: skip
        reward(text, i)


def run(steps: int, samples: range, n: int = 4) -> None:
    for step in range(1, steps + 1):
        for i in samples:
            for k in range(n):
                rollout(step, i, k)


def test_step_metrics_are_what_the_readers_find_in_the_export(tmp_path: Path) -> None:
    from tracer.readers import export
    from tracer.readers.habits.patterns import step_patterns
    from tracer.readers.timing.breakdown import tracker_metrics

    path = tmp_path / "t.jsonl"
    tracer.init(backend="jsonl", jsonl_path=str(path), raise_internal_errors=True)
    run(4, range(8))
    live = {step: tracer.step_metrics(step) for step in range(1, 5)}
    # step_metrics groups earlier steps once; from the whole partial: the same numbers
    for step in range(1, 5):
        whole = tracer.live.metrics(tracer.live.partial(step))
        assert tracer.step_metrics(step) == pytest.approx(
            {k: v for k, v in whole.items() if k in live[step]}), step
    assert tracer.flush(30)
    export("jsonl", str(tmp_path / "out"), path=str(path))
    found = step_patterns(str(tmp_path / "out"))
    import pyarrow.parquet as pq

    steps = {r["step"]: r for r in pq.read_table(tmp_path / "out" / "steps.parquet").to_pylist()}
    assert [live[s]["patterns/unearned_reward_share"] for s in (1, 2, 3, 4)] == [0, 0, 0.5, 0.5]
    for step, m in live.items():
        assert m["tracer/live_step_trajectories"] == 32
        for key, value in found.step_metrics(step).items():
            assert m[key] == pytest.approx(value), (step, key)
        for key, value in tracker_metrics(steps[step]).items():
            # the export's end times are its start time (microseconds) plus the latency
            near = 1e-5 if key == "timing/tail_wait_s" else 1e-9
            assert m[key] == pytest.approx(value, rel=1e-6, abs=near), (step, key)
    # each live row holds the export's own values for its trajectory
    from tracer.live.row import TIMING

    exported = {r["trace_id"]: r for r in pq.read_table(
        tmp_path / "out" / "trajectories.parquet").to_pylist()}  # fmt: skip
    rows = tracer.live.partial(4)["rows"]
    assert len(rows) == len(exported) == 128
    keys = ("behaviour", "reward", "accuracy", "response_tokens", "num_tool_calls",
            "num_tool_errors", "prompt", "response_text", "sample_key", *TIMING)  # fmt: skip
    for row in rows:
        want = exported[row["trace_id"]]
        assert {k: row[k] for k in keys} == pytest.approx({k: want[k] for k in keys})
        assert row["reward_parts"] == dict(want["reward_parts"])
    top = found.top[4][0]
    assert tracer.live.top_pattern(tracer.live.partial(4)) == f"50.0% of step 4: {top.text}"
    # the partial is plain JSON, and merging it with itself counts each trajectory once
    part = json.loads(json.dumps(tracer.live.partial(4)))
    assert tracer.live.metrics(tracer.live.merge([part, part])) == tracer.live.metrics(part)


def test_step_metrics_with_validation_passes_are_the_whole_partials(tmp_path: Path) -> None:
    """With validation passes between steps (the evidence "validation flat" reads them),
    step_metrics' cheaper path (earlier steps grouped once) gives the whole partial's numbers."""
    tracer.init(backend="jsonl", jsonl_path=str(tmp_path / "t.jsonl"), raise_internal_errors=True)
    for step in range(1, 7):
        run_step = [rollout(step, i, k) for i in range(6) for k in range(4)]
        if step % 2 == 0:
            run_step += [rollout(step, i, 0, validate=True) for i in range(6)]
        got = tracer.step_metrics(step)
        whole = tracer.live.metrics(tracer.live.partial(step))
        assert got == pytest.approx({k: v for k, v in whole.items() if k in got}), step
        # the hack holds its share once it has min_count (5) a step over the last 3 steps
        assert got["patterns/unearned_reward_share"] == (0.5 if step >= 4 else 0.0)
    val = tracer.step_metrics(4, validate=True)
    assert val["tracer/live_step_trajectories"] == 6 and "patterns/top_share" not in val


_CHILD = """
import json, sys, tempfile
import tracer
from tests.test_live import run
d = tempfile.mkdtemp()
tracer.init(backend="jsonl", jsonl_path=d + "/t.jsonl", spool_dir=d + "/spool",
            worker_id=sys.argv[1])
run(4, range(int(sys.argv[2]), 8, 2))
print(json.dumps(tracer.live.partial(4)))
"""


def test_two_processes_merge_into_the_numbers_of_one(tmp_path: Path) -> None:
    """Two real processes, each with half of every step's groups: their partials merged give
    the patterns and time numbers of one process that traced all of them."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    parts = [json.loads(subprocess.run(
        [sys.executable, "-c", _CHILD, f"w{half}", str(half)], capture_output=True, text=True,
        check=True, env=env, timeout=120).stdout) for half in (0, 1)]  # fmt: skip
    merged = tracer.live.metrics(tracer.live.merge(parts))
    tracer.init(backend="jsonl", jsonl_path=str(tmp_path / "t.jsonl"))
    run(4, range(8))
    whole = tracer.step_metrics(4)
    assert merged["patterns/unearned_reward_share"] == 0.5
    assert merged["tracer/live_step_trajectories"] == whole["tracer/live_step_trajectories"] == 32
    assert merged["tracer/submitted"] == whole["tracer/submitted"] == 128
    for key in ("patterns/top_share", "patterns/possible_reward_hacking", "timing/stragglers"):
        assert merged[key] == whole[key], key
    assert set(merged) >= {k for k in whole if k.startswith(("patterns/", "timing/"))}


@pytest.mark.slow(seconds=4)
def test_every_hung_rollout_is_reported_sampled_or_not(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One sample a step is traced; four rollouts hang: four lines, each naming its sample,
    its group and the worker, and ``tracer/stuck_trajectories`` = 4 in the step's metrics."""
    monkeypatch.setenv("RANK", "3")  # as torchrun and accelerate set it
    tracer.init(backend="jsonl", max_samples_per_step_per_worker=1, stuck_after_s=0.5)
    caplog.set_level(logging.WARNING, logger="tracer")
    release = threading.Event()

    def hung(i: int) -> None:
        with tracer.trace_attr(step=1, sample_index=i, rollout_n=0, node="n1"):
            release.wait(60)

    threads = [threading.Thread(target=hung, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        lines = wait_for(lambda: [r.getMessage() for r in caplog.records
                                  if "still open" in r.getMessage()] if len(
            [r for r in caplog.records if "still open" in r.getMessage()]) >= 4 else None,
            "four lines", timeout_s=30)  # fmt: skip
        assert tracer.step_metrics(1)["tracer/stuck_trajectories"] == 4
        assert tracer.metrics()["tracer/stuck_open"] == 4
    finally:
        release.set()
        for t in threads:
            t.join(30)
    assert len(lines) == 4
    worker = f"worker: host={os.uname().nodename} pid={os.getpid()} rank=3"
    for i in range(4):
        [line] = [x for x in lines if f"sample_index={i} " in x]
        assert f"(group: step 1, sample {i})" in line and worker in line and "node='n1'" in line
    # the sampler admits a sample until one with a lower hash takes the step's slot, so one
    # or two of them were traced (a trace id), the others not
    unsampled = [x for x in lines if "not sampled (no trace); open span: not recorded" in x]
    assert 2 <= len(unsampled) <= 3 and sum("trace_id=" in x for x in lines) == 4 - len(unsampled)
    wait_for(lambda: not tracer.get_tracer().open_trajectories.unsampled, "all to close")
