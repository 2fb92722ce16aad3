"""One prompt across steps (a run's) and across runs (the same step of each): the rollouts,
rewards, and the word diff of the responses."""

from __future__ import annotations

import difflib
import re
from typing import Any

from rollout.explore.filters import ApiError
from rollout.explore.store import Store

MAX_PROMPT_ROWS = 400


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
