"""Per training step: the metrics of the steps chart and a step's GRPO groups."""

from __future__ import annotations

from typing import Any

from tracer.readers.explore.store import Store


def groups(store: Store, run: str | None, step: int, validate: bool, page: int, size: int,
           zero_only: bool) -> dict[str, Any]:  # fmt: skip
    """A page of a step's GRPO groups: each one's rewards, mean, std, whether they are all
    equal (zero variance: no learning signal), and each rollout's advantage."""
    t = store.table(run, "trajectories")
    having = "HAVING count(*) > 1 AND min(reward) = max(reward)" if zero_only else ""
    base = (f"SELECT sample_key, any_value(prompt) prompt, count(*) n, avg(reward) mean, "
            f"stddev_pop(reward) std, min(reward) = max(reward) AND count(*) > 1 zero_variance,"
            f" list({{'trace_id': trace_id, 'rollout_n': rollout_n, 'reward': reward, "
            f"'finish_reason': finish_reason, 'response_tokens': response_tokens, "
            f"'num_tool_errors': num_tool_errors, 'response_text': left(response_text, 300)}}"
            f" ORDER BY rollout_n) rollouts FROM {t} WHERE step = ? AND validate = ? "
            f"GROUP BY sample_key {having}")  # fmt: skip
    rows = store.query(f"{base} ORDER BY TRY_CAST(sample_key AS BIGINT), sample_key "
                       "LIMIT ? OFFSET ?", [step, validate, size, page * size])  # fmt: skip
    total = store.query(f"SELECT count(*) n, count(*) FILTER (zero_variance) z FROM ({base})",
                        [step, validate])[0]  # fmt: skip
    for g in rows:
        std = g["std"] or 0.0
        for r in g["rollouts"]:
            rew = r["reward"]
            r["advantage"] = None if rew is None else (rew - g["mean"]) / (std + 1e-6)
    return {"step": step, "validate": validate, "page": page, "size": size,
            "total": int(total["n"]), "zero_variance": int(total["z"]),
            "groups": rows}  # fmt: skip


def steps(store: Store, run: str | None) -> list[dict[str, Any]]:
    """Per step (and train/validation): count, mean reward, length, tool success, KL."""
    t = store.table(run, "trajectories")
    return list(store.cached(("steps", run), lambda: store.query(
        f"SELECT step, validate, count(*) n, avg(reward) reward, avg(response_tokens) length,"
        f" 1 - sum(num_tool_errors) / nullif(sum(num_tool_calls), 0) tool_success, "
        f"avg(mismatch_kl_mean) mismatch_kl, avg(ref_kl_mean) ref_kl FROM {t} "
        "WHERE step IS NOT NULL GROUP BY step, validate ORDER BY validate, step")))  # fmt: skip
