"""Where the rollout's time goes: the timing reader over stored spans (the export's timing
columns and steps table) and the stuck-trajectory watchdog, on a real traced rollout with
planted stragglers and a hung tool call (benchmarks/timing_scenario.py), stored by the real
JSONL backend and read back by the export."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tracer
from benchmarks.timing_scenario import SLOW_TOOL, run_scenario
from tests._wait import wait_for
from tracer.readers import export, read_tables, write_report

pd = pytest.importorskip("pandas")


def _run_and_export(tmp_path: Path, **scenario: Any) -> tuple[Any, Any, Any]:
    """Run the scenario traced to JSONL, export it; (planted, trajectories, steps)."""
    path = tmp_path / "traces.jsonl"
    tracer.init(backend="jsonl", jsonl_path=str(path), stuck_after_s=60)
    planted = run_scenario(**scenario)
    assert tracer.flush(30)
    stuck = tracer.metrics()["tracer/stuck_trajectories"]
    tracer.shutdown()
    assert stuck == 0
    out = tmp_path / "export"
    export("jsonl", str(out), path=str(path))
    traj = pd.read_parquet(out / "trajectories.parquet")
    steps = pd.read_parquet(out / "steps.parquet").set_index("step")
    return planted, traj, steps


def test_slow_tool_is_named_the_top_straggler_cause_at_its_steps(tmp_path: Path) -> None:
    planted, traj, steps = _run_and_export(tmp_path, steps=4, samples=8, slow_prob=0.35,
                                           seed=3)  # fmt: skip
    slow_steps = planted.slow_steps()
    assert slow_steps and slow_steps != set(steps.index)  # both kinds of step are present
    for step, row in steps.iterrows():
        if step not in slow_steps:
            assert row["stragglers"] == 0, row
            assert pd.isna(row["top_straggler_cause"])
            continue
        assert row["top_straggler_cause"] == f"tool {SLOW_TOOL}", row
        top = traj[traj["trace_id"] == row["top_straggler_trace_id"]].iloc[0]
        slowest = max(f for s, _, f in planted.slow if s == step)
        assert (step, int(top["sample_index"]), slowest) in planted.slow
        assert json.loads(row["top_straggler_detail"]) == {
            "code": f"print({step} * {int(top['sample_index'])})"
        }
        assert row["top_straggler_span_id"] == top["slow_span_id"]
        assert row["tail_ratio"] > 3


def test_time_shares_add_up_to_wall_time(tmp_path: Path) -> None:
    _, traj, steps = _run_and_export(tmp_path, steps=2, samples=6, slow_prob=0.3, seed=5)
    parts = traj[["generate_ms", "tool_ms", "reward_ms", "other_ms", "gap_ms"]].sum(axis=1)
    assert ((parts - traj["latency_ms"]).abs() <= 0.01 * traj["latency_ms"]).all()
    # every trajectory waited for its tool and its two generate calls (real sleeps)
    assert (traj["generate_ms"] >= 20 * 0.95).all() and (traj["tool_ms"] >= 10 * 0.95).all()
    shares = steps[["generate_share", "tool_share", "reward_share", "other_share", "gap_share"]]
    assert (shares.sum(axis=1) - 1).abs().max() < 0.01
    for step, row in steps.iterrows():
        by_tool = json.loads(row["tool_shares"])
        assert set(by_tool) == {"python", "search"}
        assert sum(by_tool.values()) == pytest.approx(row["tool_share"], rel=0.01)
        wall = traj[traj["step"] == step]["latency_ms"]
        assert row["wall_max_ms"] == pytest.approx(wall.max())
        assert row["wall_p50_ms"] == pytest.approx(wall.quantile(0.5))


def test_nothing_reported_on_a_run_without_stragglers(tmp_path: Path) -> None:
    _, _, steps = _run_and_export(tmp_path, steps=3, samples=8, slow_prob=0.0, seed=1)
    assert (steps["stragglers"] == 0).all()
    assert steps["top_straggler_cause"].isna().all()


@pytest.mark.slow(seconds=6)
@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_hung_call_is_reported_once_with_tool_and_arguments(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    limit = 2.0
    tracer.init(backend="jsonl", jsonl_path=str(tmp_path / "t.jsonl"), stuck_after_s=limit)
    release = threading.Event()
    started = time.monotonic()
    result: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: result.update(planted=run_scenario(
        steps=1, samples=4, slow_prob=0.0, hang=(1, 2), release=release)))  # fmt: skip
    caplog.set_level(logging.WARNING, logger="tracer")
    thread.start()
    try:
        stuck = wait_for(lambda: [r for r in caplog.records if "still open" in r.message],
                         "the watchdog's line", timeout_s=30)  # fmt: skip
        reported_after = time.monotonic() - started
        assert reported_after < 2 * limit, reported_after
        line = stuck[0].getMessage()
        assert "step=1 sample_index=2" in line
        assert 'open span: tool python arguments={"code": "print(1 * 2)"}' in line
        assert tracer.metrics()["tracer/stuck_trajectories"] == 1
        time.sleep(limit)  # ten more ticks while it is still open: no second line
        assert len([r for r in caplog.records if "still open" in r.message]) == 1
        assert tracer.metrics()["tracer/stuck_open"] == 1
    finally:
        release.set()
        thread.join(30)
    assert result["planted"].hang == (1, 2)
    wait_for(lambda: tracer.metrics()["tracer/stuck_open"] == 0, "the trajectory to end")
    assert tracer.metrics()["tracer/stuck_trajectories"] == 1
    assert tracer.metrics()["tracer/watchdog_alive"] == 1


def test_watchdog_loop_survives_an_error(caplog: pytest.LogCaptureFixture) -> None:
    t = tracer.init(backend="jsonl", stuck_after_s=0.2)
    watchdog = t.watchdog
    calls = {"n": 0}
    real_tick = watchdog.tick

    def failing_tick(now_ns: int) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        real_tick(now_ns)

    watchdog.tick = failing_tick
    wait_for(lambda: calls["n"] >= 3, "ticks after the failing one")
    m = tracer.metrics()
    assert m["tracer/watchdog_errors"] == 1 and m["tracer/watchdog_alive"] == 1
    assert any("watchdog failed (RuntimeError: boom)" in r.getMessage() for r in caplog.records)


def test_report_names_the_stragglers_and_links_their_transcripts(tmp_path: Path) -> None:
    planted, _, steps = _run_and_export(tmp_path, steps=3, samples=8, slow_prob=0.35,
                                           seed=3)  # fmt: skip
    html = Path(write_report(read_tables("parquet", path=str(tmp_path / "export")),
                             str(tmp_path / "report.html"))).read_text()  # fmt: skip
    section = html.split('<section id="time">', 1)[1].split("</section>", 1)[0]
    for step in steps.index:
        row = section.split(f'<tr data-step="{step}">', 1)[1].split("</tr>", 1)[0]
        if step in planted.slow_steps():
            assert f"<td class='top-cause'>tool {SLOW_TOOL}</td>" in row
            tid = steps.loc[step, "top_straggler_trace_id"]
            assert f'href="#t-{tid}"' in row
            assert f'"id": "{tid}"' in html or f'"id":"{tid}"' in html  # its transcript
        else:
            assert "<td class='top-cause'>-</td>" in row


@pytest.mark.slow(seconds=6)
@pytest.mark.waits  # mostly a timeout's wait: ordered early (tests/conftest.py)
def test_hung_call_far_past_its_steps_typical_time_is_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No limit reached (600 s): the 7 other trajectories of the step took ~0.05 s, so one open
    for 50x that (at least 2 s: watchdog.TYPICAL_FLOOR_S) is reported."""
    from tracer.watchdog import TYPICAL_FACTOR, TYPICAL_FLOOR_S

    tracer.init(backend="jsonl", jsonl_path=str(tmp_path / "t.jsonl"), stuck_after_s=600)
    release = threading.Event()
    caplog.set_level(logging.WARNING, logger="tracer")
    started = time.monotonic()
    thread = threading.Thread(target=run_scenario, kwargs=dict(
        steps=1, samples=8, slow_prob=0.0, hang=(1, 4), release=release))  # fmt: skip
    thread.start()
    try:
        stuck = wait_for(lambda: [r for r in caplog.records if "still open" in r.message],
                         "the watchdog's line", timeout_s=60)  # fmt: skip
        after = time.monotonic() - started
        typical = tracer.get_tracer().watchdog.typical_s(1, False)
        assert typical is not None and typical < 0.5
        assert after >= max(TYPICAL_FACTOR * typical, TYPICAL_FLOOR_S)
        line = stuck[0].getMessage()
        assert "step=1 sample_index=4" in line and "its step's typical" in line
        assert "open span: tool python" in line
    finally:
        release.set()
        thread.join(30)
    assert len([r for r in caplog.records if "still open" in r.message]) == 1
    wait_for(lambda: not tracer.get_tracer().open_trajectories, "the ended ones to leave the set")


