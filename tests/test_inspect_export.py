"""``rollout-tracer export --format inspect``: Inspect eval logs read back with Inspect's own
``read_eval_log`` equal the traced trajectories (messages, events, every tool result, the error
of a trajectory that raised), and ``inspect view`` (a real server on loopback, in headless
Chromium) shows a trajectory's tool call and its Transcript."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer
from rollout.cli import main
from tests import tool_rollout
from tests._servers import _stop_group, free_port

inspect_log = pytest.importorskip("inspect_ai.log")
CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
STEPS = (1, 2)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("inspect")
    jsonl = tmp / "traces.jsonl"
    tracer.init(
        {"backend": "jsonl", "jsonl_path": str(jsonl), "experiment_name": "grpo",
         "spool": False, "raise_internal_errors": True}
    )  # fmt: skip
    try:
        for step in STEPS:
            tool_rollout.run(step=step, samples=2, rollout_n=2)
        assert tracer.flush(timeout_s=60)
    finally:
        tracer.shutdown()
    out = tmp / "logs"
    args = ["export", "--from", "jsonl", "--path", str(jsonl), "--format", "inspect"]
    assert main([*args, "--out", str(out), "--no-progress"]) == 0
    return out


def test_logs_read_back_equal_the_trajectories(exported: Path) -> None:
    files = sorted(exported.glob("*.eval"))
    assert [f.name for f in files] == ["step-000001.eval", "step-000002.eval"]
    seen = set()
    for step, file in zip(STEPS, files, strict=True):
        log = inspect_log.read_eval_log(str(file))
        assert log.status == "success" and log.eval.config.epochs == 2
        # the run's start and end: inspect view shows a duration (NaN days without them)
        assert "" < log.stats.started_at <= log.stats.completed_at
        assert log.results.scores[0].name == "reward"
        assert len(log.samples) == 4
        for sample in log.samples:
            meta = sample.metadata
            key = (meta["step"], meta["sample_index"], meta["rollout_n"])
            seen.add(key)
            assert key[0] == step and sample.id == key[1] and sample.epoch == key[2] + 1
            assert meta["validate"] is False and meta["experiment_name"] == "grpo"
            assert len(meta["trace_id"]) == 32 and isinstance(meta["flags"], list)
            expected = tool_rollout.EXPECTED[key]
            assert sample.scores["reward"].value == expected["reward"]
            assert meta["logprobs"] == pytest.approx(expected["logprobs"])
            assert _plain(sample.messages) == _plain_expected(expected["messages"])
            assert [m.role for m in sample.input] == ["system", "user"]
            assert sample.output.completion == expected["messages"][-1]["content"]
            replies = [m for m in sample.messages if m.role == "assistant"]
            assert replies[0].metadata["logprobs"] == pytest.approx(expected["logprobs"][:5])
    assert seen == {(s, i, n) for s in STEPS for i in range(2) for n in range(2)}


def test_samples_have_events_for_the_transcript(exported: Path) -> None:
    """Each sample's events: a model event per generate call (the chat so far in, the reply
    out), a tool event per tool call, the reward's score event, in the order they ran."""
    log = inspect_log.read_eval_log(str(exported / "step-000001.eval"))
    for sample in log.samples:
        events = sample.events
        assert [e.event for e in events] == ["model", "tool"] * 2 + ["model", "score"]
        model = [e for e in events if e.event == "model"]
        replies = [i for i, m in enumerate(sample.messages) if m.role == "assistant"]
        for event, at in zip(model, replies, strict=True):
            assert [m.text for m in event.input] == [m.text for m in sample.messages[:at]]
            assert event.output.completion == sample.messages[at].text
            assert event.output.usage.output_tokens == 5
        calls = [c for m in sample.messages if m.role == "assistant" for c in m.tool_calls or []]
        results = [m for m in sample.messages if m.role == "tool"]
        for event, call, result in zip((e for e in events if e.event == "tool"), calls, results,
                                       strict=True):  # fmt: skip
            assert (event.id, event.function, event.arguments) == (
                call.id, "calculator", call.arguments)  # fmt: skip
            assert event.result == result.text and event.error is None
        assert events[-1].score.value == sample.scores["reward"].value == 1.0
        times = [e.timestamp for e in events]
        assert times == sorted(times) and events[0].timestamp.isoformat() >= sample.started_at


