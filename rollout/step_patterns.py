"""The top behaviour pattern's text in every tracker that takes text (an MLflow artifact
``patterns/step_000001.txt``, a W&B HTML panel, a SwanLab text, a Trackio Markdown panel, under
the key ``patterns/top_pattern``). The step's ``patterns/*`` numbers and the text itself are the
tracer's live analysis (``tracer.live``: ``metrics`` and ``top_pattern`` of the step's partial),
computed in the tracer's background from the trajectories it processed, so a step is flagged
here when ``rollout-tracer flags`` flags it afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from html import escape
from typing import Any

TEXT_KEY = "patterns/top_pattern"


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
