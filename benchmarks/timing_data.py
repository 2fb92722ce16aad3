"""The timing of benchmarks/explore_data.py's trajectories: where each one's time went.

Each trajectory is laid out in time as an agent loop runs: a gap (queueing), a generate call,
its tool call, three times, then a last gap; its ``latency_ms`` is their sum, and its timing
columns (``generate_ms``, ``tool_ms``, ``gap_ms``, ``tool_ms_by_name``, ``slow_span_*``: see
readers/timing/breakdown.py) are what an export computes from such spans. Stragglers are planted:
a ``python`` call takes 10-30x its usual time with probability ``SLOW_PROB``. Draws come from a
generator of their own, so the other columns stay what they were for a given seed.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

SLOW_TOOL = "python"
SLOW_PROB = 0.02


def lay_out(rng: np.random.Generator, start: Any, traj: dict[str, Any], turns: dict[str, Any],
            calls: dict[str, Any], n_turns: int) -> None:  # fmt: skip
    """Set the start times and latencies of a page's turns and tool calls (in place), and
    the trajectories' ``latency_ms`` and timing columns."""
    count = len(start)
    gen = rng.gamma(3.0, 100.0, (count, n_turns))  # ms
    names = np.asarray(calls["name"]).reshape(count, n_turns)
    tool = rng.gamma(2.0, 20.0, (count, n_turns))
    planted = (names == SLOW_TOOL) & (rng.random((count, n_turns)) < SLOW_PROB)
    tool = np.where(planted, tool * rng.uniform(10.0, 30.0, (count, n_turns)), tool)
    gaps = rng.gamma(2.0, 15.0, (count, n_turns + 1))
    # each turn: gap, generate, tool; offsets in ms from the trajectory's start
    per_turn = gaps[:, :n_turns] + gen + tool
    before = np.concatenate([np.zeros((count, 1)), np.cumsum(per_turn, axis=1)[:, :-1]], axis=1)
    gen_at = before + gaps[:, :n_turns]
    tool_at = gen_at + gen
    total = per_turn.sum(axis=1) + gaps[:, n_turns]
    turns["start_time"] = (start[:, None] + gen_at * 1000).astype(np.int64).reshape(-1)
    turns["latency_ms"] = gen.reshape(-1)
    calls["start_time"] = (start[:, None] + tool_at * 1000).astype(np.int64).reshape(-1)
    calls["latency_ms"] = tool.reshape(-1)
    traj["latency_ms"] = total
    traj["generate_ms"] = gen.sum(axis=1)
    traj["tool_ms"] = tool.sum(axis=1)
    traj["reward_ms"] = np.zeros(count)
    traj["other_ms"] = np.zeros(count)
    traj["gap_ms"] = gaps.sum(axis=1)
    by_name, ids, kinds, slow_names, details, slow_ms = [], [], [], [], [], []
    turn_ids = np.asarray(turns["span_id"], dtype=object).reshape(count, n_turns)
    call_ids = np.asarray(calls["span_id"], dtype=object).reshape(count, n_turns)
    args = np.asarray(calls["arguments"], dtype=object).reshape(count, n_turns)
    tokens = np.asarray(turns["response_tokens"]).reshape(count, n_turns)
    for i in range(count):
        per: dict[str, float] = {}
        for name, ms in zip(names[i], tool[i], strict=True):
            per[str(name)] = per.get(str(name), 0.0) + float(ms)
        by_name.append(json.dumps(dict(sorted(per.items()))))
        g, t = int(np.argmax(gen[i])), int(np.argmax(tool[i]))
        if tool[i, t] >= gen[i, g]:
            slow = (call_ids[i, t], "tool", str(names[i, t]), args[i, t], float(tool[i, t]))
        else:
            slow = (turn_ids[i, g], "generate", "generate", f"{int(tokens[i, g])} tokens",
                    float(gen[i, g]))  # fmt: skip
        for column, value in zip((ids, kinds, slow_names, details, slow_ms), slow, strict=True):
            column.append(value)
    traj.update(
        tool_ms_by_name=by_name,
        slow_span_id=ids,
        slow_span_kind=kinds,
        slow_span_name=slow_names,
        slow_span_detail=details,
        slow_span_ms=slow_ms,
    )
