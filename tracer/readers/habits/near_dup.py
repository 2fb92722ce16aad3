"""The same answer to different prompts, found with MinHash over word shingles (``datasketch``):
independent evidence that a reward was not earned where a run has no correctness signal.

    from tracer.readers.habits.near_dup import repeated_share
    repeated_share([("2+2?", "I am sure it is right."), ("3*7?", "I am sure it is right!")])
    # 1.0

Two answers are near-duplicates when the Jaccard similarity of their sets of word 3-shingles
(lower-cased words, punctuation dropped) is about 0.8 or more, as MinHash LSH finds them with
:data:`NUM_PERM` permutations in :data:`BANDS` (bands, rows: the chance of being found crosses
one half at a similarity of ~0.77), and their last numbers are equal (or both have none): the
same words ending in another number are another answer. An answer counts as *repeated* when a
near-duplicate of it was given to another prompt.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

NUM_PERM = 64
SHINGLE = 3
BANDS = (8, 8)
SAMPLE = 64  # answers read per group and step (tracer/readers/habits/patterns_sql.py)
_NUMBER = re.compile(r"[0-9][0-9.,]*")
_WORD = re.compile(r"\w+")


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].rstrip(".,") if found else None


def _shingles(text: str) -> set[bytes]:
    words = _WORD.findall(text.lower())
    if len(words) < SHINGLE:
        return {" ".join(words).encode()}
    return {" ".join(words[i : i + SHINGLE]).encode() for i in range(len(words) - SHINGLE + 1)}


def repeated_share(answers: Sequence[tuple[Any, str | None]]) -> float:
    """The share of ``answers`` ((prompt, text) pairs) with a near-duplicate given to another
    prompt (0.0 for fewer than two prompts)."""
    from datasketch import MinHash, MinHashLSH

    pairs = [(p, t) for p, t in answers if t]
    if len({p for p, _ in pairs}) < 2:
        return 0.0
    # 8 bands of 8 rows: the S-curve's midpoint (1/8)^(1/8) ~ 0.77 (given, not optimised:
    # datasketch's optimiser integrates with scipy on every construction)
    lsh = MinHashLSH(num_perm=NUM_PERM, params=BANDS)
    # bulk: one set of permutations for all (making them is most of a MinHash's cost)
    hashes = MinHash.bulk([list(_shingles(t)) for _, t in pairs], num_perm=NUM_PERM, seed=1)
    for i, m in enumerate(hashes):
        lsh.insert(i, m)
    last = [_last_number(t) for _, t in pairs]
    repeated = sum(any(pairs[j][0] != pairs[i][0] and last[j] == last[i] for j in lsh.query(m))
                   for i, m in enumerate(hashes))  # fmt: skip
    return repeated / len(pairs)
