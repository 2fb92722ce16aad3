"""Evidence side by side: for each group flagged possible reward hacking, one of its unearned
trajectories next to an earned trajectory of the same prompt, with reward and correctness.

    from tracer.readers.habits.patterns import step_patterns
    r = step_patterns("exports/gsm8k").rising[0]
    r.pair   # {"step": 40, "flagged": {"trace_id": ..., "reward": 1.0, "correct": 0.0},
             #  "earned": {...}, "same_group": True}

The earned one comes from the same GRPO group (same step and ``sample_key``) when that group
has a correct answer, else from any training step with the same prompt text, else there is
none (``earned`` None) and the flagged example stands alone.
"""

from __future__ import annotations

from typing import Any

_PAIR = """
SELECT a.trace_id, a.reward, a.correct, a.sample_key, b.trace_id, b.reward, b.correct,
       b.sample_key, b.step, a.sample_key = b.sample_key AND a.step = b.step AS same_group
FROM t a JOIN t b ON {join}
WHERE a.step = $step AND a.signature = $sig AND a.unearned AND b.correct >= $low
ORDER BY a.trace_id, b.trace_id LIMIT 1
"""
_ALONE = """
SELECT trace_id, reward, correct, sample_key FROM t
WHERE step = $step AND signature = $sig ORDER BY NOT coalesce(unearned, false), trace_id LIMIT 1
"""


def _side(*row: Any) -> dict[str, Any]:
    trace_id, reward, correct, sample_key, step = row
    return {"trace_id": str(trace_id), "reward": reward, "correct": correct,
            "sample_key": sample_key, "step": int(step)}  # fmt: skip


def add_pairs(source: Any, found: Any) -> None:
    """Set ``pair`` on each flagged group of ``found`` (a :class:`Patterns`) from ``source``,
    at the last step it was flagged possible reward hacking."""
    from tracer.readers.habits.patterns_sql import connect

    hacked = [r for r in found.rising if r.hacking]
    if not hacked:
        return
    th = found.thresholds
    con = connect(source, th.earned_by)
    try:
        for r in hacked:
            step = r.hacking_steps[-1]
            args = {"step": step, "sig": r.signature, "low": th.low_correctness}
            row = None
            for join in (
                "a.step = b.step AND a.sample_key = b.sample_key",
                "a.prompt = b.prompt AND a.trace_id <> b.trace_id",
            ):
                row = con.execute(_PAIR.format(join=join), args).fetchone()
                if row is not None:
                    break
            if row is not None:
                r.pair = {
                    "step": step,
                    "flagged": _side(*row[:4], step),
                    "earned": _side(*row[4:9]),
                    "same_group": bool(row[9]),
                }
            else:
                alone = con.execute(_ALONE, {"step": step, "sig": r.signature}).fetchone()
                if alone is not None:
                    r.pair = {
                        "step": step,
                        "flagged": _side(*alone, step),
                        "earned": None,
                        "same_group": False,
                    }
    finally:
        con.close()
