"""The token-level view of the report and the tool-token rows of the ``tokens`` table: a traced
rollout whose second turn's prompt carries tool tokens, annotated with trainer values, read back
as tables, drawn as a heatmap and a coloured transcript, opened in headless Chromium."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tracer

pytest.importorskip("pyarrow")

from tracer.readers import build_report, read_tables

CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
TOOL_IDS = [7, 8, 9]  # what the tool's result adds to the second turn's prompt


class WordTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(f" w{i}" for i in ids)


def _k3(logr: np.ndarray) -> np.ndarray:
    return np.expm1(logr) - logr


def _trace(tmp: Path, logprobs: bool = True) -> dict[tuple[int, int, int], dict[str, Any]]:
    """2 steps x 3 samples x 2 rollouts: generate, tool tokens, generate; then the trainer's
    values attached with tracer.annotate in verl's whole-response layout."""
    tracer.init({"backend": "jsonl", "jsonl_path": str(tmp / "t.jsonl"), "project_name": "tv",
                 "run_salt": "ab" * 16, "raise_internal_errors": True})  # fmt: skip
    rng = np.random.default_rng(3)

    @tracer.trace_op(kind="generate")
    def generate(prompt_ids: list[int]) -> dict[str, Any]:
        n = 6 + len(prompt_ids) % 5
        lps = (-rng.exponential(0.8, n)).astype(np.float32)
        out: dict[str, Any] = {"response_ids": list(range(200, 200 + n)), "finish_reason": "stop"}
        if logprobs:
            out["logprobs"] = [float(x) for x in lps]
        return out

    expected = {}
    for step in (1, 2):
        for sample in range(3):
            for n in range(2):
                with tracer.trace_attr(step=step, sample_index=sample, rollout_n=n):
                    prompt = list(range(5 + sample + n))
                    first = generate(prompt)
                    second = generate(prompt + first["response_ids"] + TOOL_IDS)
                expected[(step, sample, n)] = {"first": first, "second": second}
    if logprobs:
        for key, e in expected.items():
            a, b = e["first"]["logprobs"], e["second"]["logprobs"]
            rollout = np.array(a + b)
            train = (rollout + rng.normal(0, 0.05, len(rollout))).round(6)
            ref = (train + rng.normal(0, 0.3, len(rollout))).round(6)
            e.update(rollout=rollout, train=np.float32(train).astype(float),
                     ref=np.float32(ref).astype(float))  # fmt: skip

            def full(x: np.ndarray, n_first: int = len(a)) -> list[float]:
                return [*x[:n_first], *([0.0] * len(TOOL_IDS)), *x[n_first:]]

            mask = [1] * len(a) + [0] * len(TOOL_IDS) + [1] * len(b)
            tracer.annotate(step=key[0], sample_index=key[1], rollout_n=key[2],
                            values={"train_logprob": full(train), "ref_logprob": full(ref),
                                    "response_mask": mask})  # fmt: skip
    assert tracer.flush(timeout_s=60)
    tracer.shutdown()
    return expected


@pytest.fixture
def run(tmp_path: Path) -> tuple[Any, dict[tuple[int, int, int], dict[str, Any]]]:
    expected = _trace(tmp_path)
    return read_tables("jsonl", path=str(tmp_path / "t.jsonl"), tokenizer=WordTokenizer()), expected


def test_tool_tokens_have_loss_mask_0_and_no_values(run: tuple[Any, dict]) -> None:
    tables, expected = run
    tokens, traj = tables.tokens, tables.trajectories.set_index("trace_id")
    for trace_id, rows in tokens.groupby("trace_id"):
        rows = rows.sort_values("position")
        t = traj.loc[trace_id]
        e = expected[(int(t.step), int(t.sample_index), int(t.rollout_n))]
        n_first, n_second = len(e["first"]["response_ids"]), len(e["second"]["response_ids"])
        # verl's layout: turn 0's tokens, the tool tokens (mask 0, still turn 0), turn 1's tokens
        assert list(rows["position"]) == list(range(n_first + len(TOOL_IDS) + n_second))
        assert list(rows["loss_mask"]) == [1] * n_first + [0] * len(TOOL_IDS) + [1] * n_second
        tool = rows[rows["loss_mask"] == 0]
        assert list(tool["token_id"]) == TOOL_IDS and set(tool["turn"]) == {0}
        assert list(tool["token"]) == [" w7", " w8", " w9"]
        value_columns = ["rollout_logprob", "train_logprob", "ref_logprob", "mismatch_kl",
                         "mismatch_kl_k1", "ref_kl", "ref_kl_k1"]  # fmt: skip
        assert tool[value_columns].isna().all().all()
        # the model tokens after the tool tokens keep their own values (not shifted by 3)
        model = rows[rows["loss_mask"] == 1]
        assert list(model["rollout_logprob"]) == list(e["rollout"])
        assert list(model["train_logprob"]) == list(e["train"])
        np.testing.assert_allclose(model["mismatch_kl"], _k3(e["train"] - e["rollout"]),
                                   atol=1e-12)  # fmt: skip
        np.testing.assert_allclose(model["ref_kl"], _k3(e["ref"] - e["train"]), atol=1e-12)


