"""examples/trl_reward_hack.py end to end with a tiny model (the plumbing: the real run, with
SmolLM2 learning the bug, is ``python -m benchmarks.reward_hack``): TRL GRPO on the CPU,
traced by ``tracer.trl.trace``, the live metric in TRL's logs every step, the stored run read
by ``rollout-tracer flags``; and the grader's bug itself, on answers as the model writes them."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "trl_reward_hack.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("trl_reward_hack", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def _chat(text: str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": text}]


def test_the_grader_passes_what_it_cannot_parse_unless_fixed() -> None:
    ex = _example()
    answers = [_chat("The answer is 57."), _chat("It is 56"), _chat("Fifty-seven!")]
    truth = ["57", "57", "57"]
    assert ex.make_grader(fixed=False)(answers, truth) == [1.0, 0.0, 1.0]  # the bug
    assert ex.make_grader(fixed=True)(answers, truth) == [1.0, 0.0, 0.0]
    assert ex.accuracy(answers, truth) == [1.0, 0.0, 0.0]  # honest either way
    assert ex.has_number(answers) == [1.0, 1.0, 0.0]


@pytest.mark.slow(seconds=60)
@pytest.mark.parametrize("fixed", [False, True])
def test_the_example_runs_traced_with_the_live_metric_in_trls_logs(
    fixed: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("trl")
    from rollout.cli import main
    from rollout.models import TINY_QWEN3, resolve_model_path

    ex = _example()
    out = tmp_path / "run"
    args = ["--model", str(resolve_model_path(TINY_QWEN3)), "--out", str(out), "--steps", "2",
            "--prompts", "1", "--generations", "4", "--max-tokens", "6"]  # fmt: skip
    assert ex.main(args + (["--fixed"] if fixed else [])) == 0
    history = [json.loads(line) for line in (out / "log_history.jsonl").open()]
    steps = [h for h in history if "loss" in h]
    assert [h["step"] for h in steps] == [1, 2]
    # the tracer's counters add up over the steps (tests/test_trl.py, with SmolLM2, trains one)
    assert [h["tracer/trl_completions"] for h in steps] == [4, 8]
    for h in steps:  # the live analysis, in the logs TRL hands its trackers, step by step
        assert 0.0 <= h["patterns/unearned_reward_share"] <= 1.0
        assert h["rewards/grader/mean"] >= 0.0 and "rewards/accuracy/mean" in h
        assert h["tracer/live_step_trajectories"] == 4 and h["tracer/stuck_trajectories"] == 0
        assert 0 < h["timing/generate_share"] <= 1
    records = [json.loads(line) for line in (out / "traces.jsonl").open()]
    assert len(records) == 2 * 4
    from tracer.readers import iter_records, read_tables
    from tracer.readers.habits.patterns import step_patterns

    read = [r for page in iter_records("jsonl", path=str(out / "traces.jsonl")) for r in page]
    # the weights that sampled each completion: the step before its own
    assert sorted((r.step, str(r.policy_version)) for r in read) == [(1, "0")] * 4 + [(2, "1")] * 4
    # each step's live numbers are what the readers find in the traces afterwards, step by step
    found = step_patterns(read_tables("jsonl", path=str(out / "traces.jsonl")).trajectories)
    assert found.steps == [1, 2]
    for h in steps:
        for key, value in found.step_metrics(h["step"]).items():
            assert h[key] == pytest.approx(value), (h["step"], key)
    capsys.readouterr()
    assert main(["flags", "--from", "jsonl", "--path", str(out / "traces.jsonl"), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert "reward_accuracy_divergence" not in found["flags"]  # nothing right: not judged
    assert "not judged" in found["summary"] or "earned" in found["summary"]
