"""Parser, rewards, dataset and config (no model needed)."""

from __future__ import annotations

import pytest

from rollout.config import ConfigKeyError, load_config, trace_config
from rollout.data.make_dataset import make_problems
from rollout.parser import parse_tool_calls
from rollout.rewards import answer_reward, compute_reward, extract_answer, format_reward
from rollout.worker import iterate_batches, load_dataset


def test_parser_extracts_calls_and_content() -> None:
    text = (
        'Let me add.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n'
        '</tool_call>\n<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}'
        "</tool_call>"
    )
    result = parse_tool_calls(text)
    assert result.content == "Let me add."
    assert [(c.name, c.arguments, c.error) for c in result.tool_calls] == [
        ("calculator", {"expression": "1+2"}, None),
        ("search", {"query": "x"}, None),
    ]


@pytest.mark.parametrize(
    ("text", "error"),
    [("<tool_call>{bad</tool_call>", "invalid JSON"), ("<tool_call>[1]</tool_call>", "object"),
     ('<tool_call>{"arguments": {}}</tool_call>', "no 'name'"),
     ('<tool_call>{"name": "c", "arguments": 3}</tool_call>', "must be a JSON object"),
     ('<tool_call>{"name": "c", "arguments": {"a": 1', "invalid JSON")],
)  # fmt: skip
def test_parser_malformed_calls_carry_errors(text: str, error: str) -> None:
    [call] = parse_tool_calls(text).tool_calls
    assert call.error is not None and error in call.error


def test_parser_no_calls() -> None:
    assert parse_tool_calls("The answer is 4.").tool_calls == []


@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [("so #### 1,234", "1234", "1234"), ("\\boxed{42}", None, "42"),
     ("it is 3 then 7.", None, "7"), ("#### 5 and later 9", "5", "5"),
     ("$12.50 total #### 12.5", "12.5", "12.5"), ("none", None, None),
     ('<tool_call>{"a": 99}</tool_call> result 8', None, "8"), ("#### -3", "-3", "-3"),
     ("#### 4.0", "4", "4"), ("#### 2 then #### 7", "7", "7")],
)  # fmt: skip
def test_extract_answer(text: str, strict: str | None, flexible: str | None) -> None:
    assert extract_answer(text) == strict  # strict is the default, as verl's GSM8K reward
    assert extract_answer(text, "flexible") == flexible


def test_a_reply_without_a_final_answer_is_wrong_by_default() -> None:
    """The default run's case: a validation reply cut off at the token limit, no ####."""
    cut = "Let me think. 12 apples and 3 more make 15, then we give away 3"
    assert compute_reward(cut, 15)["accuracy"] == 0.0
    assert compute_reward(cut, 15)["score"] == pytest.approx(0.05)  # a bare number: format 0.5
    assert compute_reward(cut, 15, mode="flexible")["accuracy"] == 0.0  # last number is 3
    assert compute_reward("so it is 15", 15, mode="flexible")["accuracy"] == 1.0
    with pytest.raises(ValueError, match="valid: strict, flexible"):
        compute_reward("#### 1", 1, mode="lenient")


def test_rewards_known_answers() -> None:
    assert answer_reward("The total is 1,200.\n#### 1,200", 1200) == 1.0
    assert answer_reward("#### 1201", 1200) == 0.0
    assert format_reward("#### 3") == 1.0 and format_reward("3") == 0.5
    assert format_reward("no idea") == 0.0
    r = compute_reward("#### 9", "9", ["I will call a tool", "#### 9"])
    assert r["score"] == pytest.approx(1.1) and r["accuracy"] == 1.0
    assert r["turn_scores"] == [0.0, 1.0]
    assert compute_reward("8", 9)["score"] == pytest.approx(0.05)
    assert compute_reward("9", 9)["score"] == pytest.approx(0.05)  # no "#### 9": wrong


def test_dataset_loads_and_is_deterministic() -> None:
    rows = load_dataset()
    assert len(rows) >= 200
    assert all(isinstance(r["answer"], int) for r in rows)
    assert len({r["category"] for r in rows}) >= 5
    assert rows[0]["index"] == 0
    regenerated = make_problems()
    assert [r["question"] for r in regenerated] == [r["question"] for r in rows]
    for r in rows:  # the shipped solution agrees with the answer
        assert extract_answer(r["solution"]) == str(r["answer"])
    b1 = next(iterate_batches(rows, 4, seed=1))
    assert b1 == next(iterate_batches(rows, 4, seed=1)) and len(b1) == 4


def test_config_defaults_and_overrides() -> None:
    c = load_config()
    assert c["actor_rollout_ref"]["rollout"]["name"] == "hf"
    assert c["actor_rollout_ref"]["model"]["path"] == "smollm2-135m-instruct"
    c = load_config([
        "trainer.total_training_steps=5", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.temperature=0.0", "+trainer.note=hello world",
        "actor_rollout_ref.rollout.trace.backend=[mlflow, jsonl]",
        "actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker=2",
    ])  # fmt: skip
    assert c["trainer"]["total_steps"] == 5 and c["trainer"]["note"] == "hello world"
    assert c["actor_rollout_ref"]["rollout"]["n"] == 4
    assert c["actor_rollout_ref"]["rollout"]["temperature"] == 0.0
    t = trace_config(c)
    assert t["backend"] == ["mlflow", "jsonl"] and t["max_samples_per_step_per_worker"] == 2
    assert t["project_name"] == "rollout-tracer"


def test_config_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigKeyError) as info:
        load_config(["actor_rollout_ref.rollout.tempreature=1"])
    msg = str(info.value)
    assert "tempreature" in msg and "temperature" in msg and "multi_turn" in msg
    with pytest.raises(ConfigKeyError, match="valid keys at <top level>"):
        load_config(["trainr.total_steps=1"])
    with pytest.raises(ConfigKeyError, match="exists"):
        load_config(["+trainer.total_steps=1"])
    with pytest.raises(ValueError, match="valid: hf, vllm, scripted"):
        load_config(["actor_rollout_ref.rollout.name=sglang"])
    with pytest.raises(ValueError, match="key=value"):
        load_config(["trainer.total_steps"])


def test_cli_reports_config_errors(capsys: pytest.CaptureFixture[str]) -> None:
    from rollout.cli import main

    assert main(["run", "actor_rollout_ref.rollout.nn=2"]) == 2
    assert "valid keys at actor_rollout_ref.rollout" in capsys.readouterr().err


def test_run_summary_counts_training_and_validation_apart(
    mlflow_uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("transformers")
    from rollout.cli import main

    rc = main(["run", "--no-progress", "actor_rollout_ref.rollout.name=scripted",
               "actor_rollout_ref.rollout.n=2", "data.train_batch_size=2",
               "trainer.total_steps=2", "trainer.val_before_train=true", "trainer.test_freq=2",
               "data.val_max_samples=3",
               f"actor_rollout_ref.rollout.trace.tracking_uri={mlflow_uri}"])  # fmt: skip
    assert rc == 0
    # 2 steps x 2 prompts x n=2; validation before step 1 and after step 2, 3 prompts x n=1
    assert "done: 8 training + 6 validation trajectories in " in capsys.readouterr().out
