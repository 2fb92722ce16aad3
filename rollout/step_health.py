"""Per-step counts of the health flags (``health/<flag>``: trajectories of the step that carry
the flag), logged with the step metrics while the run goes.

The rules are the readers' own (:func:`tracer.readers.health.analyze` over trajectory rows),
fed with rows built from the trajectories the driver holds instead of the stored traces, so
the counts a tracker shows during the run are those ``rollout-tracer flags`` finds afterwards.
Step rules compare with the run's first step, so the rows of every step seen are kept (a few
numbers and the turn texts per trajectory).
"""

from __future__ import annotations

import json
from typing import Any

from tracer.readers.health import analyze, trajectory_flags

TOOL_ERROR_PREFIX = "Error: "  # rollout.tools: what a failed tool call returns to the model


def tool_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """(name, arguments, error) of each tool call, in order: a call's result is the next
    ``tool`` message (rollout.agent_loop appends them in call order)."""
    calls: list[dict[str, Any]] = []
    results = iter([m for m in messages if m.get("role") == "tool"])
    for msg in messages:
        for call in msg.get("tool_calls") or [] if msg.get("role") == "assistant" else []:
            fn = call.get("function") or {}
            args = fn.get("arguments")
            result = next(results, None)
            content = str((result or {}).get("content") or "")
            error = content if content.startswith(TOOL_ERROR_PREFIX) else None
            calls.append({"name": fn.get("name"), "error": error,
                          "arguments": json.dumps(args, sort_keys=True)})  # fmt: skip
    return calls


def trajectory_row(out: Any) -> dict[str, Any]:
    """The health rule's view of one ``AgentLoopOutput``."""
    extra = out.extra
    reward = (out.reward or {}).get("score")
    accuracy = (out.reward or {}).get("accuracy")
    turns = [{"finish_reason": t.finish_reason, "response_text": t.text}
             for t in out.turns if t.role == "assistant"]  # fmt: skip
    flags = trajectory_flags(reward, turns, tool_calls(out.messages))
    ident = (extra.get("step"), extra.get("sample_index"), extra.get("rollout_n"))
    return {"trace_id": "{}:{}:{}".format(*ident), "step": extra.get("step"),
            "validate": bool(extra.get("validate")), "sample_key": str(extra.get("sample_index")),
            "response_tokens": len(out.response_ids), "reward": reward, "accuracy": accuracy,
            "flags": flags}  # fmt: skip


class StepHealth:
    """Keeps the rows of every step; ``counts(result)`` adds a step and returns its counts."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def counts(self, result: Any) -> dict[str, float]:
        self.rows.extend(trajectory_row(out) for out in result.outputs)
        health = analyze(self.rows)
        return {k: float(v) for k, v in health.step_metrics(result.step).items()}
