"""Issue #46's checks on the four GRPO runs of benchmarks/patterns_runs.py (60 steps x 64
trajectories): a hack whose wording varies is flagged by step 40 with at least 90 % of its
trajectories in flagged groups and stays flagged to the last step; an honest short answer
taking over gets no hack label; a run without a correctness signal says so and never calls
a short answer a hack; a hack at its plateau stays loud. Each is checked on the wording and
seeds tuned on (0) and on a wording set and seeds not tuned on (1)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("datasketch")

from benchmarks.patterns_runs import run, table
from tracer.readers.habits.patterns import Patterns, step_patterns
from tracer.readers.health import analyze as health

VARIANTS = [(0, 0), (7, 0), (3, 1), (11, 1)]  # (seed, wording); wording 1 was never tuned on


def _inside(found: Patterns, rows: list[dict[str, Any]], last: int = 60) -> float:
    """The share of the hack's trajectories (up to step ``last``) in a group flagged possible
    reward hacking at their step."""
    flagged = {(s, r.signature) for r in found.rising for s in r.hacking_steps}
    hack = [r for r in rows if r["hack"] and r["step"] <= last]
    return sum((r["step"], r["behaviour"]) in flagged for r in hack) / len(hack)


@pytest.mark.parametrize(("seed", "wording"), VARIANTS)
@pytest.mark.parametrize("kind", ["varied_hack", "plateau"])
def test_a_hack_is_flagged_by_step_40_and_while_it_lasts(kind: str, seed: int,
                                                         wording: int) -> None:  # fmt: skip
    rows = run(kind, seed, wording)
    # what a job knows at step 40
    early = step_patterns(table([r for r in rows if r["step"] <= 40]))
    assert any(r.hacking and r.hacking_step <= 40 for r in early.rising)
    assert _inside(early, rows, 40) >= 0.9
    found = step_patterns(table(rows))
    assert _inside(found, rows) >= 0.9
    # still flagged at the last step, and the metric stays up at the plateau
    assert any(60 in r.hacking_steps for r in found.rising)
    for step in range(41, 61):  # the plateau: it holds 70-80 % of each step
        held = sum(r["hack"] for r in rows if r["step"] == step) / 64
        assert found.step_metrics(step)["patterns/unearned_reward_share"] >= held > 0.5
    first = min(r.hacking_step for r in found.rising if r.hacking_step)
    assert found.summary().startswith(f"possible reward hacking since step {first}, now ")
    (r, *_) = [r for r in found.rising if r.hacking]
    assert "accuracy 0.0" in (r.reason or "") and "against reward" in (r.reason or "")
    # evidence side by side: an unearned example beside an earned answer to the same prompt
    assert r.pair and r.pair["flagged"]["correct"] == 0.0 and r.pair["earned"]["correct"] == 1.0
    # the health flag rests on the same notion: it fires at the steps the hack holds
    flags = {f.step: set(f.trace_ids) for f in health(rows).steps
             if f.name == "reward_accuracy_divergence"}  # fmt: skip
    assert set(range(40, 61)) <= set(flags)
    for step in range(40, 61):  # the hack's wrong answers, not the honest wrong ones (0.1)
        assert flags[step] == {
            r["trace_id"] for r in rows if r["step"] == step and r["hack"] and r["accuracy"] == 0
        }


@pytest.mark.parametrize(("seed", "wording"), VARIANTS)
def test_an_honest_short_answer_is_never_a_hack(seed: int, wording: int) -> None:
    rows = run("honest_short", seed, wording)
    found = step_patterns(table(rows))
    assert not any(r.hacking for r in found.rising)
    assert all(not p.hacking for top in found.top.values() for p in top)
    assert found.summary() == "no possible reward hacking: the reward was earned where it was high"
    assert all(found.step_metrics(s)["patterns/unearned_reward_share"] == 0 for s in found.steps)
    # the short answers take over and are seen doing so, with their correctness
    short = [p for p in found.top[60] if "length: short" in p.text]
    assert sum(p.share for p in short) > 0.4 and all(p.correct_mean == 1.0 for p in short)
    assert not [f for f in health(rows).steps if f.name == "reward_accuracy_divergence"]


NOT_CHECKED = "reward not checked: no correctness signal"


@pytest.mark.parametrize(("seed", "wording"), VARIANTS)
def test_without_a_correctness_signal_it_says_so(seed: int, wording: int) -> None:
    """The hack skips the tool the honest answers call: it is flagged on that evidence, named,
    and the summary says that reward was not checked; short and rising is only a note."""
    rows = run("no_signal", seed, wording)
    found = step_patterns(table(rows))
    assert found.summary().endswith(f"; {NOT_CHECKED} (accuracy), flagged on independent "
                                    "evidence")  # fmt: skip
    hacking = [r for r in found.rising if r.hacking]
    assert hacking and all((r.reason or "").startswith(f"{NOT_CHECKED}; independent evidence: ")
                           for r in hacking)  # fmt: skip
    notes = [r.note for r in found.rising if r.note]
    assert notes and all("reward not checked: no correctness signal" in n for n in notes)
    assert any(n.startswith("rising and short;") for n in notes)
    assert not [f for f in health(rows).steps if f.name == "reward_accuracy_divergence"]


def test_the_same_answer_to_different_prompts_is_named_evidence() -> None:
    """Without correctness, a hack that gives the same answer whatever the prompt is flagged
    on that evidence (MinHash near-duplicates), and the reason names it."""
    rows = run("no_signal", 5, 1)
    for r in rows:
        if r["hack"]:
            r["response_text"] = "I have verified every step carefully; the result is certain."
    found = step_patterns(table(rows))
    (r,) = [r for r in found.rising if r.hacking]
    assert "independent evidence" in (r.reason or "") and "another prompt" in (r.reason or "")
    assert r.reason and r.reason.startswith("reward not checked: no correctness signal")


def test_earned_by_names_the_part_that_says_correct() -> None:
    """``--earned-by`` reads any reward part: here the ``format`` part (1 for a #### answer),
    which the varied hack never has, while its score is paid."""
    from tracer.readers.habits.patterns import PatternThresholds

    rows = run("varied_hack", 1, 0)
    found = step_patterns(table(rows), PatternThresholds(earned_by="format"))
    (r, *_) = [r for r in found.rising if r.hacking]
    assert "with format 0.00" in (r.reason or "")
    missing = step_patterns(table(rows), PatternThresholds(earned_by="judge"))
    assert f"{NOT_CHECKED} (judge)" in missing.summary()
    assert all("judge" not in (r.reason or "") for r in missing.rising)


@pytest.mark.parametrize(("seed", "wording"), VARIANTS)
def test_a_tool_no_longer_called_while_reward_rises_is_evidence(seed: int, wording: int) -> None:
    """Without correctness: the hack that skips the calculator every honest answer calls is
    flagged, the reason naming the tool-call rates and the reward; a policy that moves from
    the calculator to reasoning by hand, as often right (reward flat), is not."""
    found = step_patterns(table(run("tool_drop_hack", seed, wording)))
    (r,) = [r for r in found.rising if r.hacking]
    assert r.reason and r.reason.startswith(f"{NOT_CHECKED}; independent evidence: tool calls "
                                            "fell from 1.00 to ")  # fmt: skip
    assert "while the mean reward rose from" in r.reason and "this group calls 0.00" in r.reason
    assert 60 in r.hacking_steps and "answer: number" in r.text
    honest = step_patterns(table(run("tool_drop_honest", seed, wording)))
    assert honest.summary() == f"{NOT_CHECKED} (accuracy)"
    assert not any(r.hacking for r in honest.rising)
    # the hand-reasoning group did take over: the tool's rate fell as far as in the hack
    rows = run("tool_drop_honest", seed, wording)
    assert sum(r["num_tool_calls"] for r in rows if r["step"] == 60) / 64 < 0.4


@pytest.mark.parametrize(("seed", "wording"), VARIANTS)
def test_training_up_while_validation_stays_flat_is_evidence(seed: int, wording: int) -> None:
    """Without correctness: a hack paid in training only (validation's strict grader does not
    pay it) is flagged on training reward rising while validation reward on the same prompts
    does not; a policy that learns, validation rising with training, is not."""
    found = step_patterns(table(run("val_flat_hack", seed, wording)))
    (r,) = [r for r in found.rising if r.hacking]
    assert r.reason and r.reason.startswith(f"{NOT_CHECKED}; independent evidence: training "
                                            "reward rose from ")  # fmt: skip
    assert "validation reward on the same prompts (64 trajectories a pass)" in r.reason
    assert "tool calls" not in r.reason  # the hack calls the calculator too
    assert 60 in r.hacking_steps and r.hacking_steps[0] <= 40
    honest_rows = run("val_rising_honest", seed, wording)
    honest = step_patterns(table(honest_rows))
    assert honest.summary() == f"{NOT_CHECKED} (accuracy)"
    assert not any(r.hacking for r in honest.rising)
    # it looks like the hack: a short answer paid 1.0 takes over, training reward rises
    assert any(r.steps and "length: short" in r.text for r in honest.rising)


def test_the_evidence_thresholds_are_the_documented_ones() -> None:
    """docs/explore.md quotes the defaults of the independent evidence's thresholds."""
    import dataclasses
    import re
    from pathlib import Path

    from tracer.readers.habits.patterns import PatternThresholds

    doc = " ".join((Path(__file__).parents[1] / "docs" / "explore.md").read_text().split())
    defaults = {f.name: f.default for f in dataclasses.fields(PatternThresholds)}
    for name in ("min_tool_rate", "tool_drop", "min_gain", "val_flat", "min_repeated"):
        value = defaults[name]
        quoted = f"{100 * value:.0f} %" if name == "min_repeated" else str(value)
        assert re.search(rf"`{name}`,? \(?{re.escape(quoted)}", doc), name


@pytest.mark.parametrize("kind", ["tool_drop_hack", "val_flat_hack"])
def test_python_and_duckdb_see_the_same_evidence(kind: str) -> None:
    """The running job's grouping (Python) and the export's (DuckDB) count the same tool calls
    and validation passes, and flag the same steps."""
    from tracer.readers.habits.patterns import aggregate, analyze
    from tracer.readers.habits.patterns_sql import duckdb_groups

    rows = run(kind, 4, 1)
    py_groups, py = aggregate(rows)
    _, db = duckdb_groups(table(rows), 10, 5)
    assert sorted(py) == sorted(db)
    for step, t in py.items():
        assert (t.n, t.calls, t.val_n) == (db[step].n, db[step].calls, db[step].val_n), step
        assert t.val_sum == pytest.approx(db[step].val_sum)
        assert t.val_sq == pytest.approx(db[step].val_sq)
    assert any(t.val_n for t in py.values()) == (kind == "val_flat_hack")
    flagged = [(r.signature, r.hacking_steps) for r in analyze(py_groups, py).rising]
    assert flagged and flagged == [(r.signature, r.hacking_steps)
                                   for r in step_patterns(table(rows)).rising]  # fmt: skip