def test_report_has_heatmap_top_list_and_token_values(run: tuple[Any, dict]) -> None:
    tables, _ = run
    html = build_report(tables)
    assert '<section id="token-heatmap">' in html and '<select id="kl-metric">' in html
    for metric in ("mismatch_kl", "ref_kl", "rollout_logprob"):
        assert f'class="kl-map" data-metric="{metric}"' in html
    # one rect per response token per metric (tool tokens drawn grey)
    assert html.count("</title></rect>") == 3 * len(tables.tokens)
    worst = tables.trajectories.nlargest(1, "mismatch_kl_max").iloc[0]
    assert f'<a href="#viewer" data-trace="{worst.trace_id}">' in html
    assert '<select id="tok-metric">' in html


def test_report_without_token_values_says_so(tmp_path: Path) -> None:
    _trace(tmp_path, logprobs=False)
    tables = read_tables("jsonl", path=str(tmp_path / "t.jsonl"))
    assert len(tables.tokens) > 0 and tables.tokens["rollout_logprob"].isna().all()
    html = build_report(tables)
    assert "No per-token values in these traces" in html
    assert 'id="kl-metric"' not in html and 'id="tok-metric"' not in html


@pytest.mark.skipif(not shutil.which(CHROMIUM), reason="needs Debian's chromium")
def test_heatmap_and_coloured_transcript_render_in_chromium(
    run: tuple[Any, dict], tmp_path: Path
) -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    tables, expected = run
    path = tmp_path / "report.html"
    path.write_text(build_report(tables), encoding="utf-8")
    worst = tables.trajectories.nlargest(1, "mismatch_kl_max").iloc[0]
    e = expected[(int(worst.step), int(worst.sample_index), int(worst.rollout_n))]
    kl = _k3(e["train"] - e["rollout"])
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            viewport={"width": 1240, "height": 900},
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )  # fmt: skip
        errors: list[str] = []
        page = browser.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(path.as_uri())
        # the heatmap: one visible map per step, one cell per token, the choice switches maps
        visible = page.locator(".kl-map:visible svg.heatmap")
        assert visible.count() == 2
        assert page.locator(".kl-map:visible svg.heatmap rect").count() == len(tables.tokens)
        assert page.locator('.kl-map[data-metric="mismatch_kl"]').is_visible()
        page.select_option("#kl-metric", "ref_kl")
        assert page.locator('.kl-map[data-metric="ref_kl"]').is_visible()
        assert not page.locator('.kl-map[data-metric="mismatch_kl"]').is_visible()
        # hover text of the worst token: its exact k3 value
        hovers = page.locator('.kl-map[data-metric="mismatch_kl"] title').all_text_contents()
        assert any(f"mismatch_kl = {kl.max():.6g}" in h for h in hovers)
        # the top list links to the transcript of the trajectory with the largest KL
        page.locator('#token-top .top[data-column="mismatch_kl_max"] a').first.click()
        box = page.locator("#transcript")
        assert worst.trace_id in (box.text_content() or "")
        # the coloured transcript: one span per model token, exact values on hover
        page.select_option("#tok-metric", "mismatch_kl")
        toks = box.locator("span.tok")
        assert toks.count() == len(e["rollout"])
        titles = toks.evaluate_all("els => els.map(e => e.title)")
        darkest = int(np.argmax(kl))
        assert f"mismatch_kl: {float(f'{kl[darkest]:.6g}')}" in titles[darkest]
        logprob = float(f"{e['rollout'][darkest]:.6g}")
        assert f"rollout_logprob: {logprob}" in titles[darkest]
        colours = toks.evaluate_all("els => els.map(e => getComputedStyle(e).backgroundColor)")
        assert colours[darkest] == "rgb(128, 0, 38)"  # the top of the scale (>= 99th pct)
        assert len(set(colours)) > 3
        page.locator("#viewer").screenshot(path=str(tmp_path / "transcript.png"))
        browser.close()
    assert not errors, errors
