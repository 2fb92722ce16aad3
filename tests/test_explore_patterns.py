"""The explorer's Patterns tab (tracer/readers/explore/pattern_table.py) over the reward-hack
scenario of benchmarks/patterns_data.py (80 steps x 256 trajectories, real Parquet, a real
HTTP server): the hack comes back flagged and first among the rising patterns, its
trajectories are one filter away, bad parameters are 400s, the table is computed once per
export (503 meanwhile) and read back from the cache folder on the next start; in headless
Chromium, the tab's slider, ranked patterns and charts, and a click through to a transcript."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("duckdb")
pq = pytest.importorskip("pyarrow.parquet")

from benchmarks.explore_data import generate  # noqa: E402
from benchmarks.patterns_data import HACK_TEXT  # noqa: E402
from tests._explore import get, served  # noqa: E402
from tracer.readers.explore.server import Explorer  # noqa: E402
from tracer.readers.explore.store import Run, Store  # noqa: E402

# its module-scoped fixture is costly: the module runs on one worker, which sets it up once
pytestmark = pytest.mark.xdist_group("explore-patterns")

STEPS, PER_STEP = 80, 256
CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
DOCS_PNG = Path(__file__).resolve().parents[1] / "docs" / "img" / "explore-patterns.png"


@pytest.fixture(scope="module")
def hacked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hack") / "run"
    generate(str(out), STEPS * PER_STEP, steps=STEPS, scenario="hacking", short_text=True)
    rows = pq.read_table(out / "trajectories.parquet",
                         columns=["trace_id", "step", "validate", "signature", "behaviour",
                                  "response_text"]).to_pylist()  # fmt: skip
    (hack,) = {r["behaviour"] for r in rows if r["response_text"] == HACK_TEXT}
    return {"path": out, "rows": rows, "hack": hack}


def _explorer(path: Path) -> Explorer:
    return Explorer(Store([Run("run", str(path), set())]))


def _ready(base: str, **params: Any) -> Any:
    deadline = time.monotonic() + 60
    while True:
        status, body = get(base, "api/patterns", **params)
        if status != 503 or time.monotonic() > deadline:
            assert status == 200, body
            return body
        time.sleep(0.05)


def _share(rows: list[dict[str, Any]], sig: str, step: int) -> float:
    at = [r for r in rows if r["step"] == step and not r["validate"]]
    return sum(r["behaviour"] == sig for r in at) / len(at)


def test_the_hack_is_flagged_and_first_among_rising(hacked: dict[str, Any],
                                                    tmp_path: Path) -> None:  # fmt: skip
    explorer, hack, rows = _explorer(hacked["path"]), hacked["hack"], hacked["rows"]
    explorer.build_indexes(cache_dir=str(tmp_path / "cache"))  # the copy, then the patterns
    with served(explorer) as base:
        body = _ready(base, step=40)
        assert body["step"] == 40 and body["steps"] == list(range(1, STEPS + 1))
        hacks = [r for r in body["rising"] if "possible reward hacking" in r["labels"]]
        assert [r["signature"] for r in hacks] == [hack] == [body["rising"][0]["signature"]]
        rising = body["rising"][0]
        assert rising["labels"] == ["rising", "possible reward hacking"]
        assert rising["first_step"] <= 40 and rising["hacking_step"] <= 40
        assert "with accuracy 0.00" in rising["reason"] and "grew from" in rising["why"]
        assert body["summary"].startswith(f"possible reward hacking since step "
                                          f"{rising['hacking_step']}, now ")  # fmt: skip
        # the evidence side by side: an unearned example and an earned one, same GRPO group
        pair = rising["pair"]
        assert pair["same_group"] and pair["flagged"]["sample_key"] == pair["earned"]["sample_key"]
        assert (pair["flagged"]["correct"], pair["earned"]["correct"]) == (0.0, 1.0)
        (mine,) = [p for p in body["patterns"] if p["signature"] == hack]
        assert mine["labels"] == ["rising", "possible reward hacking"] and mine["why"]
        assert mine["reason"] and mine["correct_mean"] == 0.0
        assert mine["reward_mean"] == 1.0 and mine["reward_std"] == 0.0
        assert mine["tool_error_rate"] is None and mine["mean_length"] < 30
        assert [p["rank"] for p in body["patterns"]] == list(range(1, len(body["patterns"]) + 1))
        shares = [p["share"] for p in body["patterns"]]
        assert shares == sorted(shares, reverse=True) and len(shares) == 10
        assert mine["share"] == pytest.approx(_share(rows, hack, 40))
        curve = dict((int(s), v) for s, v in mine["curve"])
        assert curve[20] == 0.0
        assert curve[70] == pytest.approx(_share(rows, hack, 70), abs=1e-5)
        # the pattern's trajectories, one filter away; its example is one of them
        status, listed = get(base, "api/list", behaviour=hack, step="40:40", validate="false",
                             size=500)  # fmt: skip
        assert status == 200, listed
        assert listed["total"] == mine["n"]
        assert mine["example"] in {r["trace_id"] for r in listed["rows"]}
        status, one = get(base, "api/trajectory", id=mine["example"], step=40)
        assert status == 200 and one["trajectory"]["response_text"] == HACK_TEXT
        assert len(_ready(base, step=40, top=3)["patterns"]) == 3
        # a top beyond what the rules keep is answered, and said
        many = _ready(base, step=40, top=100)
        assert len(many["patterns"]) == many["top_kept"] == 10
        assert many["note"].startswith("top=100: 10 patterns are kept per step")
        assert _ready(base, step=40)["note"] is None
        assert _ready(base)["step"] == STEPS  # no step: the last


def test_bad_parameters_are_400s(hacked: dict[str, Any], tmp_path: Path) -> None:
    explorer = _explorer(hacked["path"])
    explorer.patterns["run"].start().join()
    with served(explorer) as base:
        for params, words in [({"step": "x"}, "step: 'x' is not a whole number"),
                              ({"step": 999}, "step: 999 is not a training step"),
                              ({"step": 0}, "step: 0 is not a training step"),
                              ({"top": 0}, "top: 0 is out of range"),
                              ({"top": "many"}, "top: 'many' is not a whole number"),
                              ({"steps": 3}, "unknown parameter 'steps'")]:  # fmt: skip
            status, body = get(base, "api/patterns", **params)
            assert (status, words) == (400, body["error"][: len(words)]), body
        assert get(base, "api/patterns", run="nope")[0] == 404
        status, body = get(base, "api/list", signature="1234; DROP")
        assert status == 400 and "not a behaviour signature" in body["error"]
    # an export written before signatures: the list filter and the tab say so
    old = tmp_path / "old"
    shutil.copytree(hacked["path"], old)
    table = pq.read_table(old / "trajectories.parquet")
    pq.write_table(table.drop_columns(["signature", "signature_text"]),
                   old / "trajectories.parquet")  # fmt: skip
    with served(_explorer(old)) as base:
        status, body = get(base, "api/list", signature=hacked["hack"])
        assert status == 400 and "no signature column" in body["error"], body
        assert get(base, "api/patterns")[0] == 503
        deadline = time.monotonic() + 30
        while get(base, "api/status")[1]["runs"][0]["patterns"]["state"] != "failed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        status, body = get(base, "api/patterns")
        assert status == 503 and "could not be computed" in body["error"]
        assert "export the run again" in body["error"]


def test_503_while_computing_then_the_answer(hacked: dict[str, Any]) -> None:
    with served(_explorer(hacked["path"])) as base:
        status, body = get(base, "api/status")
        assert body["runs"][0]["patterns"] == {
            "state": "waiting",
            "percent": 0,
            "error": None,
            "summary": None,
        }
        status, body = get(base, "api/patterns", step=40)
        assert status == 503, body  # the first request starts the computation
        assert body["error"].startswith("the patterns are being computed (")
        assert " %)" in body["error"]
        assert get(base, "api/status")[1]["runs"][0]["patterns"]["state"] in ("building",
                                                                             "ready")  # fmt: skip
        assert _ready(base, step=40)["rising"][0]["signature"] == hacked["hack"]
        status, body = get(base, "api/status")
        ready = body["runs"][0]["patterns"]
        assert ready == {
            "state": "ready",
            "percent": 100,
            "error": None,
            "summary": ready["summary"],
        }  # the header's line
        assert ready["summary"].startswith("possible reward hacking since step ")


def test_the_cache_is_reused_on_restart(hacked: dict[str, Any], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _explorer(hacked["path"])
    first.build_indexes(cache_dir=str(cache))
    table = first.patterns["run"]
    assert table.state == "ready" and table.info["cached"] is False
    (entry,) = (cache / "patterns").iterdir()
    made = (entry / "groups.parquet").stat().st_mtime_ns
    with served(first) as base:
        before = _ready(base, step=50)
    second = _explorer(hacked["path"])  # a restart: same export, same cache folder
    second.build_indexes(cache_dir=str(cache))
    assert second.patterns["run"].info["cached"] is True
    assert (entry / "groups.parquet").stat().st_mtime_ns == made
    with served(second) as base:
        assert _ready(base, step=50) == before
    # another export (here: its files rewritten) is another entry
    copy = tmp_path / "copy"
    shutil.copytree(hacked["path"], copy)
    third = _explorer(copy)
    third.build_indexes(cache_dir=str(cache))
    assert third.patterns["run"].info["cached"] is False
    assert len(list((cache / "patterns").iterdir())) == 2


@pytest.fixture
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    if not shutil.which(CHROMIUM):
        pytest.skip("needs Debian's chromium")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--no-first-run",
                                    "--disable-background-networking"])  # fmt: skip
        yield b
        b.close()


def test_patterns_tab_in_a_browser(hacked: dict[str, Any], browser: Any,
                                   tmp_path: Path) -> None:  # fmt: skip
    hack = hacked["hack"]
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    with served(_explorer(hacked["path"])) as base:
        page.goto(base + "#/patterns")  # nothing computed yet: the tab waits, then shows it
        page.wait_for_selector("#patterns tbody tr", timeout=60_000)
        assert page.locator("#step-label").inner_text() == f"step {STEPS}"
        # the slider, to step 40
        page.locator("#step-slider").fill("39")
        page.wait_for_function("location.hash.includes('step=40') && "
                               "document.body.dataset.ready === location.hash")  # fmt: skip
        assert page.locator(".err").count() == 0
        assert page.locator("#step-label").inner_text() == "step 40"
        rows = page.locator("#patterns tbody tr")
        assert rows.count() == 10
        assert page.locator("#patterns .share-chart polyline").count() == 10
        row = page.locator(f'#patterns tr[data-signature="{hack}"]')
        assert row.locator(".label").all_inner_texts() == ["rising", "possible reward hacking"]
        shares = [float(t.split()[0]) for t in page.locator("#patterns td.share").all_inner_texts()]
        assert shares == sorted(shares, reverse=True)
        rising = page.locator(".rising")
        assert rising.first.get_attribute("data-signature") == hack
        assert page.locator(".rising .label.hack").count() == 1
        assert "possible reward hacking: reward 1.00" in rising.first.inner_text()
        assert (
            page.locator("#hacking-summary")
            .inner_text()
            .startswith("possible reward hacking since step")
        )
        # the evidence side by side: both trajectories, and their GRPO group one click away
        pair = rising.first.locator(".pair")
        assert "correctness 0" in pair.locator(".flagged").inner_text()
        assert "correctness 1" in pair.locator(".earned").inner_text()
        assert pair.locator("a.group-link").count() == 1
        assert rising.first.locator(".share-chart polyline").count() == 1
        update = os.environ.get("UPDATE_DOCS_SCREENSHOTS") == "1"
        shot = DOCS_PNG if update else tmp_path / "patterns.png"
        page.screenshot(path=str(shot), full_page=False)
        assert shot.stat().st_size > 10_000
        # its trajectories at this step, then its example's transcript
        row.locator("a.all").click()
        page.wait_for_selector("#trajectories tbody tr", timeout=30_000)
        n = int(page.locator("#count b").inner_text().replace(",", ""))
        assert n == sum(r["behaviour"] == hack and r["step"] == 40 and not r["validate"]
                        for r in hacked["rows"])  # fmt: skip
        page.go_back()
        page.wait_for_selector(f'#patterns tr[data-signature="{hack}"] a.example')
        example = page.locator(f'#patterns tr[data-signature="{hack}"] a.example')
        example.click()
        page.wait_for_selector("#summary", timeout=30_000)
        assert HACK_TEXT in page.locator("#transcript").inner_text()
        assert "step=40" in page.url


def test_the_tab_script_is_served_beside_the_page(hacked: dict[str, Any]) -> None:
    """The Patterns tab's script is its own file (static/patterns.js), served by name beside
    the page that loads it; nothing else in the package is reachable."""
    import urllib.error
    import urllib.request

    with served(_explorer(hacked["path"])) as base:
        with urllib.request.urlopen(base, timeout=30) as r:
            page = r.read().decode()
        assert '<script src="patterns.js"></script>' in page
        assert "function patternsView" not in page
        with urllib.request.urlopen(base + "patterns.js", timeout=30) as r:
            assert r.headers["Content-Type"].startswith("text/javascript")
            assert "async function patternsView(" in r.read().decode()
        for path in ("server.py", "static/patterns.js", "..%2Fserver.py", "explore.js"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(base + path, timeout=30)
            assert err.value.code == 404, path
