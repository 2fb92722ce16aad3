"""The report's Time section: where each training step's time went (wall-time percentiles, the
tail ratio, the wait for the last trajectory, the generate/tool/reward/gap shares), curves of the
tail ratio and the tool share over steps, and the stragglers with their slow span, each linked to
its transcript. Computed by :mod:`tracer.readers.timing.breakdown` from the trajectories table."""

from __future__ import annotations

import math
from html import escape
from typing import Any

from tracer.readers.svg import line_chart
from tracer.readers.timing.breakdown import GAP_DETAIL, cause, step_summaries
from tracer.readers.timing.drops import drops_line

MAX_STEP_ROWS = 200  # the table's rows (the slowest-tailed steps first past that)
# stragglers listed (each with its transcript in the page) per step; past that the row says how
# many more and links the explorer's Time tab, which lists them all
LISTED_STRAGGLERS = 20
EXPLORER = "http://127.0.0.1:8765"  # `rollout-tracer explore`'s default address


def _f(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{float(v):.{digits}f}"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * float(v):.0f}%"


def _drops_cell(s: dict[str, Any]) -> str:
    """What the step lost: drops by reason, incomplete groups, the length-bias flag."""
    if not s.get("dropped"):
        return "<td class='drops'>-</td>"
    flag = (" <b class='length-bias'>length bias</b>" if s.get("length_bias") else "")
    return f"<td class='drops'>{escape(drops_line(s))}{flag}</td>"


def time_panel(train: Any, explorer: str = EXPLORER) -> tuple[str, set[str]]:
    """The section's HTML and the trace ids it links (their transcripts go in the page); a
    step with more than ``LISTED_STRAGGLERS`` stragglers says how many more and links
    ``explorer``'s Time tab at that step."""
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
        for r in s["straggler_list"][:LISTED_STRAGGLERS]:
            tid = str(r["trace_id"])
            linked.add(tid)
            gap = cause(r) == "gap"
            detail = escape(GAP_DETAIL if gap else str(r.get("slow_span_detail") or ""))
            links.append(
                f'<a class="straggler-link" href="#t-{escape(tid)}" data-trace="{escape(tid)}">'
                f"{_f(r['latency_ms'] / 1e3)} s · {escape(cause(r))}</a> "
                f'<code class="straggler-detail">{detail}</code>'
            )
        more = len(s["straggler_list"]) - LISTED_STRAGGLERS
        if more > 0:
            links.append(f'<a class="straggler-more" href="{escape(explorer)}/#/time?step='
                         f'{s["step"]}">{more} more in the explorer\'s Time tab</a> '
                         "(<code>rollout-tracer explore</code>)")  # fmt: skip
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
            f"<td class='stragglers' data-count='{s['stragglers']}'>{'<br>'.join(links)}</td>"
            f"{_drops_cell(s)}</tr>"
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
        "them slow (its own work: a leaf, not a span that waits on one) or <code>gap</code> "
        "(no span open); click one to read its transcript. Dropped: rollouts cancelled, timed "
        "out or raised, the groups they left short, and <b>length bias</b> when they wrote "
        "more than the kept ones (tokens so far; a generate call cut mid-way counts none). "
        "Rollouts the tracer did not sample are not in these numbers.</p>" + charts
        + "<table><thead><tr><th>step</th><th>n</th><th>p50</th><th>p90</th><th>p99</th>"
        "<th>max</th><th>p99/p50</th><th>tail wait</th><th>generate</th><th>tool</th>"
        "<th>reward</th><th>other</th><th>gap</th><th>top straggler cause</th>"
        f"<th>stragglers</th><th>dropped</th></tr></thead><tbody>{''.join(rows)}</tbody></table></section>"
    )  # fmt: skip
    return html, linked