def test_watchdog_restarts_in_a_forked_child() -> None:
    t = tracer.init(backend="jsonl", stuck_after_s=0.5)
    with tracer.trace_attr(step=1, sample_index=0, rollout_n=0):
        pid = os.fork()
        if pid == 0:  # the child: its own thread, none of the parent's open trajectories
            ok = t.watchdog.thread.is_alive() and not t.open_trajectories
            os._exit(0 if ok else 1)
        assert len(t.open_trajectories) == 1
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_parallel_tool_calls_count_once(tmp_path: Path) -> None:
    """Two tool calls running at once inside a generate call: each instant goes to one part
    (the tool calls, over the generate call), so the parts still add up to the wall time."""
    import asyncio

    from benchmarks.timing_scenario import call_tool

    @tracer.trace_op(kind="generate")
    async def generate_with_tools() -> str:
        await asyncio.sleep(0.02)
        await asyncio.gather(call_tool("python", {"code": "1"}, 0.1),
                             call_tool("search", {"query": "x"}, 0.05))  # fmt: skip
        return "done"

    async def one() -> None:
        with tracer.trace_attr(step=1, sample_index=0, rollout_n=0):
            await generate_with_tools()

    tracer.init(backend="jsonl", jsonl_path=str(tmp_path / "t.jsonl"))
    asyncio.run(one())
    assert tracer.flush(30)
    export("jsonl", str(tmp_path / "out"), path=str(tmp_path / "t.jsonl"))
    row = pd.read_parquet(tmp_path / "out" / "trajectories.parquet").iloc[0]
    parts = sum(row[f"{p}_ms"] for p in ("generate", "tool", "reward", "other", "gap"))
    assert parts == pytest.approx(row["latency_ms"], rel=1e-6)
    assert 95 <= row["tool_ms"] < 150  # the union of the two calls, not their sum (150)
    by_tool = json.loads(row["tool_ms_by_name"])
    # where two tool calls overlap, the instant goes to the one that opened first
    assert list(by_tool) == ["python"] and by_tool["python"] == pytest.approx(row["tool_ms"])
    assert row["generate_ms"] >= 19
    # the slow span is the longest leaf, the python call, not the generate call around it
    # (its own time is the 20 ms before the tool calls)
    assert (row["slow_span_kind"], row["slow_span_name"]) == ("tool", "python")


def test_a_watchdog_that_cannot_start_leaves_tracing_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    real_start = threading.Thread.start

    def no_watchdog(self: threading.Thread) -> None:
        if self.name == "rollout-tracer-watchdog":
            raise RuntimeError("can't start new thread")
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", no_watchdog)
    t = tracer.init(backend="jsonl", jsonl_path=str(tmp_path / "t.jsonl"))
    assert t.watchdog is None and "watchdog did not start" in caplog.text
    with tracer.trace_attr(step=1, sample_index=0, rollout_n=0):
        pass
    assert tracer.flush(30) and tracer.metrics()["tracer/jsonl/exported"] == 1
    assert not hasattr(t.open_trajectories, "__len__")  # nothing is kept without a watchdog
