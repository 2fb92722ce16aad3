"""A trajectory's behaviour signature: what it did, in a form where look-alikes are equal.

A signature is made of four parts, from the trajectory's own rows:

- the tool calls in order: each call's name, with ``!`` when it failed; a run of the same call
  is written once with its count (``search x3``);
- the finish reason of the last generate call (``stop``, ``length``, ...);
- a template of the final answer: the text the reward span scored (its ``final_text``,
  ``solution_str``, ``response``, ``completion`` or ``text`` input), else the last assistant
  turn;
- a template of the last assistant turn (shown only where it differs from the answer's).

A template drops chat-template tokens (``<|im_end|>``), masks quoted values (``"..."``,
``'...'``, backticks, curly quotes) as ``<q>`` and numbers as ``<n>``, collapses whitespace, and
keeps the first and last :data:`EDGE` characters, so ``The answer is #### 42.`` and ``The
answer is #### 7.`` are one template.

``signature_text`` shows the parts on one line; ``signature`` is the first 16 hex characters of
its BLAKE2b digest: a grouping key that is the same in every export of the same behaviour.

What it misses: two strategies that end in the same words look alike (the reasoning in the
middle of a long answer is not part of it), and the same strategy in other words looks
different (free-form answers longer than 2 x EDGE characters rarely share a template).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

EDGE = 100  # characters kept at each end of a template
MAX_RUNS = 20  # tool-call runs shown; the rest is counted
# Only this much of each end of a long text is masked: the template keeps 100 characters of each
# end, and a bounded input keeps the cost of one trajectory bounded (a 1 MB answer costs the
# same as a 1 kB one).
_READ = 8 * EDGE
# Every branch starts with its quote character (the apostrophe's "not after a letter" test comes
# after it), which lets the regex engine skip ahead to quote characters: 5x faster than a
# leading look-behind. ASCII digits only, for the same reason.
_QUOTED = re.compile(
    r'"[^"\n]{0,400}"|“[^”\n]{0,400}”|`[^`\n]{0,400}`|\'(?<!\w\')[^\'\n]{0,400}\'(?!\w)'
)
_NUMBER = re.compile(r"[0-9][0-9.,]*(?<![.,])")
# chat-template tokens, as the report hides them: an export decodes them, the agent loop not
_SPECIAL = re.compile(r"<\|[A-Za-z0-9_.:-]{1,40}\|>")
_SCORED_INPUTS = ("final_text", "solution_str", "response", "completion", "text")


@dataclass(frozen=True)
class Signature:
    key: str  # 16 hex chars
    text: str  # the parts, readable


def template(text: str | None) -> str:
    """``text`` without chat-template tokens, with quoted values as ``<q>``, numbers as
    ``<n>``, whitespace collapsed, cut to its first and last :data:`EDGE` characters (``""``
    for no text)."""
    if not text:
        return ""
    if len(text) > 2 * _READ:
        text = text[:_READ] + " " + text[-_READ:]
    if "<|" in text:
        text = _SPECIAL.sub("", text)
    masked = _NUMBER.sub("<n>", _QUOTED.sub("<q>", text))
    flat = " ".join(masked.split())
    if len(flat) > 2 * EDGE + 3:
        flat = f"{flat[:EDGE]} … {flat[-EDGE:]}"
    return flat


def tool_sequence(calls: Iterable[tuple[str | None, bool]]) -> str:
    """``[("calc", False), ("search", True), ("search", True)]`` -> ``"calc, search! x2"``."""
    runs: list[tuple[str, int]] = []
    for name, failed in calls:
        item = f"{name or '?'}{'!' if failed else ''}"
        if runs and runs[-1][0] == item:
            runs[-1] = (item, runs[-1][1] + 1)
        else:
            runs.append((item, 1))
    shown = [f"{item} x{n}" if n > 1 else item for item, n in runs[:MAX_RUNS]]
    if len(runs) > MAX_RUNS:
        shown.append(f"… {len(runs) - MAX_RUNS} more")
    return ", ".join(shown) or "none"


def signature(calls: Sequence[tuple[str | None, bool]], finish_reason: str | None,
              answer: str | None, last_turn: str | None) -> Signature:  # fmt: skip
    """The signature of one trajectory: its tool ``calls`` as (name, failed) in order, the last
    generate call's ``finish_reason``, the scored ``answer`` text (None: the last turn is the
    answer) and the ``last_turn``'s text."""
    turn = template(last_turn)
    said = turn if answer is None or answer == last_turn else template(answer)
    parts = [f"tools: {tool_sequence(calls)}", f"finish: {finish_reason or '-'}",
             f"answer: {said}"]  # fmt: skip
    if turn != said:
        parts.append(f"last turn: {turn}")
    text = " | ".join(parts)
    return Signature(hashlib.blake2b(text.encode(), digest_size=8).hexdigest(), text)


def scored_text(inputs: object) -> str | None:
    """The text a reward span scored: the first of its known text inputs, if it is a string."""
    if isinstance(inputs, dict):
        for name in _SCORED_INPUTS:
            value = inputs.get(name)
            if isinstance(value, str):
                return value
    return None
