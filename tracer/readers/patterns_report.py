"""The report's "Habits of the policy" section: the behaviour patterns of the first and last
training steps and the rising ones (:mod:`tracer.readers.patterns`)."""

from __future__ import annotations

from html import escape
from typing import Any

from tracer.readers.patterns import Pattern, Patterns, PatternThresholds, Rising, step_patterns
from tracer.readers.patterns_sql import NoSignatures
from tracer.readers.svg import line_chart

MAX_RISING = 10  # rows of the rising table
MAX_CURVES = 5  # share-over-steps charts drawn
TOP = 5  # patterns shown for the first and the last step


def _f(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


def _link(trace_id: str, step: int) -> str:
    t = escape(trace_id)
    return f'<a class="flag-link" href="#t-{t}" data-trace="{t}">step {step} · {t[:8]}</a>'


def _rules(th: PatternThresholds) -> str:
    return (f"rising: share at least {th.growth:g}x what it was {th.window} steps earlier (means "
            f"over {th.smooth} steps), at least {_pct(th.min_share)} of the step and "
            f"{th.min_count} trajectories a step, reward at or above the step's mean; possible "
            f"reward hacking: besides, more reward than the rest with responses at most "
            f"{th.short_ratio:g}x as long, or at most {th.repeat_ratio:g} distinct responses "
            f"per prompt (rules: tracer/readers/patterns.py)")  # fmt: skip


def _rising_rows(rising: list[Rising]) -> str:
    rows = []
    for i, r in enumerate(rising[:MAX_RISING]):
        labels = "".join(f'<span class="label">{escape(x)}</span> ' for x in r.labels)
        rows.append(
            f'<tr data-signature="{escape(r.signature)}"><td>{i + 1}</td><td class="prompt">'
            f"<code>{escape(r.text)}</code></td><td class=\"labels\">{labels}</td>"
            f"<td>{r.since}-{r.last_step}</td><td>{_pct(r.share_then)} → {_pct(r.share_now)}"
            f"<br><small>peak {_pct(r.peak_share)} at step {r.peak_step}</small></td>"
            f"<td>{_f(r.reward)} vs {_f(r.step_reward)}</td>"
            f'<td class="prompt">{escape(r.reason or "")}</td>'
            f"<td>{_link(r.example, r.last_step)}</td></tr>"
        )
    return "".join(rows)


def _top_table(step: int, top: list[Pattern], which: str) -> str:
    rows = "".join(
        f'<tr data-signature="{escape(p.signature)}"><td>{i + 1}</td><td>{_pct(p.share)}</td>'
        f"<td>{p.n}</td><td>{_f(p.reward_mean)} ± {_f(p.reward_std)}</td>"
        f"<td>{_f(p.mean_length, 0)}</td><td>{_f(p.tool_error_rate)}</td>"
        f"<td>{_link(p.example, step)}</td>"
        f'<td class="prompt"><code>{escape(p.text)}</code></td></tr>'
        for i, p in enumerate(top[:TOP])
    )
    return (
        f'<h3>{which} step ({step})</h3><table class="patterns" data-step="{step}"><thead><tr>'
        "<th>#</th><th>share</th><th>n</th><th>reward ± spread</th><th>length</th>"
        "<th>tool errors</th><th>example</th><th>pattern</th></tr></thead>"
        f"<tbody>{rows}</tbody></table>"
    )


def habits_panel(trajectories: Any,
                 thresholds: PatternThresholds | None = None) -> tuple[str, set[str]]:  # fmt: skip
    """The section's HTML for a ``trajectories`` DataFrame, and the trace ids it links to."""
    head = '<section id="habits"><h2>Habits of the policy</h2>'
    try:
        found = step_patterns(trajectories, thresholds)
    except NoSignatures as exc:
        return f'{head}<p id="habits-none">{escape(str(exc))}.</p></section>', set()
    return _render(found), _linked(found)


def _linked(found: Patterns) -> set[str]:
    ids = {r.example for r in found.rising[:MAX_RISING]}
    for step in found.steps[:1] + found.steps[-1:]:
        ids.update(p.example for p in found.top[step][:TOP])
    return ids


def _render(found: Patterns) -> str:
    intro = (
        "<p>Training trajectories grouped by behaviour signature: the tool calls (<code>!</code>"
        " = failed), the finish reason and a template of the answer (numbers <code>&lt;n&gt;"
        "</code>, quoted values <code>&lt;q&gt;</code>). Two strategies that end in the same "
        "words look alike; the same strategy in other words looks different. "
        f"{escape(_rules(found.thresholds))}.</p>"
    )
    if not found.steps:
        return (f'<section id="habits"><h2>Habits of the policy</h2>{intro}<p id="habits-none">'
                "No training trajectories with a step.</p></section>")  # fmt: skip
    if found.rising:
        charts = "".join(
            '<div class="chart">' + line_chart({"share": [(float(s), v) for s, v in r.curve]},
                                               f"rising pattern {i + 1}: share of the step")
            + "</div>"
            for i, r in enumerate(found.rising[:MAX_CURVES])
        )  # fmt: skip
        rising = (
            f'<h3>Rising patterns (<span id="rising-count">{len(found.rising)}</span>)</h3>'
            '<table id="rising-patterns"><thead><tr><th>#</th><th>pattern</th><th>flags</th>'
            "<th>steps</th><th>share</th><th>reward vs step</th><th>why</th><th>example</th>"
            "</tr></thead>"
            f'<tbody>{_rising_rows(found.rising)}</tbody></table><div class="charts">{charts}'
            "</div>"
        )
    else:
        rising = ('<p id="rising-none">No rising pattern <span id="rising-count" hidden>0</span>'
                  "</p>")  # fmt: skip
    first, last = found.steps[0], found.steps[-1]
    tables = _top_table(first, found.top[first], "First")
    if last != first:
        tables += _top_table(last, found.top[last], "Last")
    return f'<section id="habits"><h2>Habits of the policy</h2>{intro}{rising}{tables}</section>'
