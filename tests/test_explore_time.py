"""The explorer's Time tab over a real traced run with planted stragglers
(benchmarks/timing_scenario.py -> the JSONL backend -> the export): its endpoint answers what the
export's steps table says, and in headless Chromium the tab draws a step's trajectories on one
time axis and a click opens the slowest one's transcript at its slow tool call."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer
from benchmarks.timing_scenario import SLOW_TOOL, run_scenario
from tests._explore import get, serving
from tracer.readers import export

pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("duckdb")

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
DOCS_PNG = Path(__file__).resolve().parents[1] / "docs" / "img" / "explore-time.png"
SAMPLES = 12


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("explore-time")
    tracer.init(backend="jsonl", jsonl_path=str(root / "t.jsonl"))
    planted = run_scenario(steps=4, samples=SAMPLES, slow_prob=0.3, seed=3)
    assert tracer.flush(30)
    tracer.reset()
    export("jsonl", str(root / "export"), path=str(root / "t.jsonl"))
    steps = {r["step"]: r for r in pq.read_table(root / "export" / "steps.parquet").to_pylist()}
    slow_step = max(planted.slow_steps())
    with serving([("run", root / "export")], root / "cache", search=0) as base:
        yield {
            "base": base,
            "steps": steps,
            "slow_step": slow_step,
            "root": root,
            "rows": pq.read_table(root / "export" / "trajectories.parquet").to_pylist(),
        }


def test_timing_endpoint_answers_a_step(run: dict[str, Any]) -> None:
    step = run["slow_step"]
    status, body = get(run["base"], "api/timing", step=step)
    assert status == 200, body
    want = run["steps"][step]
    assert body["summary"]["tail_ratio"] == pytest.approx(want["tail_ratio"])
    assert body["summary"]["top_straggler_cause"] == f"tool {SLOW_TOOL}"
    assert [c["step"] for c in body["curves"]] == sorted(run["steps"])
    trajs = body["trajectories"]
    assert body["count"] == len(trajs) == SAMPLES
    lat = [t["latency_ms"] for t in trajs]
    assert lat == sorted(lat, reverse=True)  # slowest first
    assert trajs[0]["trace_id"] == want["top_straggler_trace_id"]
    mine = [s for s in body["spans"] if s["trace_id"] == trajs[0]["trace_id"]]
    assert sorted(s["kind"] for s in mine) == ["generate", "generate", "tool"]
    [slow] = [s for s in mine if s["span_id"] == trajs[0]["slow_span_id"]]
    assert (slow["kind"], slow["name"]) == ("tool", SLOW_TOOL)
    # every span lies inside the step's axis
    assert all(body["t0_us"] <= s["start_us"] <= body["t1_us"] for s in body["spans"])
    status, body = get(run["base"], "api/timing", step=999)
    assert status == 404 and "no step 999" in body["error"]


@pytest.mark.slow(seconds=15)
@pytest.mark.skipif(not shutil.which(CHROMIUM), reason="needs Debian's chromium")
def test_time_tab_draws_a_step_and_a_click_opens_the_slow_span(
    run: dict[str, Any], tmp_path: Path
) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    step = run["slow_step"]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu"])  # fmt: skip
        page = browser.new_context(viewport={"width": 1280, "height": 760}).new_page()
        page.goto(run["base"] + f"#/time?step={step}")
        page.wait_for_function("document.body.dataset.ready === location.hash", timeout=60_000)
        assert page.locator(".err").count() == 0
        rows = page.locator("#gantt .gantt-row")
        assert rows.count() == SAMPLES
        assert page.locator("#gantt .seg-tool").count() == SAMPLES
        assert page.locator("#gantt .seg-generate").count() == 2 * SAMPLES
        assert page.locator("#top-cause").inner_text() == f"tool {SLOW_TOOL}"
        assert page.locator("svg.time-curve polyline").count() == 2
        shot = DOCS_PNG if os.environ.get("UPDATE_DOCS_SCREENSHOTS") == "1" else \
            tmp_path / "time.png"  # fmt: skip
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000
        other = min(s for s in run["steps"] if s != step)  # a point of a curve: that step
        page.locator(f'svg.time-curve .pt[data-step="{other}"]').first.click()
        page.wait_for_function(f"location.hash.includes('step={other}') && "
                               "document.body.dataset.ready === location.hash")  # fmt: skip
        assert page.locator("#time-step").input_value() == str(other)
        assert page.locator("#gantt .gantt-row").count() == SAMPLES
        page.go_back()
        page.wait_for_function("document.body.dataset.ready === location.hash")
        top = run["steps"][step]["top_straggler_trace_id"]
        assert rows.first.get_attribute("data-trace") == top
        rows.first.click()
        page.wait_for_selector("#summary", timeout=30_000)
        page.wait_for_function("document.body.dataset.ready === location.hash")
        assert top in page.locator("#summary").inner_text()
        slow = page.locator(".slow-span")
        assert slow.count() == 1
        assert slow.get_attribute("class") is not None and "tool" in slow.get_attribute("class")
        assert f"tool {SLOW_TOOL}" in slow.inner_text()
        assert slow.get_attribute("data-span") == run["steps"][step]["top_straggler_span_id"]
        browser.close()
