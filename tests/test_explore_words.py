"""Words first, on the main job's own store: a real ``rollout-tracer run`` (scripted engine, the
builtin SmolLM2 tokenizer) traces into a real MLflow store under the default project; token2text
records which tokenizer it used, so ``export`` and ``explore --from mlflow`` (no --tokenizer, no
--experiment) write the tokens table with each token's text, and a trajectory page shows the
model's words in every turn, never a row of token ids."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")
pytest.importorskip("duckdb")
pytest.importorskip("tantivy")
pytest.importorskip("transformers")
pq = pytest.importorskip("pyarrow.parquet")
# one worker runs the module: the main job, its export, the explorer and the browser start once,
# not once per worker
pytestmark = [pytest.mark.xdist_group("explore-words"), pytest.mark.slow(seconds=60)]

import tracer  # noqa: E402
from rollout.cli import main  # noqa: E402
from tests._explore import get  # noqa: E402
from tests.test_tracer_core import memory  # noqa: E402

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
STEPS, BATCH, N = 2, 2, 3
IDS = re.compile(r"(\(\d+\)){3,}")  # three token ids in a row: what a page without words shows


def test_token2text_records_its_tokenizer(smollm2_tokenizer: Any) -> None:
    mem = memory(token2text=True)
    tracer.register_tokenizer(smollm2_tokenizer)

    @tracer.trace_op(kind="generate")
    def generate(prompt_ids: list[int]) -> dict[str, Any]:
        return {"response_ids": prompt_ids[::-1]}

    with tracer.trace_attr(step=0, sample_index=0):
        generate(smollm2_tokenizer.encode("hello world", add_special_tokens=False))
    assert tracer.flush(10)
    attrs = mem.records[0].spans[1].attributes
    assert attrs["tokenizer"] == smollm2_tokenizer.name_or_path
    assert os.path.isdir(attrs["tokenizer"])  # the builtin's cache folder


def test_a_named_tokenizer_is_found_or_said_missing(smollm2_tokenizer: Any) -> None:
    from tracer.readers.tokenizers import TraceTokenizers

    found = TraceTokenizers()
    # the builtin's cache folder as another machine recorded it: found by the builtin's name
    tok = found("/home/someone-else/.cache/rollout-tracer/models/smollm2-135m-instruct")
    assert tok is not None and tok.decode([28]) == smollm2_tokenizer.decode([28])
    assert found(smollm2_tokenizer.name_or_path) is not None and found.note(10) is None
    assert found("no-such-model/anywhere") is None
    assert "no-such-model/anywhere: neither a local folder" in (found.note(10) or "")
    assert "--tokenizer NAME" in (found.note(10) or "") and found.note(0) is None
    unnamed = TraceTokenizers()
    assert unnamed(None) is None and "name no tokenizer" in (unnamed.note(5) or "")


@pytest.fixture(scope="module")
def main_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The main job's store: the default project, the builtin SmolLM2 tokenizer."""
    root = tmp_path_factory.mktemp("main-job")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    code = main(["run", "--no-progress", "actor_rollout_ref.rollout.name=scripted",
                 f"trainer.total_steps={STEPS}", f"data.train_batch_size={BATCH}",
                 f"actor_rollout_ref.rollout.n={N}", "trainer.logger=[console]",
                 "trainer.val_before_train=false", "actor_rollout_ref.rollout.trace.backend=mlflow",
                 f"actor_rollout_ref.rollout.trace.tracking_uri={uri}"])  # fmt: skip
    assert code == 0
    return {"root": root, "uri": uri}


