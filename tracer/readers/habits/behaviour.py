"""A trajectory's behaviour: what the policy did, in a form that rewording does not change.

    from tracer.readers.habits.behaviour import behaviour
    behaviour(["calculator"], "stop", "I multiply 17 by 23: 391. #### 391", 24)
    # 'tools: calculator | finish: stop | reasoning: no | answer: #### | length: short'

Five parts, from the trajectory's own rows:

- **tools**: the names of the tools it called, distinct and sorted (``none``: it called none,
  so a tool skipped shows as its absence);
- **finish**: the finish reason of the last generate call;
- **reasoning**: ``yes`` when the answer has a ``<think>`` block or at least
  :data:`REASONING_WORDS` words before its last sentence, else ``no``;
- **answer**: its form: ``boxed`` (``\\boxed{}``), ``####`` (GSM8K's marker), ``number`` (a
  number in its last :data:`TAIL` characters), ``text`` or ``empty``;
- **length**: ``short`` (under :data:`SHORT` tokens), ``medium`` (under :data:`LONG`) or
  ``long``, from the response's tokens (else its words).

Two answers with other openers, filler words and numbers but the same form land together
(``Final answer: 42`` and ``So we get 7!``); an answer with a tool call and one without, or
with reasoning and without, stay apart. The exact-template signature
(:mod:`tracer.readers.habits.signature`) stays the finer level.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

REASONING_WORDS = 25
TAIL = 40
SHORT, LONG = 64, 512
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n+")
_NUMBER = re.compile(r"[0-9]")
_BOXED = re.compile(r"\\boxed\s*\{")


def answer_form(text: str) -> str:
    tail = text.strip()[-TAIL:]
    if _BOXED.search(text):
        return "boxed"
    if "####" in text:
        return "####"
    if _NUMBER.search(tail):
        return "number"
    return "text" if tail else "empty"


def reasoning(text: str) -> bool:
    if "<think>" in text or "</think>" in text:
        return True
    sentences = [s for s in _SENTENCE.split(text.strip()) if s.strip()]
    return sum(len(s.split()) for s in sentences[:-1]) >= REASONING_WORDS


def length_class(tokens: float | None, text: str) -> str:
    n = tokens if tokens is not None else 1.3 * len(text.split())
    return "short" if n < SHORT else "medium" if n < LONG else "long"


def behaviour(tools: Iterable[str | None], finish_reason: str | None, answer: str | None,
              response_tokens: float | None) -> str:  # fmt: skip
    """The behaviour of one trajectory (module docstring), one line."""
    text = answer or ""
    names = sorted({str(t or "?") for t in tools})
    return (f"tools: {', '.join(names) or 'none'} | finish: {finish_reason or '-'} | "
            f"reasoning: {'yes' if reasoning(text) else 'no'} | answer: {answer_form(text)} | "
            f"length: {length_class(response_tokens, text)}")  # fmt: skip
