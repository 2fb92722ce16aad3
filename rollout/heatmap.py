"""The step's per-token mismatch KL as an image in every tracker (``trainer.kl_heatmap_freq: N``
logs it every N steps): one row per trajectory (sample/rollout), one column per response
position in verl's layout, coloured by k3 of KL(rollout ‖ trainer) (``tracer.tokens.k3``, as
the report's heatmap). Positions are masked as the report masks them: tool and user tokens
(``loss_mask`` 0) and the positions after a trajectory's end are drawn grey, not zero.

Each tracker gets its own image type: a ``wandb.Image``, an MLflow artifact
(``kl_heatmap/step_000001.png``), a ``swanlab.Image`` and a ``trackio.Image``; the console
tracker gets nothing. The colour scale's top is the step's 99th percentile (one runaway token
must not wash out the map) and is printed in the image's title.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from tracer.tokens import k3

IMAGE_KEY = "rollout_corr/kl_heatmap"
CELL_W, CELL_H = 3, 12  # pixels per token position, per trajectory
MASKED = (200, 200, 200)
TITLE_H = 16


def kl_matrix(masks: list[list[int]], rollout: list[list[float]],
              train: list[list[float]]) -> list[list[float | None]]:  # fmt: skip
    """Per trajectory, per response position: the token's k3 mismatch KL, None where masked."""
    rows: list[list[float | None]] = []
    for mask, ro, tr in zip(masks, rollout, train, strict=True):
        model = iter(k3(b - a) for a, b in zip(ro, tr, strict=True))
        rows.append([next(model) if m else None for m in mask])
    return rows


def scale_top(rows: list[list[float | None]]) -> float:
    """The 99th percentile of the step's KL values (the darkest colour)."""
    values = sorted(v for r in rows for v in r if v is not None and math.isfinite(v))
    if not values:
        return 1.0
    top = values[min(len(values) - 1, int(0.99 * (len(values) - 1) + 0.5))]
    return top if top > 0 else (values[-1] or 1.0)


def _colour(value: float, top: float) -> tuple[int, int, int]:
    t = max(0.0, min(1.0, value / top))  # white (0) to dark red (top and above)
    return (255 - int(115 * t), 255 - int(255 * t), 255 - int(255 * t))


def render(rows: list[list[float | None]], title: str) -> Any:
    """The heatmap as a PIL image (RGB)."""
    from PIL import Image, ImageDraw

    top = scale_top(rows)
    width = max([len(r) for r in rows] + [1])
    img = Image.new("RGB", (max(width * CELL_W, 240), len(rows) * CELL_H + TITLE_H), "white")
    draw = ImageDraw.Draw(img)
    draw.text((2, 2), f"{title} (darkest: k3 >= {top:.3g})", fill=(0, 0, 0))
    for i, row in enumerate(rows):
        y = TITLE_H + i * CELL_H
        for j in range(width):
            value = row[j] if j < len(row) else None
            fill = MASKED if value is None or not math.isfinite(value) else _colour(value, top)
            draw.rectangle([j * CELL_W, y, (j + 1) * CELL_W - 1, y + CELL_H - 2], fill=fill)
    return img


# ------------------------------------------------------------------ one writer per tracker
def _wandb(tracker: Any, image: Any, step: int, caption: str) -> None:
    tracker.run.log({IMAGE_KEY: tracker.wandb.Image(image, caption=caption)}, step=step)


def _mlflow(tracker: Any, image: Any, step: int, caption: str) -> None:
    tracker.client.log_image(tracker.run_id, image, artifact_file=f"kl_heatmap/step_{step:06d}.png")


def _swanlab(tracker: Any, image: Any, step: int, caption: str) -> None:
    tracker.run.log({IMAGE_KEY: tracker.swanlab.Image(image, caption=caption)}, step=step)


def _trackio(tracker: Any, image: Any, step: int, caption: str) -> None:
    tracker.run.log({IMAGE_KEY: tracker.trackio.Image(image, caption=caption)}, step=step)


WRITERS: dict[str, Callable[[Any, Any, int, str], None]] = {
    "wandb": _wandb, "mlflow": _mlflow, "swanlab": _swanlab, "trackio": _trackio,
}  # fmt: skip


def log_heatmap(tracking: Any, step: int, image: Any, caption: str) -> list[str]:
    """Log ``image`` to every tracker of ``tracking`` that takes images; returns their names.
    A tracker that fails is warned about once, as for metrics (``Tracking._call``)."""
    return list(tracking.call_each(WRITERS, "log the KL heatmap", image, step, caption))
