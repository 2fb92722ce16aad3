"""``rollout-tracer export --format inspect``: Inspect eval logs read back with Inspect's own
``read_eval_log`` equal the traced trajectories, and ``inspect view`` (a real server on
loopback, in headless Chromium) shows a trajectory's tool call."""

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
            page.screenshot(path=str(tmp_path / "inspect.png"))
        except BaseException:
            page.screenshot(path=str(tmp_path / "failure.png"))
            print(f"page at failure: {page.url}; {tmp_path}/failure.png")
            raise
        finally:
            browser.close()
