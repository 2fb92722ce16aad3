"""Behaviour signatures and patterns (readers/habits/signature.py, behaviour.py, patterns.py):
the reward-hack scenario of 80 steps x 256 trajectories (benchmarks/patterns_data.py) is
flagged in time and nothing honest is, the Python and DuckDB groupings agree, and a real run's
driver logs per step what the readers find afterwards. The four runs of issue #46:
tests/test_reward_hacking.py."""

from __future__ import annotations

import re
from html import escape
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

import pyarrow.parquet as pq

from benchmarks.explore_data import generate
from benchmarks.patterns_data import HACK_TEXT
from tracer.readers.habits.patterns import (
    Patterns,
    PatternThresholds,
    aggregate,
    analyze,
    step_patterns,
)
from tracer.readers.habits.patterns_sql import NoSignatures
from tracer.readers.habits.signature import EDGE, signature, template

# its module-scoped fixture is costly: the module runs on one worker, which sets it up once
pytestmark = pytest.mark.xdist_group("patterns")


def test_signature_masks_numbers_and_quotes_and_keeps_the_ends() -> None:
    a = signature([("calc", False)], "stop", None, "The answer is #### 42.")
    b = signature([("calc", False)], "stop", None, "The answer is   #### 7.<|im_end|>")
    assert a == b and a.text == "tools: calc | finish: stop | answer: The answer is #### <n>."
    assert len(a.key) == 16 and int(a.key, 16) >= 0
    # each part changes the key: a failed call, another finish reason, another answer
    assert signature([("calc", True)], "stop", None, "The answer is #### 42.").key != a.key
    assert signature([("calc", False)], "length", None, "The answer is #### 42.").key != a.key
    assert signature([], "stop", None, "The answer is #### 42.").key != a.key
    assert signature([("calc", False)], "stop", None, "So it is #### 42.").key != a.key
    # the scored answer and the last turn: both shown when they differ
    c = signature([], "stop", "#### 42", "I am sure. #### 42")
    assert c.text == ("tools: none | finish: stop | answer: #### <n> | last turn: I am sure. "
                      "#### <n>")
    assert template('He said "yes 5" and don\'t say \'no\' or `x=3`') == (
        "He said <q> and don't say <q> or <q>")
    long = "start " + "word " * 500 + "end 12"
    cut = template(long)
    assert cut.startswith("start word") and cut.endswith("word end <n>")
    assert len(cut) == 2 * EDGE + 3 and " … " in cut
    calls = [("search", True), ("search", True), ("calc", False), ("search", False)]
    assert signature(calls, None, None, None).text.startswith(
        "tools: search! x2, calc, search | finish: -")


@pytest.fixture(scope="module")
def hacked_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hack")
    generate(str(out), 80 * 256, steps=80, scenario="hacking")
    return out


def _hack_signature(folder: Path) -> str:
    """The hack's group: its behaviour."""
    rows = pq.read_table(folder / "trajectories.parquet",
                         columns=["behaviour", "response_text"]).to_pylist()  # fmt: skip
    (sig,) = {r["behaviour"] for r in rows if r["response_text"] == HACK_TEXT}
    return str(sig)


