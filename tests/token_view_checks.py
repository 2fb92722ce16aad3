"""Checks of the token view a default ``rollout-tracer run`` fills, shared by the main-job test
(one default run serves both): ``rollout-tracer export`` gives a ``tokens`` table in which every
model token of a training trajectory has the engine's, the trainer's and the reference's
log-probs; verl's ``rollout_corr`` formulas, recomputed from that table with DuckDB, equal the
step metrics the MLflow tracker logged."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from rollout.cli import main
from rollout.heatmap import CELL_H, TITLE_H

METRICS = ("kl", "k3_kl", "chi2_token", "chi2_seq", "ppl_ratio", "log_ppl_diff",
           "rollout_is_eff_sample_size")  # fmt: skip

# verl 0.9.1 rollout_corr_helper.py (compute_offpolicy_metrics; compute_is_metrics with
# rollout_is="token", threshold 2.0), over loss_mask = 1 tokens; masked_mean's 1e-8 kept
ROLLOUT_CORR_SQL = """
WITH t AS (
    SELECT k.step, k.trace_id, k.rollout_logprob AS ro, k.train_logprob AS tr,
           k.train_logprob - k.rollout_logprob AS r,
           greatest(-20.0, least(20.0, k.train_logprob - k.rollout_logprob)) AS r_safe
    FROM tokens k JOIN trajectories j USING (trace_id)
    WHERE k.loss_mask = 1 AND NOT j.validate
), seq AS (
    SELECT step, trace_id, sum(ro) / (count(*) + 1e-8) - sum(tr) / (count(*) + 1e-8) AS diff,
           greatest(-20.0, least(20.0, sum(r))) AS sum_safe
    FROM t GROUP BY step, trace_id
), per_seq AS (
    SELECT step, avg(diff) AS log_ppl_diff, avg(exp(diff)) AS ppl_ratio,
           avg(exp(2 * sum_safe)) - 1 AS chi2_seq
    FROM seq GROUP BY step
), per_tok AS (
    SELECT step, count(*) + 1e-8 AS n, sum(ro - tr) / (count(*) + 1e-8) AS kl,
           sum(exp(r) - r - 1) / (count(*) + 1e-8) AS k3_kl,
           sum(exp(r_safe) * exp(r_safe)) / (count(*) + 1e-8) - 1 AS chi2_token,
           sum(least(exp(r_safe), 2.0)) / (count(*) + 1e-8) AS w_mean
    FROM t GROUP BY step
), ess AS (
    SELECT t.step, 1.0 / (sum(pow(least(exp(t.r_safe), 2.0) / (p.w_mean + 1e-8), 2))
                          / any_value(p.n)) AS rollout_is_eff_sample_size
    FROM t JOIN per_tok p USING (step) GROUP BY t.step
)
SELECT step, kl, k3_kl, chi2_token, chi2_seq, ppl_ratio, log_ppl_diff,
       rollout_is_eff_sample_size
FROM per_tok JOIN per_seq USING (step) JOIN ess USING (step) ORDER BY step
"""


def check_token_view(tmp_path: Path, mlflow_uri: str, client: Any, run_id: str) -> None:
    duckdb = pytest.importorskip("duckdb")
    out = tmp_path / "export"
    assert main(["export", "--from", "mlflow", "--tracking-uri", mlflow_uri, "--experiment",
                 "rollout-tracer", "--out", str(out), "--format", "parquet",
                 "--no-progress"]) == 0  # fmt: skip
    db = duckdb.connect()
    for name in ("tokens", "trajectories"):
        db.execute(f"CREATE VIEW {name} AS SELECT * FROM read_parquet('{out / name}.parquet')")
    [(model, missing)] = db.execute("""
        SELECT count(*), count(*) FILTER (WHERE rollout_logprob IS NULL OR isnan(rollout_logprob)
            OR train_logprob IS NULL OR isnan(train_logprob) OR ref_logprob IS NULL
            OR isnan(ref_logprob) OR entropy IS NULL OR isnan(entropy))
        FROM tokens JOIN trajectories USING (trace_id) WHERE loss_mask = 1 AND NOT validate
    """).fetchall()  # fmt: skip
    assert model > 100 and missing == 0, (model, missing)
    rows = db.execute(ROLLOUT_CORR_SQL).fetchall()
    assert [r[0] for r in rows] == [1, 2]
    for step, *values in rows:
        for name, expected in zip(METRICS, values, strict=True):
            [logged] = [m.value for m in client.get_metric_history(run_id, f"rollout_corr/{name}")
                        if m.step == step]  # fmt: skip
            assert math.isfinite(logged)
            assert logged == pytest.approx(expected, rel=1e-6, abs=1e-6), (step, name)
    # the health flag counts of every step, and the heatmap image of every step
    for step in (1, 2):
        history = client.get_metric_history(run_id, "health/truncated")
        assert step in {m.step for m in history}
    images = {a.path for a in client.list_artifacts(run_id, "kl_heatmap")}
    assert images == {"kl_heatmap/step_000001.png", "kl_heatmap/step_000002.png"}
    from PIL import Image

    local = client.download_artifacts(run_id, "kl_heatmap/step_000001.png", str(tmp_path))
    with Image.open(local) as img:
        assert img.format == "PNG" and img.height == TITLE_H + 4 * CELL_H  # 4 trajectories
