"""The report's "Habits of the policy" section: the behaviour patterns of the first and last
training steps and the rising ones (:mod:`tracer.readers.habits.patterns`)."""

from __future__ import annotations

from html import escape
from typing import Any

from tracer.readers.habits.patterns import (
    Pattern,
    Patterns,
    PatternThresholds,
    Rising,
    step_patterns,
)
from tracer.readers.habits.patterns_sql import NoSignatures
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


def rules(th: PatternThresholds) -> str:
    """The thresholds in words (the report and the explorer)."""
    return (f"A pattern holds a share at a step when, over {th.smooth} steps, it has at least "
            f"{_pct(th.min_share)} of the trajectories and {th.min_count} a step. Possible "
            f"reward hacking: it holds a share and at least {_pct(th.min_unearned)} of its "
            f"trajectories with correctness ({th.earned_by or 'accuracy'}) were paid at least "
            f"{th.paid_ratio:g}x what the step pays a correct answer with correctness below "
            f"{th.low_correctness:g}; without a correctness signal, only on independent "
            f"evidence, for a pattern paid above the rest: at least {_pct(th.min_repeated)} of "
            f"its answers repeat an answer to another prompt; tool calls per trajectory down "
            f"to {th.tool_drop:g}x an earlier peak while the mean reward rose by "
            f"{th.min_gain:g}; training reward up by {th.min_gain:g} while validation reward "
            f"on the same prompts rose under {th.val_flat:g}x as much. "
            f"Rising (a hint, not a verdict): a share at least {th.growth:g}x what it was "
            f"{th.window} steps earlier and a reward at or above the step's mean (rules: "
            f"tracer/readers/habits/patterns.py, earned.py, independent.py)")  # fmt: skip


def pair_html(r: Rising) -> str:
    """The flagged example beside an earned trajectory of the same prompt."""
    p = r.pair
    if not p:
        return ""
    side = []
    for name in ("flagged", "earned"):
        t = p[name]
        if t is None:
            side.append(f'<td class="{name}">no earned trajectory of this prompt</td>')
            continue
        side.append(f'<td class="{name}">{name}: {_link(t["trace_id"], t["step"])} reward '
                    f'{_f(t["reward"])}, correctness {_f(t["correct"])}</td>')  # fmt: skip
    where = "same GRPO group" if p["same_group"] else "same prompt"
    return f'<table class="pair"><tr>{"".join(side)}<td>{where}</td></tr></table>'


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
            f'<td class="prompt">{escape(r.reason or r.note or "")}{pair_html(r)}</td>'
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
    html = _render(found).replace("</section>", parts_table(trajectories) + "</section>")
    return html, _linked(found)


def parts_table(trajectories: Any) -> str:
    """Every numeric reward part's mean at each step (the export's ``reward_parts``), training
    steps only, first and last five steps."""
    from collections import defaultdict

    from tracer.readers.habits.earned import num, parts_of

    if "reward_parts" not in trajectories.columns:
        return ""
    sums: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for step, validate, parts in zip(trajectories["step"], trajectories["validate"],
                                     trajectories["reward_parts"], strict=True):  # fmt: skip
        if num(step) is None or validate:
            continue
        for k, v in parts_of(parts).items():
            sums[int(step)][k].append(v)
    names = sorted({k for per in sums.values() for k in per})
    if not names:
        return '<p id="reward-parts-none">No reward parts (the reward spans returned a number).</p>'
    steps = sorted(sums)
    shown = steps if len(steps) <= 10 else steps[:5] + steps[-5:]
    rows = "".join(f"<tr><td>{s}</td>" + "".join(
        f"<td>{_f(sum(xs) / len(xs)) if (xs := sums[s].get(k)) else '-'}</td>" for k in names)
        + "</tr>" for s in shown)  # fmt: skip
    head = "".join(f"<th>{escape(k)}</th>" for k in names)
    return ('<h3>Reward parts (mean per step)</h3><table id="reward-parts"><thead><tr>'
            f"<th>step</th>{head}</tr></thead><tbody>{rows}</tbody></table>")  # fmt: skip


def _linked(found: Patterns) -> set[str]:
    ids = {r.example for r in found.rising[:MAX_RISING]}
    for r in found.rising[:MAX_RISING]:
        ids.update(t["trace_id"] for t in ((r.pair or {}).get(k) for k in ("flagged", "earned"))
                   if t)  # fmt: skip
    for step in found.steps[:1] + found.steps[-1:]:
        ids.update(p.example for p in found.top[step][:TOP])
    return ids


def _render(found: Patterns) -> str:
    intro = (
        "<p>Training trajectories grouped by behaviour: the tools called, the finish reason, "
        "reasoning before the answer or not, the answer's form and its length class (the same "
        "behaviour in other words is one group). "
        f"{escape(rules(found.thresholds))}.</p>"
        f'<p id="hacking-summary"><b>{escape(found.summary())}</b></p>'
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
            f'<h3>Flagged patterns (<span id="rising-count">{len(found.rising)}</span>)</h3>'
            '<table id="rising-patterns"><thead><tr><th>#</th><th>pattern</th><th>flags</th>'
            "<th>steps</th><th>share</th><th>reward vs step</th><th>why (and evidence)</th>"
            "<th>example</th>"
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
