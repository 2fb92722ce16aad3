"""The HTML report, opened in headless Chromium: panels render with the numbers of the run."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

import tracer
from tests import export_agent

pytest.importorskip("mlflow")
pytest.importorskip("pyarrow")

from rollout.cli import main

PROJECT = "report-test"
CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
DOCS_PNG = Path(__file__).resolve().parents[1] / "docs" / "report.png"


@pytest.fixture
def report(tmp_path: Path, mlflow_uri: str) -> tuple[Path, dict]:
    export_agent.init(str(tmp_path), mlflow_uri, PROJECT)
    expected = export_agent.run([1, 2, 3])
    export_agent.run([3], validate=True)
    assert tracer.flush(timeout_s=60)
    out = tmp_path / "report.html"
    argv = ["report", "--from", "mlflow", "--tracking-uri", mlflow_uri, "--experiment", PROJECT,
            "--no-validate", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    return out, expected


def _expected_numbers(expected: dict) -> tuple[dict[int, float], int, int]:
    means: dict[int, float] = {}
    groups: dict[tuple[int, int], list[float]] = {}
    for (step, sample, _), v in expected.items():
        groups.setdefault((step, sample), []).append(v["score"])
    for step in sorted({k[0] for k in groups}):
        rewards = [r for (s, _), rs in groups.items() if s == step for r in rs]
        means[step] = sum(rewards) / len(rewards)
    flagged = sum(len(set(rs)) == 1 for rs in groups.values())
    return means, flagged, len(groups)


def test_report_is_self_contained(report: tuple[Path, dict]) -> None:
    html = report[0].read_text()
    assert "<svg" in html and "<script>" in html
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "no network resources"
    means, flagged, total = _expected_numbers(report[1])
    for step, mean in means.items():
        row = f'<tr data-step="{step}"><td>{step}</td><td>6</td><td class="mean-reward">'
        assert f"{row}{mean:.3f}</td>" in html
    assert f'<span id="zero-adv-count">{flagged}</span>' in html
    assert f'<span id="group-count">{total}</span>' in html
    # behaviour patterns: the section, the first and last steps' tables, no rising ones
    habits = html.split('<section id="habits">', 1)[1].split("</section>", 1)[0]
    assert "<h2>Habits of the policy</h2>" in habits and 'id="rising-none"' in habits
    for step in (1, 3):
        table = habits.split(f'<table class="patterns" data-step="{step}">', 1)[1]
        shares = re.findall(r"<tr data-signature=\"[^\"]+\"><td>\d+</td><td>([\d.]+)%",
                            table.split("</table>", 1)[0])  # fmt: skip
        assert shares and abs(sum(map(float, shares)) - 100) < 0.2  # a few patterns: all shown


@pytest.mark.skipif(not shutil.which(CHROMIUM), reason="needs Debian's chromium")
def test_report_renders_in_chromium(report: tuple[Path, dict]) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    path, expected = report
    means, flagged, total = _expected_numbers(expected)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(path.parent / "chromium-profile"),
            executable_path=CHROMIUM,
            headless=True,
            viewport={"width": 1240, "height": 900},
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        requests: list[str] = []
        page = browser.new_page()
        page.on("request", lambda r: requests.append(r.url))
        page.goto(path.as_uri())
        # per-step table: mean reward as traced
        for step, mean in means.items():
            cell = page.locator(f'#rewards tr[data-step="{step}"] td.mean-reward')
            assert cell.inner_text() == f"{mean:.3f}"
        # charts drawn (strip chart + 4 trend charts)
        assert page.locator("section#rewards svg circle").count() == len(expected)
        assert page.locator("section#trends svg").count() == 4
        # GRPO groups: zero-advantage groups flagged
        assert page.locator("#zero-adv-count").inner_text() == str(flagged)
        assert page.locator("#group-count").inner_text() == str(total)
        assert page.locator("tr.zero").count() == flagged
        # same prompt across steps: every sample's prompt is seen in 3 steps
        assert page.locator("#prompts tbody tr").count() == export_agent.SAMPLES
        # transcript: clicking a reward shows that trajectory, tool error and reward included
        page.locator('details[data-step="3"] tr:last-child td.cell').first.click()
        box = page.locator("#transcript")
        text = box.text_content() or ""
        assert "What is 2 + 7?" in text and "tool calculator" in text
        assert "reward: 1" in text or "reward: 0" in text
        page.select_option("#pick", index=3)  # step 1, sample 1, rollout 1: the failing tool
        assert "error: cannot evaluate 'x/y'" in (box.text_content() or "")
        # habits of the policy: a pattern's example opens its transcript
        link = page.locator('#habits table[data-step="3"] a.flag-link').first
        link.click()
        assert f"trace {link.get_attribute('data-trace')}" in (box.text_content() or "")
        page.locator("details[data-step='3']").scroll_into_view_if_needed()
        page.evaluate("window.scrollTo(0, 0)")
        # the README's picture is refreshed on request only, so test runs never dirty the repo
        update = os.environ.get("UPDATE_DOCS_SCREENSHOTS") == "1"
        shot = DOCS_PNG if update else path.parent / "r.png"
        shot.parent.mkdir(exist_ok=True)
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert all(u.startswith("file://") for u in requests), requests
    assert shot.stat().st_size > 10_000


@pytest.mark.parametrize(
    "values",
    [[0.0, 0.05, 1.05], [0.05, 0.05], [-0.3, 0.7, 2.2], [1.05, 1.1], [0.0, 0.0], [3.0, 41.0]],
)
def test_chart_axes_contain_their_points(values: list[float]) -> None:
    import re

    from tracer.readers.svg import PAD_B, H, line_chart, strip_chart

    points = [(float(i % 2 + 1), v) for i, v in enumerate(values)]
    for svg in (line_chart({"reward": points}, "reward"),
                strip_chart(points, points[:1], "reward")):  # fmt: skip
        grid = [float(y) for y in re.findall(r'<line x1="[\d.]+" x2="[\d.]+" y1="([\d.]+)"[^>]*'
                                             r'class="g"', svg)]  # fmt: skip
        labels = [float(t) for t in re.findall(r'class="yl">([-\d.]+)<', svg)]
        dots = [float(y) for y in re.findall(r'<circle cx="[-\d.]+" cy="([-\d.]+)"', svg)]
        assert grid and dots
        assert min(grid) - 0.05 <= min(dots) and max(dots) <= H - PAD_B + 0.05
        assert min(labels) <= min(values) and max(labels) >= max(values), (labels, values)
