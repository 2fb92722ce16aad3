"""The explorer's page in headless Chromium (Debian's, driven by Playwright) over 10,000
generated trajectories: filter, sort and page; search and open a hit; a GRPO group, then one of
its trajectories with its transcript and token overlay; the prompt across steps; a copied URL
reloaded in a new tab; the back button. Expected numbers come from the Parquet files."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("tantivy")
pq = pytest.importorskip("pyarrow.parquet")
sync_api = pytest.importorskip("playwright.sync_api")

from tests._explore import make_export, serving  # noqa: E402

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
N = 10_000
TOKENS_PER_TURN = 4
# one worker runs the module: the export and the explorer start once, not once per worker
pytestmark = [pytest.mark.skipif(not shutil.which(CHROMIUM), reason="needs Debian's chromium"),
              pytest.mark.xdist_group("explore-browser"), pytest.mark.slow(seconds=25)]


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("explore-browser")
    folder = make_export(root / "run", N, seed=3, tokens_per_turn=TOKENS_PER_TURN)
    rows = pq.read_table(folder / "trajectories.parquet").to_pylist()
    with serving([("run", folder)], root / "cache") as base, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--no-first-run",
                                          "--disable-background-networking"])  # fmt: skip
        context = browser.new_context(viewport={"width": 1280, "height": 900})
        requests: list[str] = []
        context.on("request", lambda r: requests.append(r.url))
        yield {"base": base, "rows": rows, "context": context, "requests": requests}
        browser.close()


def _ready(page: Any) -> None:
    page.wait_for_function("document.body.dataset.ready === location.hash", timeout=60_000)
    errors = page.locator(".err")
    assert errors.count() == 0, errors.first.inner_text()


def test_filter_sort_page(app: dict[str, Any]) -> None:
    rows, page = app["rows"], app["context"].new_page()
    page.goto(app["base"] + "#/list")
    _ready(page)
    assert page.locator("#count b").inner_text().replace(",", "") == str(N)
    page.fill("input[name=step]", "3:4")
    page.select_option("select[name=validate]", "false")
    page.click("form.filters button[type=submit]")
    _ready(page)
    want = [r for r in rows if 3 <= r["step"] <= 4 and not r["validate"]]
    assert page.locator("#count b").inner_text().replace(",", "") == str(len(want))
    assert page.locator("#histogram rect").count() >= 1
    page.click('th[data-col="response_tokens"]')
    _ready(page)
    page.click('th[data-col="response_tokens"]')  # twice: descending
    _ready(page)
    assert "sort=-response_tokens" in page.url
    top = sorted(want, key=lambda r: -r["response_tokens"])  # ties: in the export's order
    assert page.locator("#trajectories tbody tr").first.get_attribute("data-id") == \
        top[0]["trace_id"]  # fmt: skip
    page.click("#next")
    _ready(page)
    assert page.locator("#trajectories tbody tr").first.get_attribute("data-id") == \
        top[50]["trace_id"]  # fmt: skip
    page.go_back()
    _ready(page)
    assert page.locator("#trajectories tbody tr").first.get_attribute("data-id") == \
        top[0]["trace_id"]  # fmt: skip
    assert all(u.startswith(app["base"]) for u in app["requests"]), "nothing from outside"


def test_search_and_open_a_hit(app: dict[str, Any]) -> None:
    page = app["context"].new_page()
    page.goto(app["base"] + "#/search")
    _ready(page)
    page.fill("#q", "timeout")
    page.click("form.filters button[type=submit]")
    _ready(page)
    first = page.locator(".hit").first
    assert first.locator("mark").first.inner_text().lower() == "timeout"
    trace_id = first.get_attribute("data-id")
    first.click()
    _ready(page)
    assert page.locator("#summary").inner_text().count(trace_id or "-") == 1
    assert page.locator("#transcript .tool.bad mark").first.inner_text().lower() == "timeout"


def test_group_then_trajectory_then_prompt_then_url_and_back(app: dict[str, Any]) -> None:
    rows, page = app["rows"], app["context"].new_page()
    step = 5
    groups: dict[str, list[float]] = {}
    for r in rows:
        if r["step"] == step and not r["validate"]:
            groups.setdefault(r["sample_key"], []).append(r["reward"])
    zero = sum(1 for v in groups.values() if len(v) > 1 and min(v) == max(v))
    page.goto(app["base"] + f"#/groups?step={step}")
    _ready(page)
    assert page.locator("#count b").inner_text() == str(zero)
    first_zero = page.locator(".group.zero").first
    assert "zero variance" in first_zero.inner_text()
    cell = page.locator(".group .cell").first
    trace_id = cell.get_attribute("data-id")
    cell.click()
    _ready(page)
    row = next(r for r in rows if r["trace_id"] == trace_id)
    assert trace_id in page.locator("#summary").inner_text()
    reward = page.locator("#summary tr:has(th:text-is('reward')) td").inner_text()
    assert float(reward) == row["reward"]
    assert page.locator("#transcript .turn").count() == 3
    tokens = page.locator("#transcript .tok")
    assert tokens.count() == 3 * TOKENS_PER_TURN
    assert "rollout_logprob:" in (tokens.first.get_attribute("title") or "")
    assert "background" in (tokens.first.get_attribute("style") or "")
    flags = page.locator("#flags .flag").all_inner_texts()
    assert flags == row["flags"] or (
        not row["flags"] and page.locator("#flags").inner_text() == "none")
    page.click("#prompt-link")
    _ready(page)
    same = {(r["step"], r["validate"]) for r in rows if r["prompt"] == row["prompt"]}
    assert page.locator("#prompt-steps tr[data-step]").count() == len(same) >= 2
    assert page.locator("#prompt-steps ins").count() + page.locator("#prompt-steps del").count() > 0
    url = page.url
    other = app["context"].new_page()  # a copied URL, opened fresh
    other.goto(url)
    _ready(other)
    assert other.locator("#prompt-steps tr[data-step]").count() == len(same)
    page.go_back()
    _ready(page)
    assert trace_id in page.locator("#summary").inner_text()
    page.go_back()
    _ready(page)
    assert page.locator("#count b").inner_text() == str(zero)


def test_steps_chart_filters_the_table(app: dict[str, Any]) -> None:
    page = app["context"].new_page()
    page.goto(app["base"] + "#/steps")
    _ready(page)
    assert page.locator("svg.chart").count() == 4
    page.locator('svg[data-metric="reward"] circle[data-step="2"]').click()
    _ready(page)
    want = sum(1 for r in app["rows"] if r["step"] == 2 and not r["validate"])
    assert page.locator("#count b").inner_text().replace(",", "") == str(want)


def test_search_before_and_after_the_index(app: dict[str, Any], tmp_path: Any) -> None:
    """A search typed before the index exists is answered by a scan (marked partial); the
    header follows the build to ready without a reload; the same search clicked again runs
    again (the URL does not change) and the index answers it."""
    import threading

    from tests._explore import served
    from tracer.readers.explore.search import SearchIndex
    from tracer.readers.explore.server import Explorer
    from tracer.readers.explore.store import Run, Store

    folder = make_export(tmp_path / "run", 300, seed=6)
    explorer = Explorer(Store([Run("run", str(folder), set())]))
    explorer.indexes = {"run": SearchIndex(str(folder), str(tmp_path / "cache"))}
    with served(explorer) as base:
        page = app["context"].new_page()
        page.goto(base + "#/search")
        _ready(page)
        assert "search: waiting to build" in page.locator("#status").inner_text()
        page.fill("#q", "timeout")
        page.click("form.filters button[type=submit]")
        _ready(page)
        assert "partial / scanning" in page.locator("#partial").inner_text()
        assert page.locator(".hit").count() > 0
        assert page.locator(".hit mark").first.inner_text().lower() == "timeout"
        builder = threading.Thread(target=explorer.build_indexes,
                                   kwargs={"cache_dir": str(tmp_path / "cache")})  # fmt: skip
        builder.start()
        page.wait_for_function("document.getElementById('status').dataset.settled === 'true'",
                               timeout=120_000)  # fmt: skip
        builder.join(timeout=60)
        assert page.locator("#status").inner_text().startswith("search: ready")
        renders = page.evaluate("document.body.dataset.renders")
        page.click("form.filters button[type=submit]")  # the same query, the same URL
        page.wait_for_function(f"document.body.dataset.renders > {renders}", timeout=60_000)
        _ready(page)
        assert page.locator("#partial").count() == 0
        assert page.locator(".hit mark").first.inner_text().lower() == "timeout"


def test_an_error_is_shown_alone(app: dict[str, Any]) -> None:
    page = app["context"].new_page()
    page.goto(app["base"] + "#/list")
    _ready(page)
    # a slow list still loading, then a view that fails at once: the list must not be drawn
    # under the error when its answer arrives (the list's answer is held back until then)
    held: list[Any] = []
    page.route("**/api/list?*", lambda route: held.append(route))
    page.evaluate("location.hash = '#/list?sort=-latency_ms'")
    for _ in range(600):  # until the request reaches the route handler (30 s at most)
        if held:
            break
        page.wait_for_timeout(50)
    page.evaluate("location.hash = '#/trajectory?id=zz'")
    page.wait_for_function("document.body.dataset.ready === location.hash", timeout=60_000)
    with page.expect_response(lambda r: "api/list" in r.url, timeout=60_000):
        held[0].continue_()
    page.unroute("**/api/list?*")
    # a few turns of the page's event loop: the list's answer has been handled by now
    page.evaluate("new Promise(r => setTimeout(() => requestAnimationFrame(() => "
                  "setTimeout(r, 50))))")  # fmt: skip
    assert page.locator("#view > *").count() == 1
    assert "not a trace id" in page.locator("#view .err").inner_text()
    page.goto(app["base"] + "#/list?f=nonexistent>1")
    page.wait_for_function("document.body.dataset.ready === location.hash", timeout=60_000)
    assert "unknown column 'nonexistent'" in page.locator("#view .err").inner_text()
    assert page.locator("#trajectories").count() == 0 and page.locator("#histogram").count() == 0
    assert page.locator("#view form.filters").count() == 1  # to correct the filter
