"""Drops kept and counted: a rollout that is cancelled, times out or raises keeps its partial
transcript, its tokens so far and why it ended (``end_reason``) on every backend and in the
export; per step, drops by reason, incomplete GRPO groups and the length-bias flag reach the
steps table, the report and ``rollout-tracer flags``. The rollouts are real asyncio tasks and
threads (benchmarks/drops_scenario.py), stored by the real backends and read back."""

from __future__ import annotations

import asyncio
import contextvars
import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import tracer
from benchmarks.drops_scenario import run_drops
from tests.conftest import search_traces
from tracer.readers import export, read_tables, write_report
from tracer.record import read_jsonl

pd = pytest.importorskip("pandas")


@tracer.trace_op(kind="generate")
async def generate(n: int, gate: asyncio.Event | None = None) -> dict[str, Any]:
    if gate is not None:
        await gate.wait()
    return {"response_ids": list(range(n)), "finish_reason": "stop"}


async def _cancelled_rollout() -> tuple[bool, bool]:
    """Two turns; the second never returns and the task is cancelled from outside (what
    verl's fully async rollouter does to its generation tasks). Returns (the task ended
    cancelled, CancelledError reached the code awaiting it)."""
    opened = asyncio.Event()

    async def rollout() -> None:
        async with tracer.trace_attr(step=1, sample_index=0, rollout_n=0):
            await generate(30)
            opened.set()
            await generate(50, asyncio.Event())  # never set

    task = asyncio.create_task(rollout())
    await opened.wait()
    await asyncio.sleep(0)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return task.cancelled(), True
    return task.cancelled(), False


def test_a_cancelled_rollout_keeps_its_transcript_and_the_cancel_propagates(
    tmp_path: Path,
) -> None:
    path = tmp_path / "t.jsonl"
    tracer.init(backend="jsonl", jsonl_path=str(path))
    assert asyncio.run(_cancelled_rollout()) == (True, True)  # tracing changed nothing
    assert tracer.flush(30)
    [record] = read_jsonl(path)
    assert record.status == "ERROR" and record.attributes["end_reason"] == "cancelled"
    assert record.attributes["response_tokens"] == 30  # the first turn's, so far
    first, cut = record.spans[1:]
    assert (first.status, first.attributes.get("cut")) == ("OK", None)
    assert cut.status == "ERROR" and cut.attributes["cut"] is True
    assert cut.error is not None and cut.error["type"] == "CancelledError"
    export("jsonl", str(tmp_path / "out"), path=str(path))
    row = pd.read_parquet(tmp_path / "out" / "trajectories.parquet").iloc[0]
    assert (row["end_reason"], row["response_tokens"], row["num_turns"]) == ("cancelled", 30, 2)


def _export(tmp_path: Path, **scenario: Any) -> tuple[Any, Any, Any]:
    path = tmp_path / "traces.jsonl"
    tracer.init(backend="jsonl", jsonl_path=str(path))
    planted = run_drops(**scenario)
    assert tracer.flush(30)
    tracer.shutdown()
    export("jsonl", str(tmp_path / "export"), path=str(path))
    traj = pd.read_parquet(tmp_path / "export" / "trajectories.parquet")
    steps = pd.read_parquet(tmp_path / "export" / "steps.parquet").set_index("step")
    return planted, traj, steps


