"""What a step lost: rollouts that were cancelled, timed out or raised, the GRPO groups they left
short, and whether they skew long.

A rollout cut by a timeout is the one that took longest, and the longest rollouts are usually
the ones that wrote most: dropping them trains the policy on shorter answers than it writes.
Every trajectory carries ``end_reason`` (``completed``, ``cancelled``, ``timeout``, ``error``:
tracer/record_builder.py) and ``response_tokens``, the tokens its generate calls returned so far.
Per step (:func:`step_drops`):

- ``dropped`` and ``dropped_<reason>``: trajectories that did not complete, by reason;
- ``incomplete_groups`` of ``groups``: samples (step, sample_key) with fewer completed rollouts
  than the step's group size (its highest ``rollout_n`` index plus one);
- ``dropped_token_share``: the dropped trajectories' share of the step's generated tokens, the
  tokens training never saw; ``kept_tokens_mean``/``_p90`` and ``dropped_tokens_mean``/``_p90``;
- ``length_bias``: the dropped trajectories wrote more than the kept ones, on average, by
  ``LENGTH_BIAS_RATIO`` or more.

A rollout that is not traced (sampled out) is not seen, neither kept nor dropped. Pure Python
over rows with the export's ``trajectories`` columns; older exports without ``end_reason`` read
``status`` (``ERROR`` is ``error``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

END_REASONS = ("completed", "cancelled", "timeout", "error")
DROP_REASONS = END_REASONS[1:]
LENGTH_BIAS_RATIO = 1.25  # dropped mean length over kept mean length that raises the flag


def end_reason(row: Mapping[str, Any]) -> str:
    """A row's ``end_reason``; from ``status`` where the column is missing (older exports)."""
    reason = row.get("end_reason")
    if isinstance(reason, str) and reason in END_REASONS:
        return reason
    return "error" if row.get("status") == "ERROR" else "completed"


def _int(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else int(f)


def _p90(values: list[int]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * 0.9
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None


def step_drops(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The drop columns of one step's trajectory rows (see the module docstring), plus
    ``dropped_trace_ids`` (the dropped trajectories) and ``incomplete_group_keys``."""
    by_reason = dict.fromkeys(DROP_REASONS, 0)
    kept: list[int] = []
    dropped: list[int] = []
    dropped_ids: list[str] = []
    members: dict[str, set[Any]] = {}  # sample -> rollout indices (or trace ids) completed
    size = 1
    for row in rows:
        reason = end_reason(row)
        tokens = _int(row.get("response_tokens"))
        index = _int(row.get("rollout_n"))
        if index is not None:
            size = max(size, index + 1)
        sample = str(row.get("sample_key", row.get("sample_index")))
        done = members.setdefault(sample, set())
        if reason == "completed":
            done.add(index if index is not None else row.get("trace_id"))
            if tokens is not None:
                kept.append(tokens)
            continue
        by_reason[reason] += 1
        dropped_ids.append(str(row.get("trace_id")))
        if tokens is not None:
            dropped.append(tokens)
    size = max([size, *(len(m) for m in members.values())])
    incomplete = sorted(k for k, m in members.items() if len(m) < size)
    total = sum(kept) + sum(dropped)
    kept_mean, dropped_mean = _mean(kept), _mean(dropped)
    bias = bool(dropped_mean is not None and kept_mean is not None and dropped_mean > 0
                and dropped_mean >= LENGTH_BIAS_RATIO * kept_mean)  # fmt: skip
    return {
        "dropped": len(dropped_ids),
        **{f"dropped_{r}": n for r, n in by_reason.items()},
        "groups": len(members),
        "incomplete_groups": len(incomplete),
        "dropped_token_share": sum(dropped) / total if total else None,
        "kept_tokens_mean": kept_mean,
        "kept_tokens_p90": _p90(kept),
        "dropped_tokens_mean": dropped_mean,
        "dropped_tokens_p90": _p90(dropped),
        "length_bias": bias,
        "dropped_trace_ids": dropped_ids,
        "incomplete_group_keys": incomplete,
    }


def drops_line(d: Mapping[str, Any]) -> str:
    """One line for people: ``3 dropped (timeout 3); 2 of 8 groups incomplete; 41% of the
    tokens never trained on; kept mean 120 / p90 180 tokens, dropped mean 400 / p90 420``."""
    if not d.get("dropped"):
        return "nothing dropped"
    reasons = ", ".join(f"{r} {d[f'dropped_{r}']}" for r in DROP_REASONS if d.get(f"dropped_{r}"))
    parts = [f"{d['dropped']} dropped ({reasons})",
             f"{d['incomplete_groups']} of {d['groups']} groups incomplete"]  # fmt: skip
    share = d.get("dropped_token_share")
    if share is not None:
        parts.append(f"{100 * share:.0f}% of the generated tokens never trained on")

    def n(v: Any) -> str:
        return "-" if v is None else f"{v:.0f}"

    parts.append(f"kept mean {n(d.get('kept_tokens_mean'))} / p90 {n(d.get('kept_tokens_p90'))}"
                 f" tokens, dropped mean {n(d.get('dropped_tokens_mean'))} / p90 "
                 f"{n(d.get('dropped_tokens_p90'))}")  # fmt: skip
    return "; ".join(parts)
