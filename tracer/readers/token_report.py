"""The token-level panels of the report, from the export's ``tokens`` and ``trajectories``
tables: a heatmap per step (samples x token position, coloured by mismatch KL, ref KL or the
engine's log-prob, chosen in the page), per-token values for the coloured transcript, and the
trajectories with the largest KL or lowest log-prob, linked to their transcripts.

KL values are the k3 estimator (``tracer.tokens``); log-probs are drawn as ``-log p``
(surprise), so on every map darker means "look here".
"""

from __future__ import annotations

import math
from html import escape
from typing import Any

from tracer.readers.svg import color_legend, heatmap

# column -> (label in the page, sign applied before colouring)
METRICS: dict[str, tuple[str, float]] = {
    "mismatch_kl": ("mismatch KL: rollout ‖ trainer (k3)", 1.0),
    "ref_kl": ("ref KL: trainer ‖ reference (k3)", 1.0),
    "rollout_logprob": ("rollout log-prob (drawn as -log p)", -1.0),
}
# per-token values the transcript shows on hover, in this order (the JS reads the same order)
TOKEN_FIELDS = ("rollout_logprob", "train_logprob", "ref_logprob", "entropy", "mismatch_kl",
                "ref_kl")  # fmt: skip
TRANSCRIPT_METRICS = ("rollout_logprob", "mismatch_kl", "ref_kl", "entropy")
MAX_HEATMAP_STEPS = 12  # the latest steps
MAX_HEATMAP_ROWS = 64  # trajectories per step map
MAX_HEATMAP_COLS = 512  # positions beyond are binned (max of the bin)
MAX_TRANSCRIPT_TOKENS = 200_000
TOP_N = 10


def _val(v: Any) -> float | None:
    if v is None:
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def has_tokens(tables: Any) -> bool:
    return tables.tokens is not None and len(tables.tokens) > 0


def scales(tokens: Any) -> dict[str, float]:
    """Per metric, the value drawn darkest: the 99th percentile of ``sign * value`` over
    model tokens (one runaway token must not wash out the map). Metrics with no value are
    left out."""
    out = {}
    for name in (*METRICS, "entropy"):
        if name not in tokens:
            continue
        sign = METRICS[name][1] if name in METRICS else 1.0
        col = (tokens[name] * sign).dropna()
        if len(col):
            vmax = float(col.quantile(0.99))
            out[name] = vmax if vmax > 0 else float(col.max()) or 1.0
    return out


def _row_cells(rows: Any, metric: str, sign: float) -> list[tuple[float | None, str]]:
    cells: list[tuple[float | None, str]] = []
    for r in rows.itertuples():
        value = _val(getattr(r, metric))
        token = r.token if isinstance(r.token, str) else f"#{r.token_id}"
        if r.loss_mask == 0:
            hover = f"pos {r.position} {token!r}: tool/user token (loss_mask 0)"
            cells.append((None, hover))
            continue
        hover = f"pos {r.position} {token!r} turn {r.turn}: {metric} = " + (
            "-" if value is None else f"{value:.6g}"
        )
        cells.append((None if value is None else value * sign, hover))
    return cells


def _binned(cells: list[tuple[float | None, str]]) -> list[tuple[float | None, str]]:
    if len(cells) <= MAX_HEATMAP_COLS:
        return cells
    size = math.ceil(len(cells) / MAX_HEATMAP_COLS)
    out = []
    for start in range(0, len(cells), size):
        chunk = cells[start : start + size]
        known = [v for v, _ in chunk if v is not None]
        value = max(known) if known else None
        end = start + len(chunk) - 1
        shown = "-" if value is None else f"{value:.6g}"
        out.append((value, f"positions {start}-{end}: max {shown}"))
    return out


def heatmap_panel(tables: Any, vmax: dict[str, float]) -> str:
    """One heatmap per step and metric; a select shows one metric at a time."""
    tokens, traj = tables.tokens, tables.trajectories
    metrics = [m for m in METRICS if m in vmax]
    steps = sorted(int(s) for s in tokens["step"].dropna().unique())[-MAX_HEATMAP_STEPS:]
    order = traj.set_index("trace_id")[["sample_key", "rollout_n", "validate"]]
    options = "".join(f'<option value="{m}">{escape(METRICS[m][0])}</option>' for m in metrics)
    parts = [
        f'<p>Colour by <select id="kl-metric">{options}</select> '
        "Hover a cell for its token and value; click a row label for its transcript.</p>"
    ]
    for metric in metrics:
        label, sign = METRICS[metric]
        maps = []
        for step in steps:
            in_step = tokens[tokens["step"] == step]
            present = set(in_step["trace_id"])
            ids = [t for t in order.index if t in present]
            ids.sort(key=lambda t: (bool(order.loc[t, "validate"]), str(order.loc[t, "sample_key"]),
                                    order.loc[t, "rollout_n"]))  # fmt: skip
            ids = ids[:MAX_HEATMAP_ROWS]
            by_trace = {t: g.sort_values("position") for t, g in in_step.groupby("trace_id")}
            rows = [(t, f"sample {order.loc[t, 'sample_key']} · n {order.loc[t, 'rollout_n']}"
                     + (" · val" if order.loc[t, "validate"] else "")) for t in ids]  # fmt: skip
            cells = [_binned(_row_cells(by_trace[t], metric, sign)) for t in ids]
            maps.append(heatmap(rows, cells, vmax[metric], f"step {step}: {label}"))
        parts.append(
            f'<div class="kl-map" data-metric="{metric}"'
            + ("" if metric == metrics[0] else " hidden")
            + f">{color_legend(vmax[metric], label)}{''.join(maps)}</div>"
        )
    return (
        '<section id="token-heatmap"><h2>Per token: KL and log-prob by position</h2>'
        + "".join(parts)
        + "</section>"
    )


