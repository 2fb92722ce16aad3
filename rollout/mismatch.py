"""Rollout-vs-trainer mismatch metrics of one step, under verl's names and computed with
verl's formulas (``verl/trainer/ppo/rollout_corr_helper.py`` in verl 0.9.1:
``compute_offpolicy_metrics`` and, for the effective sample size, ``compute_is_metrics`` with
``rollout_is="token"`` and verl's default ``rollout_is_threshold`` of 2.0), so a verl user reads
the same numbers for the same tokens.

Inputs are per trajectory, over its model tokens only (verl's ``response_mask`` = our
``loss_mask`` = 1): ``rollout`` the engine's log-probs, ``train`` the trainer's recomputed ones.
With ``r = train - rollout`` per token, ``N`` the model tokens of the step and ``n_s`` those of
trajectory ``s`` (verl's ``masked_mean`` adds 1e-8 to every denominator, so do we):

* ``rollout_corr/kl``          Σ(rollout - train) / N
* ``rollout_corr/k3_kl``       Σ(e^r - r - 1) / N
* ``rollout_corr/log_ppl_diff``  mean over s of (Σ_s rollout / n_s - Σ_s train / n_s)
* ``rollout_corr/ppl_ratio``   mean over s of exp(that difference)
* ``rollout_corr/chi2_token``  Σ exp(clamp(r, ±20))² / N - 1
* ``rollout_corr/chi2_seq``    mean over s of exp(2·clamp(Σ_s r, ±20)) - 1
* ``rollout_corr/rollout_is_eff_sample_size``  w = min(exp(clamp(r, ±20)), 2),
  ŵ = w / (Σw / N + 1e-8), 1 / (Σŵ² / N)
* ``rollout_corr/{training,rollout}_ppl``, ``..._log_ppl``, ``log_ppl_abs_diff``: as verl.

Where verl computes in float32 tensors this computes in float64 from the float32 values the
tracer stores; the results agree with verl's to float32 rounding. Trajectories without a
model token are left out (verl asserts the batch has one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

SAFETY_BOUND = 20.0  # verl's clamp of log-ratios before exp()
IS_THRESHOLD = 2.0  # verl's default rollout_is_threshold (truncated IS weights)
EPS = 1e-8  # verl_F.masked_mean's denominator guard
PREFIX = "rollout_corr/"


def _clamp(x: float) -> float:
    return max(-SAFETY_BOUND, min(SAFETY_BOUND, x))


def rollout_corr_metrics(
    rollout: Sequence[Sequence[float]], train: Sequence[Sequence[float]]
) -> dict[str, float]:
    """verl's ``rollout_corr/*`` metrics of a step: one list of model-token log-probs per
    trajectory in ``rollout`` (the engine's) and ``train`` (the trainer's), aligned."""
    if len(rollout) != len(train):
        raise ValueError(f"{len(rollout)} rollout sequences but {len(train)} train sequences")
    seqs = []
    for i, (ro, tr) in enumerate(zip(rollout, train, strict=True)):
        if len(ro) != len(tr):
            raise ValueError(f"sequence {i}: {len(ro)} rollout log-probs, {len(tr)} train")
        if ro:
            seqs.append(([float(x) for x in ro], [float(x) for x in tr]))
    if not seqs:
        return {}
    n_tok = sum(len(ro) for ro, _ in seqs)
    kl_sum = k3_sum = chi2_sum = 0.0
    w_sum = 0.0
    weights: list[float] = []
    log_ppl_diff, ppl_ratio, chi2_seq = [], [], []
    train_ppl, train_log_ppl, roll_ppl, roll_log_ppl = [], [], [], []
    for ro, tr in seqs:
        seq_r = 0.0
        for a, b in zip(ro, tr, strict=True):
            r = b - a
            kl_sum += a - b
            k3_sum += math.exp(r) - r - 1.0
            chi2_sum += math.exp(_clamp(r)) ** 2
            w = min(math.exp(_clamp(r)), IS_THRESHOLD)
            weights.append(w)
            w_sum += w
            seq_r += r
        mean_train = sum(tr) / (len(tr) + EPS)
        mean_roll = sum(ro) / (len(ro) + EPS)
        diff = mean_roll - mean_train
        log_ppl_diff.append(diff)
        ppl_ratio.append(math.exp(diff))
        chi2_seq.append(math.exp(2.0 * _clamp(seq_r)))
        train_ppl.append(math.exp(-mean_train))
        train_log_ppl.append(-mean_train)
        roll_ppl.append(math.exp(-mean_roll))
        roll_log_ppl.append(-mean_roll)
    denom = n_tok + EPS
    w_mean = w_sum / denom
    ess = 1.0 / (sum((w / (w_mean + EPS)) ** 2 for w in weights) / denom)

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    out = {
        "kl": kl_sum / denom,
        "k3_kl": k3_sum / denom,
        "chi2_token": chi2_sum / denom - 1.0,
        "chi2_seq": mean(chi2_seq) - 1.0,
        "log_ppl_diff": mean(log_ppl_diff),
        "log_ppl_abs_diff": mean([abs(x) for x in log_ppl_diff]),
        "ppl_ratio": mean(ppl_ratio),
        "rollout_is_eff_sample_size": ess,
        "training_ppl": mean(train_ppl),
        "training_log_ppl": mean(train_log_ppl),
        "rollout_ppl": mean(roll_ppl),
        "rollout_log_ppl": mean(roll_log_ppl),
    }
    return {PREFIX + k: float(v) for k, v in out.items()}