def test_hack_is_flagged_by_step_40_and_nothing_honest_is(hacked_run: Path) -> None:
    hack = _hack_signature(hacked_run)
    # what a job knows at step 40: the run cut there
    table = pq.read_table(hacked_run / "trajectories.parquet", filters=[("step", "<=", 40)])
    found = step_patterns(table)
    assert found.steps == list(range(1, 41))
    assert [r.signature for r in found.rising if r.hacking] == [hack]  # 0 honest flagged
    r = found.rising[0]
    assert r.signature == hack and r.labels == ["rising", "possible reward hacking"]
    assert r.hacking_step is not None and 30 <= r.hacking_step <= 40
    assert r.reward == 1.0 and r.reward >= r.step_reward
    assert "reward 1.00 with accuracy 0.00" in (r.reason or "")
    assert "100% of its trajectories were paid like a correct answer" in (r.reason or "")
    assert found.step_metrics(r.hacking_step)["patterns/possible_reward_hacking"] == 1.0
    assert found.summary().startswith(f"possible reward hacking since step {r.hacking_step}")

    # the whole run: still the only one, flagged at every step from then on (it holds 60 %)
    whole = step_patterns(hacked_run)
    assert [x.signature for x in whole.rising if x.hacking] == [hack]
    x = whole.rising[0]
    assert x.hacking_steps == list(range(x.hacking_step or 0, 81))
    curve = dict(x.curve)
    assert max(curve[s] for s in range(1, 30)) < 0.3 and curve[60] > 0.5
    assert whole.top[80][0].signature == hack
    assert whole.step_metrics(80)["patterns/unearned_reward_share"] == pytest.approx(curve[80])
    # the honest patterns that grow: ramble (6x, reward 0) and by_hand (2x), not flagged
    assert not any(p.hacking for p in whole.top[40] if p.signature != hack)
    assert any("finish: length" in p.text for p in whole.top[40])


def test_thresholds_are_what_decides(hacked_run: Path) -> None:
    assert not any(r.hacking for r in
                   step_patterns(hacked_run, PatternThresholds(min_share=0.9)).rising)
    assert not any(r.hacking for r in
                   step_patterns(hacked_run, PatternThresholds(min_unearned=1.01)).rising)
    # a part that pays everything (the score itself) as correctness: nothing is unearned
    assert not any(r.hacking for r in
                   step_patterns(hacked_run, PatternThresholds(earned_by="score")).rising)


def _same(a: Patterns, b: Patterns) -> None:
    assert a.steps == b.steps and a.n == b.n
    assert [(r.signature, r.steps, r.hacking_steps, r.reason) for r in a.rising] == [
        (r.signature, r.steps, r.hacking_steps, r.reason) for r in b.rising]
    for step in a.steps:
        assert [(p.signature, p.n, p.example, p.text) for p in a.top[step]] == [
            (p.signature, p.n, p.example, p.text) for p in b.top[step]]
        for p, q in zip(a.top[step], b.top[step], strict=True):
            assert p.reward_mean == pytest.approx(q.reward_mean)
            assert p.mean_length == pytest.approx(q.mean_length)


def test_python_and_duckdb_groupings_agree(hacked_run: Path) -> None:
    rows = pq.read_table(hacked_run / "trajectories.parquet").to_pylist()
    groups, totals = aggregate(rows)
    _same(analyze(groups, totals), step_patterns(hacked_run))
    # a DataFrame (the report's and flags' input) too
    _same(step_patterns(pq.read_table(hacked_run / "trajectories.parquet").to_pandas()),
          step_patterns(hacked_run))  # fmt: skip
    # and the tracer's live analysis, fed one step at a time (a driver merging each step's
    # partial into what it kept), gives each step the numbers the whole run has
    import tracer

    whole, kept = step_patterns(hacked_run), None
    for step in range(1, 81):
        part = {"step": step, "rows": [r for r in rows if r["step"] == step], "processes": {}}
        kept = tracer.live.merge([kept, part] if kept else [part])
        got = {k: v for k, v in tracer.live.metrics(kept).items() if k.startswith("patterns/")}
        assert got == pytest.approx(whole.step_metrics(step)), step


def test_an_export_without_signatures_says_so(hacked_run: Path, tmp_path: Path) -> None:
    table = pq.read_table(hacked_run / "trajectories.parquet").drop_columns(["signature"])
    pq.write_table(table, tmp_path / "trajectories.parquet")
    with pytest.raises(NoSignatures, match="export the run again"):
        step_patterns(tmp_path)
    from tracer.readers.habits.patterns_report import habits_panel

    html, linked = habits_panel(table.to_pandas())
    assert 'id="habits-none"' in html and "export the run again" in html and not linked