@pytest.fixture(scope="module")
def exported(main_job: dict[str, Any]) -> dict[str, Any]:
    out = main_job["root"] / "export"
    done = subprocess.run([sys.executable, "-m", "rollout.cli", "export", "--from", "mlflow",
                           "--tracking-uri", main_job["uri"], "--out", str(out),
                           "--no-progress"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return {"out": out, "stderr": done.stderr}


def test_export_takes_the_tokenizer_the_trace_names(exported: dict[str, Any],
                                                     smollm2_tokenizer: Any) -> None:  # fmt: skip
    assert "note:" not in exported["stderr"]
    tokens = pq.read_table(exported["out"] / "tokens.parquet").to_pylist()
    assert tokens and all(t["token"] is not None for t in tokens)
    assert all(t["token"] == smollm2_tokenizer.decode([t["token_id"]]) for t in tokens[:200])


@pytest.fixture(scope="module")
def explore(main_job: dict[str, Any]) -> Iterator[dict[str, Any]]:
    proc = subprocess.Popen([sys.executable, "-m", "rollout.cli", "explore", "--from", "mlflow",
                             "--tracking-uri", main_job["uri"], "--port", "0", "--no-progress",
                             "--cache-dir", str(main_job["root"] / "cache")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    seen: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not any("http://" in s for s in seen):
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
    try:
        url = next(s for s in seen if "http://" in s).split("http://", 1)[1].split("/", 1)[0]
        yield {"base": f"http://{url}/", "output": "".join(seen)}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)


def test_explore_reads_the_default_project_and_says_so(explore: dict[str, Any]) -> None:
    assert "reading mlflow experiment 'rollout-tracer' (the tracer's default project" in \
        explore["output"]  # fmt: skip
    assert "note:" not in explore["output"]
    body = get(explore["base"], "api/list", size=1, validate="false")[1]
    assert body["total"] == STEPS * BATCH * N
    one = get(explore["base"], "api/trajectory", id=body["rows"][0]["trace_id"])[1]
    assert one["token_text"] is True and one["tokens"]


@pytest.fixture(scope="module")
def browser(explore: dict[str, Any]) -> Iterator[Any]:
    if not shutil.which(CHROMIUM):
        pytest.skip("needs Debian's chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--no-first-run",
                                    "--disable-background-networking"])  # fmt: skip
        yield b.new_context(viewport={"width": 1280, "height": 900})
        b.close()


def _ready(page: Any) -> None:
    page.wait_for_function("document.body.dataset.ready === location.hash", timeout=60_000)
    assert page.locator(".err").count() == 0, page.locator(".err").first.inner_text()


def test_a_trajectory_shows_words_in_every_turn(explore: dict[str, Any], browser: Any) -> None:
    base = explore["base"]
    rows = get(base, "api/list", size=50, cols="trace_id,step")[1]["rows"]
    page = browser.new_page()
    for row in rows[:3]:
        page.goto(base + f"#/trajectory?id={row['trace_id']}&step={row['step']}")
        _ready(page)
        turns = page.locator("#transcript .turn .response")
        assert turns.count() >= 1
        for text in turns.all_inner_texts():
            assert re.search(r"[A-Za-z]{2,}", text), text  # words
            assert not IDS.search(text), text  # not (44)(19324)(79)...
        assert page.locator("#token-note").count() == 0
        assert page.locator("#transcript .tok").count() > 0  # the words are the tokens


def test_without_token_text_a_turn_shows_its_response_text(
        exported: dict[str, Any], browser: Any, tmp_path: Path) -> None:  # fmt: skip
    """An export whose tokens table has ids only (made without a tokenizer): each turn shows
    the stored response text, the colours sit in a strip under it, and a note says how to
    add the tokens' text."""
    import pyarrow as pa

    from tests._explore import serving

    folder = tmp_path / "ids-only"
    shutil.copytree(exported["out"], folder)
    table = pq.read_table(folder / "tokens.parquet")
    i = table.schema.get_field_index("token")
    pq.write_table(table.set_column(i, "token", pa.nulls(len(table), pa.string())),
                   folder / "tokens.parquet")  # fmt: skip
    turns = pq.read_table(folder / "turns.parquet").to_pylist()
    with serving([("run", folder)], tmp_path / "cache", search=0) as base:
        page = browser.new_page()
        page.goto(base + f"#/trajectory?id={turns[0]['trace_id']}")
        _ready(page)
        mine = [t for t in turns if t["trace_id"] == turns[0]["trace_id"]]
        shown = page.locator("#transcript .turn .response").all_inner_texts()
        assert [s.strip() for s in shown] == [t["response_text"].strip() for t in mine]
        assert page.locator("#transcript .strip .blk").count() > 0
        assert "token " in (page.locator(".strip .blk").first.get_attribute("title") or "")
        assert "--tokenizer NAME" in page.locator("#token-note").inner_text()


def test_a_group_shows_its_n_responses_side_by_side(explore: dict[str, Any],
                                                    browser: Any) -> None:  # fmt: skip
    base = explore["base"]
    row = get(base, "api/list", size=1, validate="false", cols="trace_id,step")[1]["rows"][0]
    page = browser.new_page()
    page.goto(base + f"#/trajectory?id={row['trace_id']}&step={row['step']}")
    _ready(page)
    page.click("#group-link")
    _ready(page)
    cols = page.locator("#group .col")
    assert cols.count() == N
    assert row["trace_id"] in [cols.nth(i).get_attribute("data-id") for i in range(N)]
    for i in range(N):
        head = cols.nth(i).locator(".colhead").inner_text()
        assert "reward" in head and "advantage" in head
        text = cols.nth(i).locator(".response").inner_text()
        assert re.search(r"[A-Za-z]{2,}", text) and not IDS.search(text)
    assert page.locator("#group .col .colhead:has-text('base of the diff')").count() == 1
