"""Health flags: scripted rollouts with one pathology each are flagged on exactly their trace
ids, in a real MLflow store (tags written back, read with MlflowClient) and in the export;
clean rollouts are not flagged."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

import tracer
from rollout.cli import main as cli_main
from tests.conftest import search_traces
from tracer.readers import export
from tracer.readers.health import HealthThresholds, analyze, trajectory_flags

EXP = "health-flags"
CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")


@tracer.trace_op(kind="generate")
def generate(text: str, length: int, finish_reason: str) -> dict[str, Any]:
    return {"text": text, "response_ids": list(range(length)), "finish_reason": finish_reason}


@tracer.trace_op(kind="tool")
def call_tool(name: str, arguments: dict[str, Any], fail: bool) -> dict[str, Any]:
    return {"content": "", "error": "bad input"} if fail else {"content": "ok"}


@tracer.trace_op(kind="reward")
def score(score: float, accuracy: float) -> dict[str, Any]:
    return {"score": score, "accuracy": accuracy, "format": 1.0}


def one(step: int, s: int, n: int) -> set[str]:
    """Run the scripted rollout (step, sample s, rollout n); return the flags it must get."""
    text, length, finish = f"answer {step}-{s}-{n}", 10, "stop"
    calls = [("calculator", {"x": step * 100 + s * 10 + n}, False)]
    reward, acc = (1.0, 1.0) if n == 0 else (0.0, 0.0)
    texts = [text]
    expect: set[str] = set()
    if step == 1 and n == 0:
        if s == 0:
            calls = [("calculator", {"x": 1}, False)] * 3
            expect = {"tool_loop"}
        elif s == 1:
            texts = [text, text]
            expect = {"identical_turns"}
        elif s == 2:
            calls = [("calculator", {"x": i}, True) for i in range(3)]
            expect = {"tool_error_burst"}
        else:
            texts = [""]
            expect = {"short_answer_high_reward"}
    if step == 2 and n == 0 and s < 3:
        finish = "length"
        expect = {"truncated", "truncation_rate"}
    if step == 3:  # every group collapsed, mean reward and accuracy unchanged
        reward = acc = 1.0 if s < 2 else 0.0
        expect = {"zero_variance_rising"}
    if step == 4 and n == 0 and s < 2:
        length = 40
        expect = {"length_drift"}
    if step == 5 and n == 1:  # reward climbs through another component; accuracy does not
        reward = 0.9
        expect = {"reward_accuracy_divergence"}
    with tracer.trace_attr(step=step, sample_index=s, rollout_n=n):
        for t in texts:
            generate(t, length, finish)
            for name, args, fail in calls:
                call_tool(name, args, fail)
            calls = []
        score(reward, acc)
    return expect


def scripted_run() -> dict[tuple[int, int, int], set[str]]:
    expected = {}
    for step in range(7):  # step 0 is the baseline; step 6 is clean again
        for s in range(4):
            for n in range(2):
                expected[(step, s, n)] = one(step, s, n)
    assert tracer.flush(30)
    return expected


@pytest.fixture
def run(mlflow_uri: str) -> dict[tuple[int, int, int], set[str]]:
    tracer.init({"backend": "mlflow", "tracking_uri": mlflow_uri, "project_name": EXP,
                 "raise_internal_errors": True})  # fmt: skip
    return scripted_run()


def _key(tags: dict[str, str]) -> tuple[int, int, int]:
    return int(tags["step"]), int(tags["sample_index"]), int(tags["rollout_n"])


def test_flags_are_on_exactly_the_right_traces_in_the_export(
    run: dict[tuple[int, int, int], set[str]], mlflow_uri: str, tmp_path: Path
) -> None:
    export("mlflow", str(tmp_path / "out"), experiment=EXP, tracking_uri=mlflow_uri)
    rows = pq.read_table(tmp_path / "out" / "trajectories.parquet").to_pylist()
    got = {(r["step"], r["sample_index"], r["rollout_n"]): set(r["flags"]) for r in rows}
    assert got == run
    clean = [k for k, v in run.items() if not v]
    assert len(clean) >= 30 and all(not got[k] for k in clean)  # no false positives


def test_flags_command_writes_tags_to_mlflow_and_prints_them(
    run: dict[tuple[int, int, int], set[str]], mlflow_uri: str,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    tracer.shutdown()
    assert cli_main(["flags", "--from", "mlflow", "--tracking-uri", mlflow_uri,
                     "--experiment", EXP, "--write-tags", "--no-progress"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    for name in ("tool_loop", "truncation_rate", "zero_variance_rising", "length_drift"):
        assert name in printed
    traces = search_traces(mlflow_uri, EXP)
    assert len(traces) == len(run)
    for t in traces:
        flags = {k[len("flag."):] for k, v in t.info.tags.items()
                 if k.startswith("flag.") and v == "true"}  # fmt: skip
        assert flags == run[_key(t.info.tags)], _key(t.info.tags)
    filtered = search_traces(mlflow_uri, EXP, "tags.`flag.tool_loop` = 'true'")
    assert [_key(t.info.tags) for t in filtered] == [(1, 0, 0)]


def test_flags_from_jsonl_and_parquet_agree(tmp_path: Path) -> None:
    jsonl = tmp_path / "run.jsonl"
    tracer.init({"backend": "jsonl", "jsonl_path": str(jsonl), "project_name": EXP})
    expected = scripted_run()
    tracer.shutdown()
    export("jsonl", str(tmp_path / "out"), path=str(jsonl))
    from tracer.readers import read_tables

    for source, path in (("jsonl", jsonl), ("parquet", tmp_path / "out")):
        traj = read_tables(source, path=str(path)).trajectories
        health = analyze(traj.to_dict("records"))
        keys = {r.trace_id: (r.step, r.sample_index, r.rollout_n) for r in traj.itertuples()}
        got = {keys[t]: set(names) for t, names in health.by_trace.items()}
        assert got == {k: v for k, v in expected.items() if v}, source


def test_reward_carried_by_another_component_while_accuracy_stays_flat() -> None:
    def row(i: int, step: int, reward: float, acc: float) -> dict[str, Any]:
        return {"trace_id": f"t{step}-{i}", "step": step, "validate": False,
                "sample_key": str(i // 2), "reward": reward, "accuracy": acc,
                "response_tokens": 10, "flags": []}  # fmt: skip

    rows = [row(i, 0, 0.0 if i % 2 else 0.1 * (i % 3), 0.0) for i in range(8)]
    rows += [row(i, 1, 0.1 if i % 2 else 0.0, 0.0) for i in range(8)]  # format reward only
    health = analyze(rows, HealthThresholds(zero_variance_rise=2.0))
    flagged = {f.step: f.trace_ids for f in health.steps if f.name == "reward_without_accuracy"}
    assert flagged[1] == [f"t1-{i}" for i in range(8) if i % 2]
    # and when accuracy carries the reward, nothing is flagged
    good = [row(i, st, float(i % 2), float(i % 2)) for st in range(3) for i in range(8)]
    assert analyze(good).by_trace == {} and analyze(good).steps == []


def test_trajectory_rules_have_thresholds() -> None:
    turns = [{"response_text": "x", "finish_reason": "stop"}]
    calls = [{"name": "t", "arguments": "{}", "error": None}] * 2
    assert trajectory_flags(0.0, turns, calls) == []
    assert trajectory_flags(0.0, turns, calls, HealthThresholds(tool_loop_calls=2)) == [
        "tool_loop"]
    assert trajectory_flags(1.0, turns, []) == ["short_answer_high_reward"]
    assert trajectory_flags(1.0, turns, [], HealthThresholds(short_answer_chars=0)) == []


@pytest.mark.skipif(not shutil.which(CHROMIUM), reason="needs Debian's chromium")
def test_report_health_section_renders_and_links_open_transcripts(
    run: dict[tuple[int, int, int], set[str]], mlflow_uri: str, tmp_path: Path
) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    from tracer.readers import read_tables, write_report

    tables = read_tables("mlflow", experiment=EXP, tracking_uri=mlflow_uri)
    path = Path(write_report(tables, str(tmp_path / "report.html")))
    by_key = {(r.step, r.sample_index, r.rollout_n): r.trace_id
              for r in tables.trajectories.itertuples()}  # fmt: skip
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        page = browser.new_page()
        page.goto(path.as_uri())
        # the Health section comes first, with each flag's count over steps
        first = page.locator("section").first
        assert first.get_attribute("id") == "health"
        count = page.locator('#health tr[data-flag="zero_variance_rising"] td.flag-count')
        assert count.inner_text() == "8"
        assert page.locator('#health tr[data-flag="tool_loop"] td.flag-count').inner_text() == "1"
        # a link opens that transcript
        link = page.locator('#health tr[data-flag="tool_error_burst"] a.flag-link').first
        assert link.get_attribute("data-trace") == by_key[(1, 2, 0)]
        link.click()
        text = page.locator("#transcript").text_content() or ""
        assert f"trace {by_key[(1, 2, 0)]}" in text and "error: bad input" in text
        # and a link works as an address too
        page.goto(path.as_uri() + f"#t-{by_key[(1, 0, 0)]}")
        page.reload()
        assert f"trace {by_key[(1, 0, 0)]}" in (page.locator("#transcript").text_content() or "")
        browser.close()
