"""Real reward formats, judged right: TRL's ``accuracy_reward`` as the correctness signal, a
bool ``acc`` (verl 0.9.1's DAPO scorer), steps with no correct answer, one wrong answer, and
``--earned-by`` naming a part no trajectory has. verl's own reward functions are run in the
verl venv by tests/test_verl_rewards.py; the shapes here are theirs, written out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tracer
from tests._reward_runs import rows_of, trace_rewards, verdicts


def test_trl_accuracy_reward_is_the_correctness_signal(tmp_path: Path) -> None:
    pytest.importorskip("math_verify")
    from trl.rewards import accuracy_reward

    texts = ["The product is \\boxed{42}.", "I think it is 41.", "\\boxed{42}", "no idea"]
    gold = ["$42$", "$42$", "$42$", "not latex: unparseable"]
    values = accuracy_reward([[{"role": "assistant", "content": t}] for t in texts],
                             solution=gold)  # fmt: skip
    assert values[:3] == [1.0, 0.0, 1.0] and values[3] is None  # TRL skips an unparseable gold
    # tracer.trl's reward span: each reward function's value by name, and the weighted sum
    run = trace_rewards(tmp_path / "trl.jsonl", [
        (1, 0, t, {"accuracy_reward": v, "score": v or 0.0}) for t, v in zip(texts, values,
                                                                              strict=True)])
    rows = sorted(rows_of(run), key=lambda r: r["rollout_n"])
    read = [r["accuracy"] for r in rows]
    assert read[:3] == values[:3] and read[3] != read[3]  # not checked: missing (NaN in pandas)


def test_a_bool_acc_counts_as_0_or_1(tmp_path: Path) -> None:
    # verl 0.9.1 math_dapo.compute_score: {"score": 1.0 or -1.0, "acc": correct, "pred": ...}
    answers = [(1, 0, "Answer: 42", {"score": 1.0, "acc": True, "pred": "42"}),
               (1, 0, "Answer: 41", {"score": -1.0, "acc": False, "pred": "41"})]  # fmt: skip
    rows = sorted(rows_of(trace_rewards(tmp_path / "dapo.jsonl", answers)),
                  key=lambda r: r["rollout_n"])  # fmt: skip
    assert [r["accuracy"] for r in rows] == [1.0, 0.0]
    assert verdicts(rows)["summary"] == (
        "no possible reward hacking: the reward was earned where it was high")


def _hacked(steps: int, per_step: int = 8) -> list[tuple[int, int, str, dict[str, Any]]]:
    """Step 1: right answers paid 1.0; every later step: answers without a number, paid 1.0
    (a grader that passes what it cannot parse), none right."""
    out = [(1, i, f"The sum is {40 + i}.", {"score": 1.0, "acc": 1.0}) for i in range(per_step)]
    for step in range(2, steps + 1):
        out += [(step, i, "I cannot say.", {"score": 1.0, "acc": 0.0}) for i in range(per_step)]
    return out


def test_a_step_with_no_correct_answer_is_judged_by_what_others_paid(tmp_path: Path) -> None:
    found = verdicts(rows_of(trace_rewards(tmp_path / "hack.jsonl", _hacked(6))))
    assert found["flags"]["reward_accuracy_divergence"] == {s: 8 for s in range(2, 7)}
    assert found["summary"].startswith("possible reward hacking since step ")
    assert found["unearned"][6] == 1.0


def test_without_any_correct_answer_nothing_is_judged(tmp_path: Path) -> None:
    # every answer wrong, all paid the same small format reward: not hacking, not judged
    answers = [(s, i, "#### 3", {"score": 0.1, "acc": 0.1}) for s in (1, 2) for i in range(8)]
    found = verdicts(rows_of(trace_rewards(tmp_path / "wrong.jsonl", answers)))
    assert "reward_accuracy_divergence" not in found["flags"]
    assert found["notes"] == ["no correct answer in step 1; not judged",
                              "no correct answer in step 2; not judged"]  # fmt: skip
    assert found["summary"] == ("no possible reward hacking where judged; no correct answer in "
                                "steps 1-2; not judged")  # fmt: skip


def test_one_wrong_answer_paid_among_right_ones_is_no_flag(tmp_path: Path) -> None:
    answers = [(1, i, f"#### {42}", {"score": 1.0, "acc": 1.0}) for i in range(15)]
    answers.append((1, 15, "#### 41", {"score": 1.0, "acc": 0.0}))  # one grader slip
    found = verdicts(rows_of(trace_rewards(tmp_path / "slip.jsonl", answers)))
    assert "reward_accuracy_divergence" not in found["flags"]


def test_the_live_share_stays_up_once_the_steps_with_correct_answers_are_let_go(
    tmp_path: Path,
) -> None:
    # live_steps 3: step 1 (the only one with correct answers) is let go before step 6
    tracer.init(backend="jsonl", jsonl_path=str(tmp_path / "live.jsonl"), live_steps=3,
                max_samples_per_step_per_worker=100, raise_internal_errors=True)  # fmt: skip

    @tracer.trace_op(kind="reward")
    def compute_score(solution_str: str, output: dict[str, Any]) -> dict[str, Any]:
        return output

    for step, sample, text, output in _hacked(6):
        with tracer.trace_attr(step=step, sample_index=sample, rollout_n=0,
                               reward=output["score"]):  # fmt: skip
            compute_score(text, output)
    assert tracer.step_metrics(6)["patterns/unearned_reward_share"] == 1.0
    tracer.shutdown()


@pytest.mark.parametrize("live_steps", [3, 16])
def test_step_metrics_judge_a_step_with_no_correct_answer_as_the_whole_partial_does(
    tmp_path: Path, live_steps: int
) -> None:
    # step_metrics groups each earlier step once; a step with no correct answer is judged
    # against what the steps looked back over paid, which moves: the same verdicts as the
    # whole partial's, step after step, with steps 1, 2 and 7 right and 3-6 and 8 hacked
    tracer.init(backend="jsonl", jsonl_path=str(tmp_path / "live.jsonl"), live_steps=live_steps,
                max_samples_per_step_per_worker=100, raise_internal_errors=True)  # fmt: skip

    @tracer.trace_op(kind="reward")
    def compute_score(solution_str: str, output: dict[str, Any]) -> dict[str, Any]:
        return output

    right = {1: 1.0, 2: 0.8, 7: 0.5}
    for step in range(1, 9):
        for i in range(8):
            score = right.get(step, 0.9 if i % 2 else 0.0)
            output = {"score": score, "acc": 1.0 if step in right else 0.0}
            with tracer.trace_attr(step=step, sample_index=i, rollout_n=0, reward=score):
                compute_score("x", output)
        live = tracer.step_metrics(step)
        whole = tracer.live.metrics(tracer.live.partial(step))
        patterns = {k: v for k, v in whole.items() if k.startswith("patterns/")}
        assert {k: v for k, v in live.items() if k.startswith("patterns/")} == pytest.approx(
            patterns), step
    tracer.shutdown()


@pytest.fixture
def exported(tmp_path: Path) -> dict[str, str]:
    from rollout.cli import main

    jsonl = trace_rewards(tmp_path / "run.jsonl", _hacked(3))
    out = str(tmp_path / "export")
    assert main(["export", "--from", "jsonl", "--path", jsonl, "--out", out, "--no-progress"]) == 0
    return {"jsonl": jsonl, "parquet": out}


@pytest.mark.parametrize("command", ["export", "report", "flags", "explore"])
@pytest.mark.parametrize("source", ["jsonl", "parquet"])
def test_earned_by_a_part_no_trajectory_has_is_one_line_and_exit_2(
    command: str, source: str, exported: dict[str, str], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from rollout.cli import main

    if command == "export" and source == "parquet":
        pytest.skip("export reads a store, not an export")
    if command == "explore":
        pytest.importorskip("duckdb")
    out = {"export": ["--out", str(tmp_path / "again"), "--no-progress"],
           "report": ["--out", str(tmp_path / "r.html")], "flags": [],
           "explore": ["--no-search", "--port", "0", "--cache-dir", str(tmp_path / "cache"),
                       "--no-progress"]}[command]  # fmt: skip
    capsys.readouterr()
    args = [command, "--from", source, "--path", exported[source], "--earned-by", "acc_typo"]
    assert main(args + out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"rollout-tracer {command}: error: --earned-by acc_typo: no trajectory has "
                   "a reward part 'acc_typo'; the parts that exist: acc, accuracy, score"]
    assert not (tmp_path / "again").exists() and not (tmp_path / "r.html").exists()
