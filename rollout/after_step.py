"""What the driver of ``rollout-tracer run`` does after each rollout step, before it logs the
step: the trainer's side (``rollout.trainer_pass``: bfloat16 log-probs and entropy, reference
log-probs, attached with ``tracer.annotate``), verl's ``rollout_corr/*`` mismatch metrics
(``rollout.mismatch``), the per-step health flag counts (``rollout.step_health``), the
behaviour patterns (``rollout.step_patterns``: ``patterns/*`` and the top pattern's text) and, every
``trainer.kl_heatmap_freq`` steps, the KL heatmap image in every tracker (``rollout.heatmap``).
"""

from __future__ import annotations

import time
from typing import Any

from rollout.heatmap import kl_matrix, log_heatmap, render
from rollout.step_health import StepHealth
from rollout.step_patterns import StepPatterns, log_top_pattern
from rollout.step_timing import step_timing
from rollout.trainer_pass import TrainerPass


class AfterStep:
    """``AfterStep(config, engine, tracking)``; ``metrics = after(step_result)``."""

    def __init__(self, config: dict[str, Any], engine: Any, tracking: Any) -> None:
        trainer = config.get("trainer") or {}
        self.tracking = tracking
        self.heatmap_freq = int(trainer.get("kl_heatmap_freq") or 0)
        self.trainer_pass = TrainerPass.from_config(config, engine)
        self.health = StepHealth()
        self.patterns = StepPatterns()

    def __call__(self, result: Any) -> dict[str, float]:
        metrics = self.health.counts(result)
        metrics.update(self.patterns.metrics(result))
        metrics.update(step_timing(result))  # timing/*: where the step's time went
        if self.tracking is not None and self.patterns.top_text:
            log_top_pattern(self.tracking, int(result.step), self.patterns.top_text)
        if self.trainer_pass is None:
            return metrics
        t0 = time.perf_counter()
        corr, tokens = self.trainer_pass.run(result)
        metrics.update(corr)
        metrics["perf/trainer_pass_s"] = time.perf_counter() - t0
        step = int(result.step)
        if (self.heatmap_freq > 0 and step % self.heatmap_freq == 0 and tokens.rollout
                and len(tokens.rollout) == len(tokens.masks)):
            rows = kl_matrix(tokens.masks, tokens.rollout, tokens.train)
            title = f"step {step}: mismatch KL (k3), {len(rows)} trajectories"
            caption = f"{title}; rows (sample/rollout): {', '.join(tokens.labels)}"
            log_heatmap(self.tracking, step, render(rows, title), caption)
        return metrics
