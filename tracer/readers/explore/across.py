"""One prompt across steps (a run's), across runs (the same step of each) and across the n
rollouts of its GRPO group: the rollouts, rewards, and the word diff of the responses."""

from __future__ import annotations

import difflib
import re
from typing import Any

from tracer.readers.explore.filters import ApiError
from tracer.readers.explore.store import Store

MAX_PROMPT_ROWS = 400
MAX_GROUP = 64  # rollouts shown side by side


def prompt(store: Store, run: str | None, trace_id: str | None, text: str | None,
           step: int | None = None) -> dict[str, Any]:  # fmt: skip
    """Every rollout of one prompt (the one of ``trace_id``, or ``text``), by step, with the
    word diff of each step's first response against the previous step's."""
    if trace_id:
        text = store.locate(run, trace_id, step)["prompt"]
    if not text:
        raise ApiError("prompt: give id=<trace id> or prompt=<text>")
    t = store.table(run, "trajectories")
    rows = store.query(f"SELECT trace_id, step, validate, sample_key, rollout_n, reward, "
                       f"finish_reason, response_text FROM {t} WHERE prompt = ? "
                       "ORDER BY step NULLS LAST, validate, rollout_n LIMIT ?",
                       [text, MAX_PROMPT_ROWS])  # fmt: skip
    steps: dict[Any, dict[str, Any]] = {}
    for r in rows:
        key = (r["step"], r["validate"])
        s = steps.setdefault(key, {"step": r["step"], "validate": r["validate"],
                                   "rollouts": []})  # fmt: skip
        s["rollouts"].append(r)
    out, prev = [], None
    for s in steps.values():
        rewards = [r["reward"] for r in s["rollouts"] if r["reward"] is not None]
        s["mean_reward"] = sum(rewards) / len(rewards) if rewards else None
        first = s["rollouts"][0]["response_text"] or ""
        s["diff"] = word_diff(prev, first) if prev is not None else None
        prev = first
        out.append(s)
    return {"prompt": text, "steps": out, "truncated": len(rows) >= MAX_PROMPT_ROWS}


def compare(store: Store, step: int, text: str) -> dict[str, Any]:
    """The same prompt at the same step in every run: rewards and the responses' diff
    against the first run's first rollout."""
    out: list[dict[str, Any]] = []
    base = None
    for name in store.runs:
        t = store.table(name, "trajectories")
        rows = store.query(f"SELECT trace_id, rollout_n, reward, response_text FROM {t} "
                           "WHERE step = ? AND prompt = ? ORDER BY rollout_n LIMIT 64",
                           [step, text])  # fmt: skip
        first = rows[0]["response_text"] or "" if rows else ""
        out.append({"run": name, "rollouts": rows,
                    "diff": word_diff(base, first) if base is not None and rows else None})
        if base is None and rows:
            base = first
    return {"step": step, "prompt": text, "runs": out}


def group(store: Store, run: str | None, step: int, sample_key: str,
          validate: bool) -> dict[str, Any]:  # fmt: skip
    """A GRPO group's n rollouts side by side: reward, advantage, each one's model text (its
    turns' responses) and the word diff against the best-rewarded one (the ``base``)."""
    t = store.table(run, "trajectories")
    rows = store.query(f"SELECT trace_id, rollout_n, reward, finish_reason, num_tool_errors, "
                       f"response_tokens, prompt FROM {t} WHERE step = ? AND validate = ? AND "
                       "sample_key = ? ORDER BY rollout_n, trace_id LIMIT ?",
                       [step, validate, sample_key, MAX_GROUP])  # fmt: skip
    if not rows:
        raise ApiError(f"no group {sample_key!r} at step {step} (validate={validate})", 404)
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    mean = sum(rewards) / len(rewards) if rewards else None
    std = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5 if mean is not None \
        else 0.0  # fmt: skip
    for r in rows:
        turns = store.turn_texts(run, step, r["trace_id"])
        r["text"] = "\n\n".join(t for t in turns if t)
        # as the groups list computes it: GRPO's advantage, (r - mean) / (std + eps)
        r["advantage"] = None if r["reward"] is None or mean is None else \
            (r["reward"] - mean) / (std + 1e-6)  # fmt: skip
    best = max(rows, key=lambda r: -1e300 if r["reward"] is None else r["reward"])
    for r in rows:
        r["diff"] = None if r is best else word_diff(best["text"], r["text"])
    prompt_text = rows[0].pop("prompt")
    for r in rows[1:]:
        r.pop("prompt")
    return {"step": step, "sample_key": sample_key, "validate": validate, "prompt": prompt_text,
            "mean": mean, "std": std, "base": best["rollout_n"], "rollouts": rows,
            "truncated": len(rows) >= MAX_GROUP}  # fmt: skip


def word_diff(old: str, new: str) -> list[list[str]]:
    """``[[op, text], ...]`` with op ``=``, ``-`` or ``+``, word by word (whitespace kept)."""
    a, b = re.findall(r"\S+\s*", old), re.findall(r"\S+\s*", new)
    out: list[list[str]] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            out.append(["=", "".join(a[i1:i2])])
            continue
        if i2 > i1:
            out.append(["-", "".join(a[i1:i2])])
        if j2 > j1:
            out.append(["+", "".join(b[j1:j2])])
    return out
