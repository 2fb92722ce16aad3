"""What the driver of ``rollout-tracer run`` does after each rollout step, before it logs the
step: the trainer's side (``rollout.trainer_pass``: bfloat16 log-probs and entropy, reference
log-probs, attached with ``tracer.annotate``), verl's ``rollout_corr/*`` mismatch metrics
(``rollout.mismatch``), the per-step health flag counts (``rollout.step_health``), the
behaviour patterns and where the step's time went (``patterns/*``, ``timing/*`` and the top
pattern's text: the tracer's live analysis, ``tracer.live``, of this process or merged from the
Ray workers') and, every ``trainer.kl_heatmap_freq`` steps, the KL heatmap image in every tracker
(``rollout.heatmap``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import tracer
from rollout.heatmap import kl_matrix, log_heatmap, render
from rollout.step_health import StepHealth
from rollout.step_patterns import log_top_pattern
from rollout.trainer_pass import TrainerPass


class AfterStep:
    """``AfterStep(config, engine, tracking)``; ``metrics = after(step_result)``. ``partial``
    gives a step's live partial: this process's by default (``tracer.live.partial``), the
    workers' merged in a Ray driver."""

    def __init__(self, config: dict[str, Any], engine: Any, tracking: Any,
                 partial: Callable[[int], dict[str, Any]] | None = None) -> None:  # fmt: skip
        trainer = config.get("trainer") or {}
        self.tracking = tracking
        self.heatmap_freq = int(trainer.get("kl_heatmap_freq") or 0)
        self.trainer_pass = TrainerPass.from_config(config, engine)
        self.health = StepHealth()
        self.partial = partial or (lambda step: tracer.live.partial(step))

    def __call__(self, result: Any) -> dict[str, float]:
        metrics = self.health.counts(result)
        part = self.partial(int(result.step))
        live = tracer.live.metrics(part)  # patterns/*, timing/*: one analysis, the tracer's
        metrics.update({k: v for k, v in live.items() if k.startswith(("patterns/", "timing/"))})
        top = tracer.live.top_pattern(part)
        if self.tracking is not None and top:
            log_top_pattern(self.tracking, int(result.step), top)
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