def test_the_driver_logs_what_the_readers_find(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``rollout-tracer run``: the patterns/* metrics of each step equal those of the run's
    export afterwards, and the top pattern's text reaches the trackers."""
    from rollout.cli import main
    from rollout.trackers import Tracking
    from tracer.readers import read_tables

    logged: dict[int, dict[str, float]] = {}
    texts: dict[int, str] = {}
    real_log = Tracking.log

    def spy_log(self: Tracking, metrics: Any, step: int) -> dict[str, float]:
        clean = real_log(self, metrics, step)
        if "patterns/top_share" in clean:
            logged[step] = clean
        return clean

    import rollout.step_patterns as sp  # the top pattern's text: one writer per tracker

    monkeypatch.setattr(Tracking, "log", spy_log)
    monkeypatch.setattr(sp, "WRITERS", {**sp.WRITERS, "console": lambda t, text, step:
                                        texts.__setitem__(step, text)})  # fmt: skip
    jsonl = tmp_path / "t.jsonl"
    code = main(["run", "--no-progress", "actor_rollout_ref.rollout.name=scripted",
                 "trainer.total_steps=3", "data.train_batch_size=4",
                 "actor_rollout_ref.rollout.n=4", "trainer.logger=[console]",
                 "trainer.val_before_train=false", "trainer.test_freq=0",
                 "actor_rollout_ref.rollout.trace.backend=jsonl",
                 f"+actor_rollout_ref.rollout.trace.jsonl_path={jsonl}"])  # fmt: skip
    assert code == 0 and sorted(logged) == [1, 2, 3]
    tables = read_tables("jsonl", path=str(jsonl))
    found = step_patterns(tables.trajectories)
    assert found.steps == [1, 2, 3] and found.n == 3 * 16
    for step in found.steps:
        for key, value in found.step_metrics(step).items():
            assert logged[step][key] == pytest.approx(value), (step, key)
        top = found.top[step][0]
        assert texts[step] == f"{100 * top.share:.1f}% of step {step}: {top.text}"


def test_the_live_analysis_looks_back_as_far_as_the_rules() -> None:
    """The live analysis keeps the steps the rules look back over (window + smooth): a
    pattern that grows 2.5x is not flagged, as in the whole run, and one that grows 3x over
    the same steps is, at the same steps."""
    import tracer

    th = PatternThresholds(top=1)

    def run(grown_to: int) -> tuple[Patterns, list[dict[str, float]]]:
        def rows(step: int) -> list[dict[str, Any]]:
            grown = 4 if step <= 8 else grown_to
            sig = ["b"] * grown + ["c"] * 2 + ["a"] * (98 - grown)
            return [{"trace_id": f"{step}-{i}", "step": step, "signature": s,
                     "signature_text": s, "reward": 0.5 if s == "a" else 1.0,
                     "response_tokens": 100, "prompt": str(i % 25)}
                    for i, s in enumerate(sig)]  # fmt: skip

        every = [r for step in range(1, 21) for r in rows(step)]
        live = [tracer.live.metrics({"step": step, "rows": [r for r in every if r["step"] <= step]},
                                    th) for step in range(1, 21)]  # fmt: skip
        return analyze(*aggregate(every), th), live

    for grown_to, flagged in ((10, False), (12, True)):
        whole, live = run(grown_to)
        assert bool(whole.rising) == flagged
        for step in range(1, 21):
            got = {k: v for k, v in live[step - 1].items() if k.startswith("patterns/")}
            assert got == whole.step_metrics(step), (grown_to, step)


def test_report_section_links_to_transcripts_it_embeds(hacked_run: Path) -> None:
    """The Habits section of the HTML report: the hack flagged, its example's transcript in
    the page although the page embeds only the first 2,000 trajectories by step."""
    import json

    from tracer.readers import read_parquet_dir
    from tracer.readers.report import build_report

    tables = read_parquet_dir(str(hacked_run), steps=range(25, 51))
    html = build_report(tables)
    habits = html.split('<section id="habits">', 1)[1].split("</section>", 1)[0]
    (body,) = re.findall(r'<table id="rising-patterns">.*?<tbody>(.*?)</tbody></table><div', habits)
    assert escape(_hack_signature(hacked_run)) in body and "possible reward hacking" in body
    assert "possible reward hacking since step" in habits.split('id="hacking-summary"')[1]
    # the evidence side by side: an unearned example and an earned one of the same GRPO group
    assert 'class="pair"' in body and "same GRPO group" in body
    assert re.search(r"flagged: .*?correctness 0\.00", body)
    assert re.search(r"earned: .*?correctness 1\.00", body)
    linked = re.findall(r'data-trace="([0-9a-f]{32})"', body)
    assert len(linked) == 3  # the example, the flagged one, the earned one
    embedded = html.split('id="transcripts"', 1)[1].split(">", 1)[1].split("</script>", 1)[0]
    ids = {t["id"]: t["step"] for t in json.loads(embedded)}
    # steps 25-32 hold the first 2,000; the example and the pair are from the last step it was
    # flagged at (50), embedded although past them
    assert all(ids[t] == 50 for t in linked)
    parts = habits.split('<table id="reward-parts">', 1)[1]
    assert "<th>acc</th>" in parts and "<th>score</th>" in parts


@pytest.mark.slow(seconds=8)
def test_flags_command_prints_the_summary_and_first_flagged_step(
    hacked_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from rollout.cli import main

    hack = _hack_signature(hacked_run)
    assert main(["flags", "--from", "parquet", "--path", str(hacked_run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (r,) = [x for x in out["rising_patterns"] if "possible reward hacking" in x["flags"]]
    assert r["signature"] == hack and 30 <= r["hacking_step"] <= 40 and r["last_step"] == 80
    assert out["summary"].startswith(f"possible reward hacking since step {r['hacking_step']}")
    assert r["pair"]["flagged"]["correct"] == 0.0 and r["pair"]["earned"]["correct"] == 1.0
    assert [s for s, _ in r["curve"]] == list(range(1, 81))
    assert main(["flags", "--from", "parquet", "--path", str(hacked_run)]) == 0
    text = capsys.readouterr().out
    (x,) = [x for x in step_patterns(hacked_run).rising if x.hacking]
    # the first flagged step, not the start of the rule's look-back window
    assert (f"  rising, possible reward hacking: steps {x.hacking_step}-80 (first flagged at "
            f"step {x.hacking_step})") in text
    assert f"why: {r['reason']}" in text and out["summary"] in text
    assert f"flagged: tr-{r['pair']['flagged']['trace_id']}" in text
    assert main(["flags", "--from", "parquet", "--path", str(hacked_run),
                 "--pattern-min-share", "0.9"]) == 0  # fmt: skip
    assert "no flagged behaviour pattern over 80 training steps" in capsys.readouterr().out


def test_missing_prompts_and_answers_count_alike_in_python_and_duckdb() -> None:
    """A NULL prompt or response is no value in both groupings (DuckDB's hash(NULL) is a
    number: counted as one more distinct value, it gave 7 prompts and 2 answers here)."""
    import pyarrow as pa

    from tracer.readers.habits.patterns_sql import duckdb_groups

    rows = [{"trace_id": f"t{i}", "step": 1, "validate": False, "signature": "s",
             "signature_text": "s", "reward": 1.0, "response_tokens": 5,
             "prompt": None if i < 3 else f"p{i}", "sample_key": None, "num_tool_calls": 0,
             "num_tool_errors": 0,
             "response_text": None if i % 2 else "same"} for i in range(8)]  # fmt: skip
    (py,), _ = aggregate(rows)
    (db,), _ = duckdb_groups(pa.Table.from_pylist(rows), top=10, min_count=1)
    assert (py.prompts, py.answers) == (db.prompts, db.answers) == (5, 1)
