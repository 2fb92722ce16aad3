"""Rewards: GSM8K-style final-answer match and a format reward, per trajectory and per turn.

Two modes, as verl's GSM8K reward (``verl/utils/reward_score/gsm8k.py``):

- ``strict`` (the default): the answer is the number after the last ``#### `` marker; a reply
  without one is wrong, whatever numbers it holds (a reply cut off at the token limit usually
  has none).
- ``flexible``: the last ``#### x``, else the last ``\\boxed{x}``, else the last number outside
  tool calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from tracer import trace_op

_NUM = r"-?\d[\d,]*(?:\.\d+)?"
_HASH_RE = re.compile(r"####\s*\$?\s*(" + _NUM + ")")
_BOXED_RE = re.compile(r"\\boxed\{\s*\$?\s*(" + _NUM + r")\s*\}")
_ANY_NUM_RE = re.compile(_NUM)
_TOOL_CALL_RE = re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL)


def normalize_number(text: str) -> str | None:
    """``"1,234.50"`` -> ``"1234.5"``; ``"42.0"`` -> ``"42"``; None if not a number."""
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        value = float(text)
    except ValueError:
        return None
    if value.is_integer():
        return str(int(value))
    return repr(value)


MODES = ("strict", "flexible")


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown reward mode {mode!r}; valid: {', '.join(MODES)} "
                         "(e.g. reward.mode=flexible)")  # fmt: skip
    return mode


def extract_answer(text: str, mode: str = "strict") -> str | None:
    """The final answer in ``text``, normalized with :func:`normalize_number`: the last
    ``#### x``; in ``flexible`` mode, else the last ``\\boxed{x}``, else the last number
    outside tool calls."""
    check_mode(mode)
    found = _HASH_RE.findall(text)
    if found:
        return normalize_number(found[-1])
    if mode == "strict":
        return None
    found = _BOXED_RE.findall(text) or _ANY_NUM_RE.findall(_TOOL_CALL_RE.sub(" ", text))
    return normalize_number(found[-1]) if found else None


def answer_reward(text: str, ground_truth: str | int | float, mode: str = "strict") -> float:
    """1.0 when the final answer (:func:`extract_answer` in ``mode``) equals ``ground_truth``
    numerically, else 0.0."""
    got = extract_answer(text, mode)
    return 1.0 if got is not None and got == normalize_number(str(ground_truth)) else 0.0


def format_reward(text: str) -> float:
    """1.0 for a ``#### x`` final answer, 0.5 for only a ``\\boxed{}`` or a bare number."""
    if extract_answer(text, "strict") is not None:
        return 1.0
    return 0.5 if extract_answer(text, "flexible") is not None else 0.0


@dataclass
class RewardResult:
    """A trajectory's reward: ``score`` (what training uses) and its parts."""

    score: float
    accuracy: float
    format: float
    answer: str | None
    ground_truth: str
    turn_scores: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (``score`` first), as recorded on the reward span."""
        return dict(self.__dict__)


@trace_op(kind="reward", name="reward")
def compute_reward(
    final_text: str,
    ground_truth: str | int | float,
    turn_texts: list[str] | None = None,
    format_weight: float = 0.1,
    mode: str = "strict",
) -> dict[str, Any]:
    """Score a trajectory: ``score = accuracy + format_weight * format`` (accuracy is the
    answer match of ``final_text`` in ``mode``: ``strict`` or ``flexible``); ``turn_scores``
    are per-assistant-turn answer matches."""
    acc = answer_reward(final_text, ground_truth, mode)
    fmt = format_reward(final_text)
    turns = [answer_reward(t, ground_truth, mode) for t in (turn_texts or [])]
    return RewardResult(
        score=acc + format_weight * fmt,
        accuracy=acc,
        format=fmt,
        answer=extract_answer(final_text, mode),
        ground_truth=str(ground_truth),
        turn_scores=turns,
    ).to_dict()
