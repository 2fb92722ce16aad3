"""verl 0.9.1's own reward functions, as shipped, judged right by the readers.

Runs in the verl venv (``scripts/setup_verl_cpu.sh``; CI's verl step)::

    .venv-verl/bin/python -m pytest -q tests/test_verl_rewards.py -m verl_installed -n 0

Each answer goes through verl's own ``NaiveRewardManager.run_single`` (the reward loop's
default manager: it decodes the response ids with the tokenizer and calls the reward function)
with ``default_compute_score`` and its data sources for GSM8K, DAPO (``math_dapo``: ``acc``
is a Python bool), PRIME's math grader (``numina_*``) and MATH, and with GSM8K's own
``format_score`` (a custom reward function as users write one). What the manager returns is
what the traced reward op returns (``{"score": reward_score, **reward_extra_info}``), so the
tracer, the export's rows and the rules read verl's real outputs.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verl", reason="verl is installed by scripts/setup_verl_cpu.sh only")

from tests._reward_runs import rows_of, trace_rewards, verdicts

pytestmark = [pytest.mark.verl_installed]

# (data source, answer, ground truth, right?)
ANSWERS = [
    ("openai/gsm8k", "6 * 7 = 42.\n#### 42", "42", True),
    ("openai/gsm8k", "6 * 7 = 41.\n#### 41", "42", False),
    ("math_dapo", "6 times 7 is 42.\nAnswer: 42", "42", True),
    ("math_dapo", "6 times 7 is 41.\nAnswer: 41", "42", False),
    ("numina_synthetic_math", "So the product is \\boxed{42}.", "42", True),
    ("numina_synthetic_math", "So the product is \\boxed{41}.", "42", False),
    ("lighteval/MATH", "So the product is \\boxed{42}.", "42", True),
    ("lighteval/MATH", "So the product is \\boxed{41}.", "42", False),
]


def _manager(tokenizer: Any, compute_score: Any = None) -> Any:
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

    return NaiveRewardManager(config=None, tokenizer=tokenizer, compute_score=compute_score)


def _score(manager: Any, tokenizer: Any, source: str, text: str, truth: str) -> dict[str, Any]:
    """verl's reward manager on one answer: what its reward step returns, as traced."""
    import numpy as np
    import torch
    from verl import DataProto

    ids = tokenizer.encode(text, add_special_tokens=False)
    mask = torch.ones(1, len(ids), dtype=torch.long)
    data = DataProto.from_dict(
        tensors={"responses": torch.tensor([ids]), "attention_mask": mask},
        non_tensors={"data_source": np.array([source], dtype=object),
                     "reward_model": np.array([{"ground_truth": truth}], dtype=object),
                     "extra_info": np.array([{}], dtype=object)},
    )  # fmt: skip
    # the manager runs the reward function in an executor of the loop it was made with
    out = manager.loop.run_until_complete(manager.run_single(data))
    return {"score": out["reward_score"], **out["reward_extra_info"]}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from rollout.models import SMOLLM2, load_tokenizer

    return load_tokenizer(SMOLLM2)


def test_each_reward_function_is_read_as_verl_returns_it(tokenizer: Any, tmp_path: Path) -> None:
    manager = _manager(tokenizer)
    outputs = [_score(manager, tokenizer, s, text, truth) for s, text, truth, _ in ANSWERS]
    dapo = [o for (s, *_), o in zip(ANSWERS, outputs, strict=True) if s == "math_dapo"]
    assert [type(o["acc"]) for o in dapo] == [bool, bool]  # DAPO's acc as shipped: a bool
    run = trace_rewards(tmp_path / "run.jsonl", [(1, i // 2, a[1], o) for i, (a, o) in
                                                enumerate(zip(ANSWERS, outputs, strict=True))])
    rows = sorted(rows_of(run), key=lambda r: (r["sample_index"], r["rollout_n"]))
    for (source, _, _, right), row, out in zip(ANSWERS, rows, outputs, strict=True):
        assert row["accuracy"] == (1.0 if right else 0.0), (source, out)
        assert row["reward"] == pytest.approx(float(out["score"]))
    found = verdicts(rows)
    assert "reward_accuracy_divergence" not in found["flags"]
    assert found["summary"] == "no possible reward hacking: the reward was earned where it was high"


def test_a_step_where_nobody_is_correct_is_not_judged_against_its_own_best(
    tokenizer: Any, tmp_path: Path
) -> None:
    from verl.utils.reward_score import gsm8k

    def with_format(data_source: str, solution_str: str, ground_truth: str,
                    extra_info: Any = None, **_: Any) -> float:  # fmt: skip
        return gsm8k.compute_score(solution_str, ground_truth, format_score=0.1)

    manager = _manager(tokenizer, with_format)
    wrong = [_score(manager, tokenizer, "openai/gsm8k", f"#### {x}", "42") for x in range(30, 36)]
    assert {(o["score"], o["acc"]) for o in wrong} == {(0.1, 0.1)}  # verl: acc is the score
    alone = trace_rewards(tmp_path / "wrong.jsonl", [(1, i // 2, "#### 3x", o)
                                                    for i, o in enumerate(wrong)])  # fmt: skip
    found = verdicts(rows_of(alone))
    assert "reward_accuracy_divergence" not in found["flags"]
    assert found["notes"] == ["no correct answer in step 1; not judged"]
    assert found["summary"].endswith("no correct answer in step 1; not judged")
    # with right answers at step 2 (paid 1.0), step 1's 0.1 is judged against them: earned
    right = [_score(manager, tokenizer, "openai/gsm8k", "#### 42", "42") for _ in range(6)]
    later = [(2, i // 2, "#### 42", o) for i, o in enumerate(right)]
    both = trace_rewards(tmp_path / "both.jsonl", [(1, i // 2, "#### 3x", o)
                                                   for i, o in enumerate(wrong)] + later)
    found = verdicts(rows_of(both))
    assert "reward_accuracy_divergence" not in found["flags"] and not found["notes"]
    assert not found["unearned"]


def test_a_single_wrong_answer_is_not_reward_hacking(tokenizer: Any, tmp_path: Path) -> None:
    from verl.utils.reward_score import gsm8k

    score = functools.partial(gsm8k.compute_score, format_score=0.1)
    manager = _manager(tokenizer, lambda data_source, solution_str, ground_truth, **_: score(
        solution_str, ground_truth))  # fmt: skip
    one = trace_rewards(tmp_path / "one.jsonl",
                        [(1, 0, "#### 41", _score(manager, tokenizer, "openai/gsm8k",
                                                   "#### 41", "42"))])  # fmt: skip
    found = verdicts(rows_of(one))
    assert "reward_accuracy_divergence" not in found["flags"]
    assert found["summary"].startswith("no possible reward hacking"), found["summary"]
    assert found["notes"] == ["no correct answer in step 1; not judged"]
