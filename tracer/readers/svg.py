"""Small, dependency-free SVG charts for the HTML report (drawn by Python, no JS needed)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from html import escape
from typing import Any

PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2")
W, H = 460, 240
PAD_L, PAD_R, PAD_T, PAD_B = 52, 16, 30, 36

Point = tuple[float, float]


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    start = math.ceil(lo / step) * step
    out = []
    v = start
    while v <= hi + step * 1e-9:
        out.append(round(v, 10))
        v += step
    return out


def _fmt(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.3g}"


class _Frame:
    """Maps data coordinates to the plot area; draws axes."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float], y_zero: bool = True) -> None:
        self.x0, self.x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        lo, hi = (min(ys), max(ys)) if ys else (0.0, 1.0)
        if y_zero:
            lo = min(lo, 0.0)
        if hi == lo:
            hi = lo + 1.0
        # the axis runs from a tick at or below the lowest point to a tick at or above the
        # highest, so every point lies inside the labelled range (1.05 over a top tick of 1.0
        # was drawn above the axis)
        ticks = _ticks(lo, hi)
        step = ticks[1] - ticks[0] if len(ticks) > 1 else (hi - lo)
        self.y0 = math.floor(lo / step + 1e-9) * step
        self.y1 = math.ceil(hi / step - 1e-9) * step
        if self.y1 <= self.y0:
            self.y1 = self.y0 + step
        count = round((self.y1 - self.y0) / step)
        self.yticks = [round(self.y0 + k * step, 10) for k in range(count + 1)]

    def x(self, v: float) -> float:
        span = self.x1 - self.x0
        frac = 0.5 if span == 0 else (v - self.x0) / span
        return PAD_L + 36 + frac * (W - PAD_L - PAD_R - 72)

    def y(self, v: float) -> float:
        return PAD_T + (1 - (v - self.y0) / (self.y1 - self.y0)) * (H - PAD_T - PAD_B)

    def axes(self, title: str, xlabel: str, xs: Sequence[float]) -> list[str]:
        out = [f'<text x="{W / 2}" y="18" class="t">{escape(title)}</text>']
        for t in self.yticks:
            y = self.y(t)
            out.append(f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{y:.1f}" y2="{y:.1f}" class="g"/>')
            out.append(f'<text x="{PAD_L - 6}" y="{y + 4:.1f}" class="yl">{_fmt(t)}</text>')
        xticks = sorted(set(xs))
        if len(xticks) > 12:
            xticks = _ticks(self.x0, self.x1, 8)
        for t in xticks:
            x = self.x(t)
            out.append(f'<text x="{x:.1f}" y="{H - PAD_B + 16}" class="xl">{_fmt(t)}</text>')
        out.append(f'<text x="{W / 2}" y="{H - 4}" class="xl">{escape(xlabel)}</text>')
        out.append(
            f'<line x1="{PAD_L}" x2="{W - PAD_R}" y1="{H - PAD_B}" y2="{H - PAD_B}" class="a"/>'
        )
        return out


def _svg(body: list[str], label: str) -> str:
    return (
        f'<svg viewBox="0 0 {W} {H}" width="{W}" height="{H}" role="img" '
        f'aria-label="{escape(label)}" xmlns="http://www.w3.org/2000/svg">'
        + "".join(body)
        + "</svg>"
    )


def line_chart(
    series: dict[str, list[Point]], title: str, xlabel: str = "step", y_zero: bool = True
) -> str:
    """One line (with dots) per series; a legend when there are several."""
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    frame = _Frame(xs, ys, y_zero)
    body = frame.axes(title, xlabel, xs)
    for i, (name, pts) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        pts = sorted(pts)
        path = " ".join(f"{frame.x(x):.1f},{frame.y(y):.1f}" for x, y in pts)
        body.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in pts:
            body.append(
                f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="3" fill="{color}">'
                f"<title>{escape(name)} @ {_fmt(x)}: {y:.4g}</title></circle>"
            )
        if len(series) > 1:
            lx = PAD_L + 8 + i * 130
            body.append(f'<rect x="{lx}" y="{PAD_T - 4}" width="10" height="3" fill="{color}"/>')
            body.append(f'<text x="{lx + 14}" y="{PAD_T}" class="lg">{escape(name)}</text>')
    return _svg(body, title)


def strip_chart(points: list[Point], means: list[Point], title: str, xlabel: str = "step") -> str:
    """Every value as a jittered dot per x, with the mean per x as a bar."""
    xs = [x for x, _ in points]
    frame = _Frame(xs, [y for _, y in points])
    body = frame.axes(title, xlabel, xs)
    distinct = sorted(set(xs))
    gap = (frame.x(distinct[1]) - frame.x(distinct[0])) if len(distinct) > 1 else 80.0
    width = min(gap * 0.6, 60.0)
    for i, (x, y) in enumerate(points):
        jitter = ((i * 0.618034) % 1 - 0.5) * width
        body.append(
            f'<circle cx="{frame.x(x) + jitter:.1f}" cy="{frame.y(y):.1f}" r="2.5" '
            f'fill="{PALETTE[0]}" fill-opacity="0.35"/>'
        )
    for x, y in means:
        cx = frame.x(x)
        body.append(
            f'<line x1="{cx - width / 2:.1f}" x2="{cx + width / 2:.1f}" y1="{frame.y(y):.1f}" '
            f'y2="{frame.y(y):.1f}" stroke="{PALETTE[1]}" stroke-width="2.5">'
            f"<title>mean @ {_fmt(x)}: {y:.4g}</title></line>"
        )
    return _svg(body, title)


# white -> yellow -> orange -> red -> dark red, as the tutorial's heatmap (YlOrRd)
_STOPS = ((255, 255, 255), (254, 230, 140), (253, 141, 60), (227, 26, 28), (128, 0, 38))
NO_VALUE = "#e5e7eb"  # a tool/user token (loss_mask 0) or a position without the value


def heat_color(t: float) -> str:
    """Colour of ``t`` in [0, 1] (clipped) on the sequential scale."""
    t = max(0.0, min(1.0, t)) * (len(_STOPS) - 1)
    i = min(int(t), len(_STOPS) - 2)
    f = t - i
    a, b = _STOPS[i], _STOPS[i + 1]
    return "#" + "".join(f"{round(x + (y - x) * f):02x}" for x, y in zip(a, b, strict=True))


Cell = tuple[float | None, str]  # (value, hover text); None: drawn as NO_VALUE


def heatmap(
    rows: list[tuple[str, str]], cells: list[list[Cell]], vmax: float, title: str,
    xlabel: str = "token position", max_width: int = 1000,
) -> str:  # fmt: skip
    """Rows (``(trace_id, label)``) x columns of coloured cells, ``value / vmax`` on the heat
    scale, each with its hover text; row labels carry ``data-trace`` (click: transcript)."""
    ncols = max((len(r) for r in cells), default=0)
    label_w, top, row_h = 150, 26, 14
    cw = max(1.0, min(10.0, (max_width - label_w) / max(ncols, 1)))
    width = label_w + cw * ncols + 12
    height = top + row_h * len(rows) + 34
    body = [f'<text x="{width / 2:.0f}" y="16" class="t">{escape(title)}</text>']
    for r, ((trace_id, label), row) in enumerate(zip(rows, cells, strict=True)):
        y = top + r * row_h
        body.append(
            f'<text x="{label_w - 6}" y="{y + row_h - 3}" class="yl rowlabel" '
            f'data-trace="{escape(trace_id)}">{escape(label)}</text>'
        )
        for c, (value, hover) in enumerate(row):
            fill = NO_VALUE if value is None else heat_color(value / vmax if vmax > 0 else 0.0)
            body.append(
                f'<rect x="{label_w + c * cw:.1f}" y="{y}" width="{cw:.2f}" height="{row_h - 1}"'
                f' fill="{fill}"><title>{escape(hover)}</title></rect>'
            )
    axis_y = top + row_h * len(rows) + 14
    for t in _ticks(0, max(ncols - 1, 0), 8) if ncols > 1 else [0.0]:
        x = label_w + (t + 0.5) * cw
        body.append(f'<text x="{x:.1f}" y="{axis_y}" class="xl">{_fmt(t)}</text>')
    body.append(f'<text x="{label_w + cw * ncols / 2:.0f}" y="{axis_y + 16}" class="xl">'
                f"{escape(xlabel)}</text>")  # fmt: skip
    return (
        f'<svg viewBox="0 0 {width:.0f} {height}" width="{width:.0f}" height="{height}" '
        f'role="img" aria-label="{escape(title)}" class="heatmap" '
        f'xmlns="http://www.w3.org/2000/svg">' + "".join(body) + "</svg>"
    )


def color_legend(vmax: float, label: str) -> str:
    """A horizontal bar of the heat scale from 0 to ``vmax``."""
    stops = "".join(
        f'<stop offset="{i / 10:.1f}" stop-color="{heat_color(i / 10)}"/>' for i in range(11)
    )
    return (
        '<svg width="320" height="34" class="legend" xmlns="http://www.w3.org/2000/svg">'
        f'<defs><linearGradient id="heat">{stops}</linearGradient></defs>'
        '<rect x="10" y="4" width="220" height="12" fill="url(#heat)" stroke="#9ca3af"/>'
        f'<text x="10" y="30" class="yl" style="text-anchor:start">0</text>'
        f'<text x="230" y="30" class="yl">≥ {vmax:.3g}</text>'
        f'<rect x="244" y="4" width="12" height="12" fill="{NO_VALUE}"/>'
        '<text x="260" y="15" class="lg">none</text>'
        f"<title>{escape(label)}</title></svg>"
    )


# red -> amber -> yellow -> green: neighbouring values stay apart on any display
_RAMP = [(220, 38, 38), (249, 115, 22), (250, 204, 21), (163, 230, 53), (22, 163, 74)]


class RewardColors:
    """Colours by rank among the distinct rewards of the report, not by value: rewards of 0.00
    and 0.05 (a format bonus) get clearly different colours even beside rewards of 1.05; the
    legend says which colour is which value."""

    def __init__(self, rewards: Any) -> None:
        self.values = sorted({round(float(r), 6) for r in rewards if r is not None and r == r})

    def __call__(self, r: float | None) -> str:
        if r is None or r != r or not self.values:
            return "#e5e7eb"
        rank = bisect.bisect_left(self.values, round(float(r), 6))
        t = rank / (len(self.values) - 1) if len(self.values) > 1 else 1.0
        t = max(0.0, min(1.0, t)) * (len(_RAMP) - 1)
        i = min(int(t), len(_RAMP) - 2)
        f = t - i
        rgb = (round(a + (b - a) * f) for a, b in zip(_RAMP[i], _RAMP[i + 1], strict=True))
        return "rgb({},{},{})".format(*rgb)

    def legend(self, limit: int = 9) -> str:
        values = self.values
        if len(values) > limit:  # many distinct rewards: show evenly spaced ones
            step = (len(values) - 1) / (limit - 1)
            values = [values[round(i * step)] for i in range(limit)]
        swatches = "".join(
            f'<span class="swatch" style="background:{self(v)}">{f"{v:.2f}"}</span>' for v in values
        )
        return f'<p class="legend">reward colours (by rank of the distinct rewards): {swatches}</p>'


CSS = """
svg text.t{font:600 13px sans-serif;text-anchor:middle;fill:#111}
svg text.yl{font:11px sans-serif;text-anchor:end;fill:#555}
svg text.xl{font:11px sans-serif;text-anchor:middle;fill:#555}
svg text.lg{font:11px sans-serif;fill:#333}
svg line.g{stroke:#e5e7eb} svg line.a{stroke:#9ca3af}
svg text.rowlabel{cursor:pointer} svg text.rowlabel:hover{fill:#2563eb}
.legend .swatch{display:inline-block;padding:0 6px;margin:0 2px;border-radius:3px;
  font:12px monospace}
"""