@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_a_timeout_that_kills_the_longest_is_counted_and_flagged(tmp_path: Path) -> None:
    planted, traj, steps = _export(tmp_path, steps=1, samples=4, group=4, turns=(1, 8),
                                   limit=5, timeout_s=3.0, seed=2)  # fmt: skip
    # the planted ones at least (a busy machine can cut a short one too)
    assert planted.planted <= set(planted.dropped) and planted.kept
    got = {(int(r.step), int(r.sample_index), int(r.rollout_n)): (r.end_reason,
           int(r.response_tokens)) for r in traj.itertuples()}  # fmt: skip
    assert got == {**{k: ("completed", v) for k, v in planted.kept.items()},
                   **{k: ("timeout", v) for k, v in planted.dropped.items()}}  # fmt: skip
    row = steps.loc[1]
    kept, dropped = list(planted.kept.values()), list(planted.dropped.values())
    assert (row["dropped"], row["dropped_timeout"], row["dropped_cancelled"]) == (
        len(dropped), len(dropped), 0)
    short = {k[1] for k in planted.dropped}
    assert (row["groups"], row["incomplete_groups"]) == (4, len(short))
    assert row["dropped_token_share"] == pytest.approx(sum(dropped) / (sum(kept) + sum(dropped)))
    assert row["kept_tokens_mean"] == pytest.approx(sum(kept) / len(kept))
    assert row["dropped_tokens_mean"] == pytest.approx(sum(dropped) / len(dropped))
    assert bool(row["length_bias"])
    # the report says it, with the numbers it rests on
    html = Path(write_report(read_tables("parquet", path=str(tmp_path / "export")),
                             str(tmp_path / "report.html"))).read_text()  # fmt: skip
    cell = html.split('<tr data-step="1">', 1)[1].split("</tr>", 1)[0]
    assert f"{len(dropped)} dropped (timeout {len(dropped)})" in cell
    assert f"{len(short)} of 4 groups incomplete" in cell and "length bias" in cell
    # and `rollout-tracer flags`
    out = subprocess.run([sys.executable, "-m", "rollout.cli", "flags", "--from", "parquet",
                          "--path", str(tmp_path / "export"), "--json"],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert out.returncode in (0, 1), out.stderr
    steps_flagged = {f["flag"]: f for f in json.loads(out.stdout)["steps"]}
    bias = steps_flagged["dropped_longer"]
    assert sorted(bias["trace_ids"]) == sorted(traj[traj["end_reason"] == "timeout"]["trace_id"])
    assert bias["value"] == pytest.approx(row["dropped_token_share"], abs=1e-4)
    assert "% of the generated tokens never trained on; kept mean" in bias["detail"]
    assert steps_flagged["incomplete_groups"]["value"] == len(short)


@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_a_timeout_outside_the_trajectory_reads_as_a_cancel(tmp_path: Path) -> None:
    """``asyncio.wait_for(rollout(), t)`` around the function that opens the trajectory: asyncio
    cancels its task and raises TimeoutError only to the caller. The drop is still counted."""
    planted, traj, steps = _export(tmp_path, steps=1, samples=2, group=4, turns=(1, 8),
                                   limit=5, timeout_s=3.0, outside=True, seed=2)  # fmt: skip
    assert planted.planted <= set(planted.dropped)
    cut = traj[traj["end_reason"] != "completed"]
    assert set(cut["end_reason"]) == {"cancelled"} and len(cut) == len(planted.dropped)
    assert steps.loc[1, "dropped_cancelled"] == len(planted.dropped)


def test_a_thread_side_timeout_keeps_the_open_tool_call(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    tracer.init(backend="jsonl", jsonl_path=str(path))
    release = threading.Event()

    @tracer.trace_op(kind="tool")
    def run_code(code: str) -> str:
        release.wait(30)
        return "done"

    pool = ThreadPoolExecutor(1)
    try:
        with pytest.raises(TimeoutError), tracer.trace_attr(step=3, sample_index=1, rollout_n=0):
            ctx = contextvars.copy_context()  # the tool call belongs to this trajectory
            pool.submit(ctx.run, run_code, "while True: pass").result(timeout=0.2)
    finally:
        release.set()
        pool.shutdown(wait=True)
    assert tracer.flush(30)
    [record] = read_jsonl(path)
    assert record.attributes["end_reason"] == "timeout"
    tool = record.spans[1]
    assert tool.attributes["tool_name"] == "run_code"
    assert tool.inputs == {"code": "while True: pass"}
    # still running when the trajectory ended: closed at its end, marked cut
    assert tool.attributes.get("cut") is True
    assert tool.end_ns <= record.end_ns


def test_an_error_and_an_incomplete_group(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    tracer.init(backend="jsonl", jsonl_path=str(path))

    async def rollout(n: int) -> None:
        async with tracer.trace_attr(step=1, sample_index=7, rollout_n=n):
            await generate(10 * (n + 1))
            if n == 0:
                raise ValueError("the sandbox died")

    async def main() -> list[Any]:
        return await asyncio.gather(*(rollout(n) for n in range(4)), return_exceptions=True)

    results = asyncio.run(main())
    assert isinstance(results[0], ValueError)
    assert tracer.flush(30)
    export("jsonl", str(tmp_path / "out"), path=str(path))
    steps = pd.read_parquet(tmp_path / "out" / "steps.parquet").iloc[0]
    assert (steps["dropped"], steps["dropped_error"], steps["incomplete_groups"]) == (1, 1, 1)
    assert steps["dropped_token_share"] == pytest.approx(10 / 100)
    assert not steps["length_bias"]  # the dropped one was the shortest


def test_every_backend_keeps_why_it_ended(mlflow_uri: str, weave_server: Any) -> None:
    """MLflow (tags, read back with MlflowClient), OTLP (root span attributes as the OTLP
    exporter writes them) and Weave (root call attributes)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tracer.backends.otlp_backend import OtlpExporter
    from tracer.config import TraceConfig
    from tracer.testing import InMemoryExporter

    tracer.init(backend=["mlflow", "weave", "memory"], tracking_uri=mlflow_uri,
                project_name="drops", weave_entity="team", raise_internal_errors=True)
    assert asyncio.run(_cancelled_rollout()) == (True, True)
    assert tracer.flush(60)
    [trace] = search_traces(mlflow_uri, "drops", "tags.end_reason = 'cancelled'")
    assert trace.info.tags["response_tokens"] == "30"
    [record] = InMemoryExporter.latest().records
    memory = InMemorySpanExporter()
    OtlpExporter(TraceConfig(backend="memory"), span_exporter=memory).export([record])
    root = next(s for s in memory.get_finished_spans() if s.parent is None)
    assert root.attributes["mlflow.traceTag.end_reason"] == "cancelled"
    cut = [s for s in memory.get_finished_spans() if s.attributes.get("cut")]
    assert len(cut) == 1 and cut[0].name == "generate"
    [call] = [c for c in weave_server.calls() if c["parent_id"] is None]
    assert call["attributes"]["end_reason"] == "cancelled"
    assert call["attributes"]["response_tokens"] == 30


@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_the_live_metrics_count_the_drops_across_processes(tmp_path: Path) -> None:
    """``tracer.step_metrics`` (what TRL's log() and verl's Tracking.log get) and a driver's
    merge of two workers' partials, a group split between them."""
    tracer.init(backend="jsonl", jsonl_path=str(tmp_path / "t.jsonl"))
    planted = run_drops(steps=1, samples=4, group=4, turns=(1, 8), limit=5, timeout_s=3.0,
                        seed=2)  # fmt: skip
    m = tracer.step_metrics(1)
    kept, dropped = sum(planted.kept.values()), sum(planted.dropped.values())
    assert m["timing/dropped"] == len(planted.dropped)
    assert m["timing/incomplete_groups"] == len({k[1] for k in planted.dropped})
    assert m["timing/dropped_token_share"] == pytest.approx(dropped / (kept + dropped))
    part = tracer.live.partial(1)
    rows = sorted(part["rows"], key=lambda r: (r["sample_key"], r["rollout_n"]))
    a = dict(part, rows=rows[: len(rows) // 2 + 1], processes={"a": part["processes"]
                                                                 .popitem()[1]})  # fmt: skip
    b = dict(part, rows=rows[len(rows) // 2 + 1 :], processes={})
    merged = tracer.live.metrics(tracer.live.merge([a, b]))
    for key in ("timing/dropped", "timing/incomplete_groups", "timing/dropped_token_share"):
        assert merged[key] == pytest.approx(m[key]), key


def test_ctrl_c_and_an_engine_abort_read_as_cancelled(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    tracer.init(backend="jsonl", jsonl_path=str(path))

    @tracer.trace_op(kind="generate")
    def vllm_generate(prompt_ids: list[int]) -> dict[str, Any]:
        return {"token_ids": [5, 6], "finish_reason": "abort"}  # vLLM: the request was aborted

    with pytest.raises(KeyboardInterrupt), tracer.trace_attr(step=1, sample_index=0, rollout_n=0):
        raise KeyboardInterrupt
    with tracer.trace_attr(step=1, sample_index=1, rollout_n=0):
        vllm_generate([1, 2])
    assert tracer.flush(30)
    reasons = {r.sample_index: r.attributes["end_reason"] for r in read_jsonl(path)}
    assert reasons == {0: "cancelled", 1: "cancelled"}
