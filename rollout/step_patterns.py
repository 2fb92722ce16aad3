"""Behaviour patterns while the run goes: per step, ``patterns/top_share`` (the share of the
step's most common behaviour), ``patterns/rising`` (groups flagged rising at this step),
``patterns/possible_reward_hacking`` and ``patterns/unearned_reward_share`` (the share of the
step's trajectories in groups flagged possible reward hacking: it stays up while a hack
holds), and the top pattern's text in every tracker that takes
text (an MLflow artifact ``patterns/step_000001.txt``, a W&B HTML panel, a SwanLab text, a
Trackio Markdown panel, under the key ``patterns/top_pattern``).

The signatures and rules are the readers' own (:mod:`tracer.readers.habits.signature`,
:mod:`tracer.readers.habits.patterns`), fed with the trajectories the driver holds, so a step is
flagged here when ``rollout-tracer flags`` flags it afterwards. The driver keeps one
aggregate per (step, signature), not the trajectories; the small ones are dropped once they
are older than the rules look back (``window + smooth`` steps), unless their signature was
ever large enough to be shown or flagged.
"""

from __future__ import annotations

from collections.abc import Callable
from html import escape
from typing import Any

from rollout.step_health import tool_calls
from tracer.readers.habits.behaviour import behaviour
from tracer.readers.habits.earned import reward_parts
from tracer.readers.habits.patterns import PatternThresholds, aggregate, analyze
from tracer.readers.habits.patterns_sql import Group, StepTotal
from tracer.readers.habits.signature import signature

TEXT_KEY = "patterns/top_pattern"


def _prompt(messages: list[dict[str, Any]]) -> Any:
    """The last user message before the first assistant turn (the export's ``prompt``)."""
    prompt = None
    for msg in messages:
        if msg.get("role") == "assistant":
            break
        if msg.get("role") == "user":
            prompt = msg.get("content")
    return prompt


def trajectory_row(out: Any, step: int) -> dict[str, Any]:
    """The pattern rules' view of one ``AgentLoopOutput``."""
    extra = out.extra
    assistant = [t for t in out.turns if t.role == "assistant"]
    last = assistant[-1] if assistant else None
    text = last.text if last is not None else None
    calls = [(c["name"], c["error"] is not None) for c in tool_calls(out.messages)]
    finish = last.finish_reason if last is not None else None
    sig = signature(calls, finish, text, text)
    parts = reward_parts(out.reward)
    tokens = sum(len(t.token_ids) for t in assistant)
    return {"trace_id": "{}:{}:{}".format(step, extra.get("sample_index"), extra.get("rollout_n")),
            "step": step, "validate": bool(extra.get("validate")), "signature": sig.key,
            "signature_text": sig.text, "reward": (out.reward or {}).get("score"),
            "response_tokens": tokens, "response_text": text, "reward_parts": parts,
            "accuracy": parts.get("accuracy", parts.get("acc")),
            "behaviour": behaviour((name for name, _ in calls), finish, text, tokens),
            "num_tool_calls": len(calls), "num_tool_errors": sum(f for _, f in calls),
            "prompt": _prompt(out.messages),
            "sample_key": str(extra.get("sample_index"))}  # fmt: skip


class StepPatterns:
    """``metrics(result)`` adds a step and returns its ``patterns/*`` numbers; ``top_text``
    is then the step's most common pattern, in words."""

    def __init__(self, thresholds: PatternThresholds | None = None) -> None:
        self.th = thresholds or PatternThresholds()
        self.groups: dict[int, list[Group]] = {}
        self.totals: dict[int, StepTotal] = {}
        self.kept: set[str] = set()  # signatures once large enough to be shown or flagged
        self.top_text: str | None = None

    def metrics(self, result: Any) -> dict[str, float]:
        step = int(result.step)
        return self.add(step, [trajectory_row(out, step) for out in result.outputs])

    def add(self, step: int, rows: list[dict[str, Any]]) -> dict[str, float]:
        """Add one step's trajectory rows (the export's ``trajectories`` columns); returns
        the step's ``patterns/*`` numbers."""
        groups, totals = aggregate(rows, self.th.earned_by, self.th.earned, self.th.min_count)
        if step not in totals:
            return {}
        self.groups[step], self.totals[step] = groups, totals[step]
        ranked = sorted(groups, key=lambda g: (-g.n, g.signature))
        self.kept.update(g.signature for i, g in enumerate(ranked)
                         if i < self.th.top or g.n >= self.th.min_count)  # fmt: skip
        steps = sorted(self.totals)
        for old in steps[: -(self.th.window + self.th.smooth)]:
            self.groups[old] = [g for g in self.groups[old] if g.signature in self.kept]
        found = analyze((g for s in steps for g in self.groups[s]), self.totals, self.th,
                        last_only=True)
        top = found.top.get(step) or []
        self.top_text = f"{100 * top[0].share:.1f}% of step {step}: {top[0].text}" if top else None
        return found.step_metrics(step)


# ------------------------------------------------------------------ one writer per tracker
def _mlflow(tracker: Any, text: str, step: int) -> None:
    tracker.client.log_text(tracker.run_id, text, f"patterns/step_{step:06d}.txt")


def _wandb(tracker: Any, text: str, step: int) -> None:
    html = tracker.wandb.Html(f"<pre>{escape(text)}</pre>", inject=False)  # no CDN link
    tracker.run.log({TEXT_KEY: html}, step=step)


def _swanlab(tracker: Any, text: str, step: int) -> None:
    tracker.run.log({TEXT_KEY: tracker.swanlab.Text(text)}, step=step)


def _trackio(tracker: Any, text: str, step: int) -> None:
    tracker.run.log({TEXT_KEY: tracker.trackio.Markdown(text)}, step=step)


WRITERS: dict[str, Callable[[Any, str, int], None]] = {
    "mlflow": _mlflow, "wandb": _wandb, "swanlab": _swanlab, "trackio": _trackio,
}  # fmt: skip


def log_top_pattern(tracking: Any, step: int, text: str) -> list[str]:
    """Log ``text`` to every tracker of ``tracking`` that takes text; returns their names. A
    tracker that fails is warned about once, as for metrics (``Tracking._call``)."""
    return list(tracking.call_each(WRITERS, "log the top pattern", text, step))
