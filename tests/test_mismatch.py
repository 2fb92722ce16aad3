"""verl's rollout_corr metrics (rollout/mismatch.py) against values computed by verl 0.9.1's own
code, and the per-step health flag counts (rollout/step_health.py).

The expected numbers were produced by running verl 0.9.1's ``compute_offpolicy_metrics`` and
``compute_is_metrics(rollout_is="token", threshold 2.0)`` (``verl/trainer/ppo/
rollout_corr_helper.py``, with ``verl/utils/torch_functional.py``'s ``masked_sum`` /
``masked_mean``) on these inputs as padded float64 tensors with a response mask; verl itself
is not a dependency here (it needs tensordict, ray, ...).
"""

from __future__ import annotations

import pytest

from rollout.agent_loop import AgentLoopOutput, Turn
from rollout.mismatch import rollout_corr_metrics
from rollout.step_health import StepHealth

ROLLOUT = [[-0.5, -1.25, -0.125, -3.0], [-0.75], [-2.0, -0.25, -0.0625]]
TRAIN = [[-0.625, -1.0, -0.125, -1.5], [-0.5], [-2.5, -0.25, -0.125]]
VERL = {
    "kl": -0.16406249979492185,
    "k3_kl": 0.2707100657646439,
    "chi2_token": 2.4265195696437702,
    "chi2_seq": 8.254571218417182,
    "ppl_ratio": 0.8837248816885112,
    "log_ppl_diff": -0.1562499990364584,
    "rollout_is_eff_sample_size": 0.8932150795166013,
    "training_ppl": 2.169867769357493,
    "rollout_ppl": 2.5538410626965895,
    "log_ppl_abs_diff": 0.28124999861979166,
}


def test_rollout_corr_equals_verl() -> None:
    got = rollout_corr_metrics(ROLLOUT, TRAIN)
    for name, expected in VERL.items():
        assert got[f"rollout_corr/{name}"] == pytest.approx(expected, rel=1e-12), name


def test_rollout_corr_edges() -> None:
    assert rollout_corr_metrics([[], []], [[], []]) == {}  # no model token: nothing to log
    same = rollout_corr_metrics([[-1.0, -2.0]], [[-1.0, -2.0]])
    assert same["rollout_corr/kl"] == 0.0 and same["rollout_corr/chi2_seq"] == pytest.approx(0)
    assert same["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="sequence 0"):
        rollout_corr_metrics([[-1.0]], [[-1.0, -2.0]])


def _out(index: int, texts: list[str], finish: str, reward: float) -> AgentLoopOutput:
    turns = [Turn("assistant", [1, 2], finish, t) for t in texts]
    return AgentLoopOutput(
        request_id=f"s1-i0-n{index}", prompt_ids=[1], response_ids=[5] * 10,
        response_mask=[1] * 10, response_logprobs=None, messages=[], turns=turns,
        num_assistant_turns=len(turns), finish_reason=finish,
        reward={"score": reward, "accuracy": 0.0},
        extra={"step": 1, "sample_index": 0, "rollout_n": index, "validate": False},
    )  # fmt: skip


def test_health_counts_per_step() -> None:
    class Step:
        step = 1
        outputs = [_out(0, ["a", "a"], "stop", 0.0), _out(1, ["x"], "length", 0.0),
                   _out(2, ["y"], "stop", 0.0)]  # fmt: skip

    counts = StepHealth().counts(Step())
    assert counts["health/identical_turns"] == 1.0
    assert counts["health/truncated"] == 1.0
    assert counts["health/truncation_rate"] == 1.0  # 1 of 3 truncated > 0.25
    assert counts["health/tool_loop"] == 0.0
