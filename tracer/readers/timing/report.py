"""The report's Time section: where each training step's time went (wall-time percentiles, the
tail ratio, the wait for the last trajectory, the generate/tool/reward/gap shares), curves of the
tail ratio and the tool share over steps, and the stragglers with their slow span, each linked to
its transcript. Computed by :mod:`tracer.readers.timing.breakdown` from the trajectories table."""

from __future__ import annotations

import math
from html import escape
from typing import Any

from tracer.readers.svg import line_chart
from tracer.readers.timing.breakdown import cause, step_summaries

MAX_STEP_ROWS = 200  # the table's rows (the slowest-tailed steps first past that)


def _f(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{float(v):.{digits}f}"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * float(v):.0f}%"


def time_panel(train: Any) -> tuple[str, set[str]]:
    """The section's HTML and the trace ids it links (their transcripts go in the page)."""
    if not len(train) or "gap_ms" not in train:
        return "", set()
    summaries = [s for s in step_summaries(train.to_dict("records")) if not s["validate"]]
    if not summaries:
        return "", set()
    linked: set[str] = set()
    shown = summaries if len(summaries) <= MAX_STEP_ROWS else sorted(
        summaries, key=lambda s: -(s["tail_ratio"] or 0))[:MAX_STEP_ROWS]  # fmt: skip
    rows = []
    for s in sorted(shown, key=lambda s: s["step"]):
        links = []
        for r in s["straggler_list"]:
            tid = str(r["trace_id"])
            linked.add(tid)
            detail = escape(str(r.get("slow_span_detail") or ""))
            links.append(
                f'<a class="straggler-link" href="#t-{escape(tid)}" data-trace="{escape(tid)}">'
                f"{_f(r['latency_ms'] / 1e3)} s · {escape(cause(r))}</a> "
                f'<code class="straggler-detail">{detail}</code>'
            )
        rows.append(
            f'<tr data-step="{s["step"]}"><td>{s["step"]}</td><td>{s["trajectories"]}</td>'
            f"<td>{_f(s['wall_p50_ms'] / 1e3)}</td><td>{_f(s['wall_p90_ms'] / 1e3)}</td>"
            f"<td>{_f(s['wall_p99_ms'] / 1e3)}</td><td>{_f(s['wall_max_ms'] / 1e3)}</td>"
            f"<td class='tail-ratio'>{_f(s['tail_ratio'])}</td>"
            f"<td>{_f((s['tail_wait_ms'] or 0) / 1e3)}</td>"
            f"<td>{_pct(s['generate_share'])}</td><td>{_pct(s['tool_share'])}</td>"
            f"<td>{_pct(s['reward_share'])}</td><td>{_pct(s['other_share'])}</td>"
            f"<td>{_pct(s['gap_share'])}</td>"
            f"<td class='top-cause'>{escape(s['top_straggler_cause'] or '-')}</td>"
            f"<td>{'<br>'.join(links)}</td></tr>"
        )
    charts = ""
    if len(summaries) > 1:
        tail = [(float(s["step"]), float(s["tail_ratio"])) for s in summaries
                if s["tail_ratio"] is not None]  # fmt: skip
        tool = [(float(s["step"]), float(s["tool_share"])) for s in summaries
                if s["tool_share"] is not None]  # fmt: skip
        charts = ('<div class="charts">' + line_chart({"p99/p50": tail}, "Tail ratio")
                  + line_chart({"tool share": tool}, "Tool share of the wall time")
                  + "</div>")  # fmt: skip
    html = (
        '<section id="time"><h2>Where the time went</h2><p>Per training step: trajectory wall '
        "times in seconds, the tail ratio p99/p50, how long the step waited for its last "
        "trajectory after the 90th percentile finished, and the shares of the summed wall time "
        "(they add up to 100%). Stragglers (over 3x the step's median) name the span that made "
        "them slow; click one to read its transcript.</p>" + charts
        + "<table><thead><tr><th>step</th><th>n</th><th>p50</th><th>p90</th><th>p99</th>"
        "<th>max</th><th>p99/p50</th><th>tail wait</th><th>generate</th><th>tool</th>"
        "<th>reward</th><th>other</th><th>gap</th><th>top straggler cause</th>"
        f"<th>stragglers</th></tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )  # fmt: skip
    return html, linked
