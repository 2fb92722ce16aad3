"""One self-contained HTML report of a run (inline CSS, JS and SVG; no network).

Panels: health flags; habits of the policy (behaviour patterns per step, the rising ones:
:mod:`~.habits.patterns_report`); reward distribution per step; mean reward and response
length over steps; turns and tool-call success per step; GRPO groups (the ``rollout_n`` samples
of each prompt side by side, zero-advantage groups flagged); the same prompt across steps; per
token (where the traces hold log-probs or annotated trainer values,
:mod:`tracer.readers.token_report`): a KL / log-prob heatmap per step and the trajectories to
look at; a transcript of any trajectory, its tokens coloured by log-prob or KL.

    from tracer.readers import read_tables, write_report
    write_report(read_tables("parquet", path="out/"), "report.html")
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from html import escape
from typing import Any

from tracer.readers.export import Tables
from tracer.readers.habits.patterns import PatternThresholds
from tracer.readers.habits.patterns_report import habits_panel
from tracer.readers.health import FLAGS, STEP_FLAGS, Health, analyze
from tracer.readers.report_page import page
from tracer.readers.svg import RewardColors, line_chart, strip_chart
from tracer.readers.timing.report import time_panel
from tracer.readers.token_report import token_panels, transcript_tokens

MAX_TRANSCRIPTS = 2000
MAX_GROUP_STEPS = 50
MAX_PROMPTS = 25
MAX_FLAG_EXAMPLES = 5  # example transcripts linked per health flag


def _f(v: Any, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{float(v):.{digits}f}"


def _short(text: Any, n: int = 90) -> str:
    s = "" if text is None or (isinstance(text, float) and math.isnan(text)) else str(text)
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"


def step_stats(traj: Any) -> Any:
    """Per-step aggregates (a DataFrame indexed by step)."""
    df = traj[traj["step"].notna()].copy()
    df["tool_ok"] = df["num_tool_calls"] - df["num_tool_errors"]
    g = df.groupby("step")
    stats = g.agg(
        n=("trace_id", "count"),
        reward_mean=("reward", "mean"),
        reward_std=("reward", "std"),
        reward_min=("reward", "min"),
        reward_max=("reward", "max"),
        response_tokens=("response_tokens", "mean"),
        turns=("num_turns", "mean"),
        tool_calls=("num_tool_calls", "sum"),
        tool_ok=("tool_ok", "sum"),
    )
    stats["tool_success"] = stats["tool_ok"] / stats["tool_calls"].where(stats["tool_calls"] > 0)
    return stats.sort_index()


def _series(stats: Any, column: str) -> list[tuple[float, float]]:
    col = stats[column]
    return [(float(s), float(v)) for s, v in col.items() if v == v]  # drops NaN


def _summary_panel(traj: Any, stats: Any) -> str:
    rows = "".join(
        f'<tr data-step="{int(step)}"><td>{int(step)}</td><td>{int(r.n)}</td>'
        f'<td class="mean-reward">{_f(r.reward_mean)}</td><td>{_f(r.reward_std)}</td>'
        f"<td>{_f(r.reward_min)}</td><td>{_f(r.reward_max)}</td>"
        f"<td>{_f(r.response_tokens, 1)}</td><td>{_f(r.turns, 2)}</td>"
        f"<td>{int(r.tool_calls)}</td><td>{_f(r.tool_success, 3)}</td></tr>"
        for step, r in stats.iterrows()
    )
    points = [
        (float(s), float(v))
        for s, v in zip(traj["step"], traj["reward"], strict=True)
        if s == s and v is not None and v == v
    ]
    strip = strip_chart(points, _series(stats, "reward_mean"), "reward per trajectory, mean")
    return (
        f'<section id="rewards"><h2>Training reward per step</h2>{strip}'
        '<table class="stats"><thead><tr><th>step</th><th>n</th><th>mean reward</th>'
        "<th>std</th><th>min</th><th>max</th><th>response tokens</th><th>turns</th>"
        f"<th>tool calls</th><th>tool success</th></tr></thead><tbody>{rows}</tbody></table>"
        "</section>"
    )


def _trends_panel(stats: Any) -> str:
    charts = [
        line_chart({"mean reward": _series(stats, "reward_mean")}, "mean reward"),
        line_chart({"response tokens": _series(stats, "response_tokens")}, "mean response tokens"),
        line_chart({"turns": _series(stats, "turns")}, "mean turns (generate calls)"),
        line_chart({"success": _series(stats, "tool_success")}, "tool-call success rate"),
    ]
    return (
        '<section id="trends"><h2>Training over steps</h2><div class="charts">'
        + "".join(f'<div class="chart">{c}</div>' for c in charts)
        + "</div></section>"
    )


def grpo_groups(traj: Any) -> list[dict[str, Any]]:
    """Training groups (same step and sample): their rewards by rollout_n, flagged when all
    rewards are equal (zero advantage: no learning signal in GRPO)."""
    df = traj[(~traj["validate"]) & traj["step"].notna()]
    groups = []
    for (step, key), g in df.groupby(["step", "sample_key"], sort=True):
        g = g.sort_values("rollout_n")
        rewards = [None if r != r else float(r) for r in g["reward"]]
        known = [r for r in rewards if r is not None]
        groups.append(
            {
                "step": int(step),
                "sample": str(key),
                "prompt": g["prompt"].iloc[0],
                "samples": list(zip(g["trace_id"], g["rollout_n"], rewards, strict=True)),
                "zero_advantage": len(g) > 1 and len(known) == len(g) and len(set(known)) == 1,
            }
        )
    return groups


def _groups_panel(groups: list[dict[str, Any]], color: RewardColors) -> str:
    flagged = sum(g["zero_advantage"] for g in groups)
    steps = sorted({g["step"] for g in groups})[-MAX_GROUP_STEPS:]
    parts = []
    for i, step in enumerate(reversed(steps)):
        rows = []
        in_step = [g for g in groups if g["step"] == step]
        for g in in_step:
            cells = "".join(
                f'<td class="cell" data-trace="{escape(tid)}" style="background:{color(r)}" '
                f'title="rollout {n}: reward {_f(r)}">{_f(r, 2)}</td>'
                for tid, n, r in g["samples"]
            )
            flag = '<td class="flag">zero advantage</td>' if g["zero_advantage"] else "<td></td>"
            cls = ' class="zero"' if g["zero_advantage"] else ""
            rows.append(
                f"<tr{cls}><td>{escape(g['sample'])}</td>"
                f"<td class=prompt>{escape(_short(g['prompt']))}</td>{flag}{cells}</tr>"
            )
        n_zero = sum(g["zero_advantage"] for g in in_step)
        width = max(len(g["samples"]) for g in in_step)
        head = "<th>sample</th><th>prompt</th><th>advantage</th>" + "".join(
            f"<th>rollout {k}</th>" for k in range(width))
        parts.append(
            f'<details{" open" if i == 0 else ""} data-step="{step}"><summary>step {step}: '
            f"{len(in_step)} groups, {n_zero} with zero advantage</summary>"
            f'<table class="groups"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></details>'
        )
    return (
        '<section id="groups"><h2>GRPO groups</h2><p>All rollouts of a prompt side by side '
        "(click a reward for its transcript). "
        f"{color.legend()}"
        f'<b><span id="zero-adv-count">{flagged}</span> of <span id="group-count">'
        f"{len(groups)}</span> groups</b> have all rewards equal: zero advantage.</p>"
        + "".join(parts)
        + "</section>"
    )


def _prompts_panel(traj: Any) -> str:
    df = traj[traj["step"].notna() & traj["prompt"].notna()]
    if df.empty:
        return ""
    by = df.groupby(["prompt", "step"])["reward"].agg(["mean", "count"]).reset_index()
    color = RewardColors(by["mean"])
    spread = by.groupby("prompt")["step"].nunique()
    prompts = spread[spread > 1].sort_values(ascending=False).index[:MAX_PROMPTS]
    if len(prompts) == 0:
        return (
            '<section id="prompts"><h2>Same prompt across steps</h2>'
            "<p>No prompt appears in more than one step.</p></section>"
        )
    steps = sorted(int(s) for s in by[by["prompt"].isin(prompts)]["step"].unique())
    head = "".join(f"<th>step {s}</th>" for s in steps)
    rows = []
    for prompt in prompts:
        sub = by[by["prompt"] == prompt].set_index("step")
        cells = "".join(
            f'<td style="background:{color(float(sub.loc[s, "mean"]))}">'
            f"{_f(sub.loc[s, 'mean'], 2)} <small>n={int(sub.loc[s, 'count'])}</small></td>"
            if s in sub.index
            else "<td></td>"
            for s in steps
        )
        rows.append(f"<tr><td class=prompt>{escape(_short(prompt, 70))}</td>{cells}</tr>")
    return (
        '<section id="prompts"><h2>Same prompt across steps</h2><p>Mean training reward of each '
        f"prompt seen in several steps.</p>{color.legend()}"
        f"<table class=groups><thead><tr><th>prompt</th>{head}</tr>"
        f"</thead><tbody>{''.join(rows)}</tbody></table></section>"
    )


def _health_panel(health: Health, examples: int) -> str:
    """The Health section: each flag, its count over steps, links to example transcripts."""
    counts = health.counts()
    # reward that could not be judged (no correct answer to compare with), said as such
    notes = "".join(f'<p class="not-judged">{escape(n)}</p>' for n in health.notes())
    if not counts:
        return ('<section id="health"><h2>Health</h2><p id="health-none">No health flags '
                f"(rules and thresholds: tracer/readers/health.py).</p>{notes}</section>")
    rows = []
    for name in FLAGS:
        if name not in counts:
            continue
        per_step = counts[name]
        steps = ", ".join(f"{escape(str(k))}: {v}" for k, v in sorted(
            per_step.items(), key=lambda kv: str(kv[0])))  # fmt: skip
        links = " ".join(
            f'<a class="flag-link" href="#t-{escape(t)}" data-trace="{escape(t)}">'
            f"step {escape(str(health.step_of.get(t)))} · {escape(t[:8])}</a>"
            for t in health.examples(name, examples)
        )
        level = "step" if name in STEP_FLAGS else "trajectory"
        rows.append(
            f'<tr data-flag="{name}"><td>{name}</td><td>{level}</td>'
            f'<td class="flag-count">{sum(per_step.values())}</td><td>{steps}</td>'
            f"<td>{links}</td></tr>"
        )
    return (
        '<section id="health"><h2>Health</h2><p>Flagged trajectories per rule (rules and '
        "thresholds: tracer/readers/health.py); click an example to read its transcript.</p>"
        "<table><thead><tr><th>flag</th><th>level</th><th>trajectories</th><th>per step</th>"
        f"<th>examples</th></tr></thead><tbody>{''.join(rows)}</tbody></table>{notes}</section>"
    )


def transcripts(
    tables: Tables, limit: int = MAX_TRANSCRIPTS, include: set[str] | None = None
) -> list[dict[str, Any]]:
    """Per trajectory: its messages, then generate outputs and tool calls in time order
    (the first ``limit`` by step, plus every trace id in ``include``)."""
    ordered = tables.trajectories.sort_values(["step", "sample_key", "rollout_n"])
    traj = ordered.head(limit)
    if include:
        extra = ordered[ordered["trace_id"].isin(include) & ~ordered["trace_id"].isin(
            set(traj["trace_id"]))]  # fmt: skip
        traj = ordered[ordered["trace_id"].isin(set(traj["trace_id"]) | set(extra["trace_id"]))]
    ids = set(traj["trace_id"])
    per_token = transcript_tokens(tables, ids)
    events: dict[str, list[tuple[Any, dict[str, Any]]]] = {i: [] for i in ids}
    for r in tables.turns[tables.turns["trace_id"].isin(ids)].itertuples():
        events[r.trace_id].append((r.start_time, {"type": "assistant",
            "text": _s(r.response_text), "finish": _s(r.finish_reason),
            "tokens": _num(r.response_tokens),
            "toks": per_token.get((r.trace_id, int(r.turn_index)))}))  # fmt: skip
    for r in tables.tool_calls[tables.tool_calls["trace_id"].isin(ids)].itertuples():
        events[r.trace_id].append((r.start_time, {"type": "tool", "name": _s(r.name),
            "args": _s(r.arguments), "result": _s(r.result), "error": _s(r.error)}))  # fmt: skip
    out = []
    for r in traj.itertuples():
        messages = json.loads(r.messages) if isinstance(r.messages, str) else []
        out.append(
            {
                "id": r.trace_id,
                "step": _num(r.step),
                "sample": _s(r.sample_key),
                "n": _num(r.rollout_n),
                "reward": _num(r.reward),
                "finish": _s(r.finish_reason),
                "validate": bool(r.validate),
                "messages": messages if isinstance(messages, list) else [],
                "events": [e for _, e in sorted(events[r.trace_id], key=lambda p: p[0])],
            }
        )
    return out


def _s(v: Any) -> str | None:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return str(v)


def _num(v: Any) -> float | int | None:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    f = float(v)
    return int(f) if f.is_integer() else f


def report_title(traj: Any) -> str:
    """``Rollout report: <experiment> / <experiment_name>`` from the data itself."""
    names = []
    for column in ("experiment", "experiment_name"):
        values = sorted({str(v) for v in traj[column].dropna() if str(v)}) if len(traj) else []
        if values:
            names.append(", ".join(values[:3]) + (" …" if len(values) > 3 else ""))
    return "Rollout report: " + " / ".join(names) if names else "Rollout report"


def _validation_panel(val: Any) -> str:
    """Validation passes: their own table and curve (never mixed into the training numbers)."""
    if not len(val):
        return ('<section id="validation"><h2>Validation</h2><p>No validation rollouts '
                "(traced with <code>validate=True</code>).</p></section>")  # fmt: skip
    stats = step_stats(val)
    rows = "".join(
        f'<tr data-step="{int(step)}"><td>{int(step)}</td><td>{int(r.n)}</td>'
        f'<td class="mean-reward">{_f(r.reward_mean)}</td><td>{_f(r.reward_min)}</td>'
        f"<td>{_f(r.reward_max)}</td><td>{_f(r.response_tokens, 1)}</td>"
        f"<td>{_f(r.turns, 2)}</td></tr>"
        for step, r in stats.iterrows()
    )
    chart = line_chart({"validation": _series(stats, "reward_mean")}, "validation mean reward")
    return (
        '<section id="validation"><h2>Validation</h2><p>One row per validation pass (the fixed '
        f'validation set, at the step it ran).</p><div class="chart">{chart}</div>'
        '<table class="stats"><thead><tr><th>step</th><th>n</th><th>mean reward</th>'
        "<th>min</th><th>max</th><th>response tokens</th><th>turns</th></tr></thead>"
        f"<tbody>{rows}</tbody></table></section>"
    )


def build_report(tables: Tables, title: str | None = None, *,
                 earned_by: str | None = None) -> str:  # fmt: skip
    """The report as one HTML string (``title`` default: :func:`report_title`). Training
    rollouts make the per-step panels; validation rollouts have their own section.
    ``earned_by``: the reward part that says correct (default ``accuracy``), for the health
    flags and the habits' possible reward hacking."""
    traj = tables.trajectories
    title = title or report_title(traj)
    is_val = traj["validate"].fillna(False).astype(bool) if len(traj) else traj["validate"]
    train, val = traj[~is_val], traj[is_val]
    stats = step_stats(train)
    groups = grpo_groups(train)
    mean = train["reward"].mean() if len(train) else None
    passes = val["step"].nunique() if len(val) else 0
    header = (
        f'<p class="meta"><span id="n-steps">{len(stats)}</span> training steps, '
        f'<span id="n-traj">{len(train)}</span> training trajectories, mean reward '
        f'{_f(mean)}; <span id="n-val-passes">{passes}</span> validation passes '
        f'(<span id="n-val">{len(val)}</span> trajectories).</p>'
    )
    body = header + (
        _summary_panel(train, stats) + _trends_panel(stats) if len(stats)
        else "<p>No training steps.</p>"
    )
    body += _validation_panel(val)
    tokens_html, token_meta = token_panels(tables)
    colors = RewardColors(train["reward"])
    body += _groups_panel(groups, colors) + _prompts_panel(train) + tokens_html
    health = analyze(traj.to_dict("records"), earned_by=earned_by)
    linked = {t for name in FLAGS for t in health.examples(name, MAX_FLAG_EXAMPLES)}
    habits, habit_ids = habits_panel(traj, PatternThresholds(earned_by=earned_by))
    time_html, time_ids = time_panel(train)  # where the time went (readers/timing/report.py)
    body = _health_panel(health, MAX_FLAG_EXAMPLES) + habits + time_html + body
    linked |= habit_ids | time_ids
    return page(title, body, transcripts(tables, include=linked), token_meta)


def write_report(tables: Tables, out: str, title: str | None = None, *,
                 earned_by: str | None = None) -> str:  # fmt: skip
    """Write :func:`build_report` to ``out``; returns ``out``. The page is written under a
    temporary name next to ``out`` and renamed when complete: a failure leaves ``out`` as it
    was."""
    html = build_report(tables, title, earned_by=earned_by)
    folder = os.path.dirname(os.path.abspath(out))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".partial", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(html)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would make the report private
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return out