def top_panel(traj: Any) -> str:
    """The trajectories with the largest KL and the lowest log-prob, linked to transcripts."""
    lists = []
    for column, label, largest in (
        ("mismatch_kl_max", "largest mismatch KL (max over tokens)", True),
        ("ref_kl_max", "largest ref KL (max over tokens)", True),
        ("logprob_min", "lowest rollout log-prob", False),
    ):
        if column not in traj or traj[column].notna().sum() == 0:
            continue
        df = traj[traj[column].notna()]
        df = df.nlargest(TOP_N, column) if largest else df.nsmallest(TOP_N, column)
        rows = "".join(
            f'<tr><td><a href="#viewer" data-trace="{escape(r.trace_id)}">step {_int(r.step)} · '
            f"sample {escape(str(r.sample_key))} · n {_int(r.rollout_n)}</a></td>"
            f"<td>{getattr(r, column):.4g}</td><td>{_fmt(r.reward)}</td></tr>"
            for r in df.itertuples()
        )
        lists.append(
            f'<div class="top" data-column="{column}"><b>{escape(label)}</b>'
            "<table><thead><tr><th>trajectory</th><th>value</th><th>reward</th></tr></thead>"
            f"<tbody>{rows}</tbody></table></div>"
        )
    if not lists:
        return ""
    return (
        '<section id="token-top"><h2>Trajectories to look at</h2><div class="charts">'
        + "".join(lists)
        + "</div></section>"
    )


def _int(v: Any) -> str:
    return "-" if v is None or v != v else str(int(v))


def _fmt(v: Any) -> str:
    return "-" if v is None or v != v else f"{float(v):.3g}"


def token_panels(tables: Any) -> tuple[str, dict[str, Any]]:
    """The HTML of the token panels and what the transcript needs to colour tokens
    (``metrics``: name -> label and scale); a short note when the traces hold no values."""
    vmax = scales(tables.tokens) if has_tokens(tables) else {}
    if not vmax:
        return (
            '<section id="token-heatmap"><h2>Per token</h2><p class="meta">No per-token '
            "values in these traces: generate calls that return log-probs "
            "(<code>calculate_log_probs=True</code>) and <code>tracer.annotate</code> with the "
            "trainer's values fill this section.</p></section>"
        ), {}
    meta = {
        "fields": list(TOKEN_FIELDS),
        "metrics": {m: {"label": METRICS[m][0] if m in METRICS else "entropy",
                        "vmax": vmax[m], "sign": METRICS[m][1] if m in METRICS else 1.0}
                    for m in TRANSCRIPT_METRICS if m in vmax},
    }  # fmt: skip
    return heatmap_panel(tables, vmax) + top_panel(tables.trajectories), meta


def transcript_tokens(tables: Any, ids: set[str]) -> dict[tuple[str, int], list[list[Any]]]:
    """Per (trace_id, turn): the turn's model tokens as ``[text, *TOKEN_FIELDS]`` (values
    rounded to 6 significant digits; None where absent), for the coloured transcript."""
    if not has_tokens(tables):
        return {}
    tokens = tables.tokens
    tokens = tokens[tokens["trace_id"].isin(ids) & (tokens["loss_mask"] == 1)]
    tokens = tokens.sort_values(["trace_id", "position"]).head(MAX_TRANSCRIPT_TOKENS)
    out: dict[tuple[str, int], list[list[Any]]] = {}
    for r in tokens.itertuples():
        text = r.token if isinstance(r.token, str) else f"⟨{r.token_id}⟩"
        values = [_val(getattr(r, f)) for f in TOKEN_FIELDS]
        out.setdefault((r.trace_id, int(r.turn)), []).append(
            [text, *(None if v is None else float(f"{v:.6g}") for v in values)]
        )
    return out