@pytest.fixture(scope="module")
def cut_short(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Step 5: trajectories cut by the turn limit right after a tool call (no answer, no
    reward); step 6: trajectories that raised after their first tool result."""
    tmp = tmp_path_factory.mktemp("inspect-cut")
    jsonl = tmp / "traces.jsonl"
    tracer.init({"backend": "jsonl", "jsonl_path": str(jsonl), "spool": False,
                 "raise_internal_errors": True})  # fmt: skip
    try:
        tool_rollout.run(step=5, samples=1, rollout_n=2, max_turns=2)
        tool_rollout.run(step=6, samples=1, rollout_n=2, fail=True)
        assert tracer.flush(timeout_s=60)
    finally:
        tracer.shutdown()
    out = tmp / "logs"
    args = ["export", "--from", "jsonl", "--path", str(jsonl), "--format", "inspect"]
    assert main([*args, "--out", str(out), "--no-progress"]) == 0
    return {step: inspect_log.read_eval_log(str(out / f"step-{step:06d}.eval")) for step in (5, 6)}


def test_a_trajectory_ending_on_a_tool_call_keeps_its_results(cut_short: Any) -> None:
    for sample in cut_short[5].samples:
        expected = tool_rollout.EXPECTED[(5, sample.id, sample.epoch - 1)]["messages"]
        assert [m.role for m in sample.messages] == [m["role"] for m in expected]
        *_, last_reply, last_result = sample.messages
        assert last_reply.role == "assistant" and last_result.role == "tool"
        assert last_result.text == expected[-1]["content"] == "395"
        assert last_result.tool_call_id == last_reply.tool_calls[0].id
        assert last_result.function == "calculator"
        tools = [e for e in sample.events if e.event == "tool"]
        assert [e.result for e in tools] == ["391", "395"]
        assert sample.error is None and "reward" not in (sample.scores or {})


def test_a_trajectory_that_raised_has_its_error(cut_short: Any) -> None:
    log = cut_short[6]
    assert log.results.total_samples == 2 and log.results.completed_samples == 0
    for sample in log.samples:
        assert sample.error is not None
        assert sample.error.message == "ConnectionError: engine lost"
        assert "raise ConnectionError" in sample.error.traceback
        assert [e.event for e in sample.events] == ["model", "tool", "error"]
        assert sample.events[-1].error.message == sample.error.message
        assert sample.messages[-1].role == "tool" and sample.messages[-1].text == "391"


def _plain(messages: list[Any]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        item: dict[str, Any] = {"role": m.role, "content": m.text}
        if m.role == "assistant" and m.tool_calls:
            item["tool_calls"] = [(c.id, c.function, c.arguments) for c in m.tool_calls]
        if m.role == "tool":
            item["tool_call_id"], item["function"] = m.tool_call_id, m.function
        out.append(item)
    return out


def _plain_expected(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        item: dict[str, Any] = {"role": m["role"], "content": m["content"]}
        if m.get("tool_calls"):
            item["tool_calls"] = [
                (c["id"], c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in m["tool_calls"]
            ]
        if m["role"] == "tool":
            item["tool_call_id"], item["function"] = m["tool_call_id"], m["name"]
        out.append(item)
    return out


@pytest.fixture
def inspect_view(exported: Path, tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = open(tmp_path / "view.log", "wb")  # noqa: SIM115  (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "inspect_ai", "view", "start", "--log-dir", str(exported),
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "INSPECT_TELEMETRY": "", "DO_NOT_TRACK": "1"},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5):
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((tmp_path / "view.log").read_text()[-3000:])
            time.sleep(0.5)
        yield url
    finally:
        _stop_group(proc)  # type: ignore[arg-type]
        log.close()


@pytest.mark.skipif(not shutil.which(CHROMIUM), reason=f"needs chromium at {CHROMIUM}")
def test_inspect_view_shows_a_tool_call(inspect_view: str, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        page.set_default_timeout(120_000)
        try:
            page.goto(inspect_view)
            page.get_by_text("grpo/step-000002").first.click()
            page.get_by_text(tool_rollout.QUESTION).first.click()
            page.get_by_text("17 * 23").first.wait_for()
            page.get_by_text("calculator").first.wait_for()
            # the Transcript tab shows the sample's events: each model call as a turn, the tools
            page.get_by_text("Transcript").first.click()
            page.get_by_text("turn 3/3").first.wait_for()
            page.get_by_text("Tool: calculator").first.wait_for()
            page.screenshot(path=str(tmp_path / "inspect.png"))
        except BaseException:
            page.screenshot(path=str(tmp_path / "failure.png"))
            print(f"page at failure: {page.url}; {tmp_path}/failure.png")
            raise
        finally:
            browser.close()
