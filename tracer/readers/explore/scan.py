"""Search before the index is ready: a bounded scan of the export's text with DuckDB.

The search index takes minutes to build over a million trajectories (FACTS.md: 93 s for 10M
documents); a search typed meanwhile is answered by ``ILIKE`` over the same fields the index
holds (prompts, responses, tool arguments, tool results), with a row limit and a time bound.
Its answer is marked partial: hits are in the export's order, not ranked; every word must
appear (a ``"phrase"`` as written, a ``-word`` must not), as a substring, case-insensitive; and
when the time bound is reached the hits found so far are returned (``timed_out``). Only one
scan runs at a time, so retries cannot pile up on the CPU.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

from tracer.readers.explore.filters import ApiError, like_pattern

SCAN_SECONDS = 4.0  # the bound is 5 s at a million trajectories
MAX_TERMS = 8
FRAGMENT_CHARS = 240
_LOCK = threading.BoundedSemaphore(1)

# kind -> (table, text expression, index column), as the index's SOURCES
FIELDS = {
    "prompt": ("trajectories", "prompt", "NULL"),
    "response": ("turns", "response_text", "turn_index"),
    "arguments": ("tool_calls", "concat_ws(' ', name, arguments)", "call_index"),
    "result": ("tool_calls", "concat_ws(' ', result, error)", "call_index"),
}


def terms(q: str) -> tuple[list[str], list[str]]:
    """``q`` as (words or phrases that must appear, those that must not); the index's
    operators ``AND``/``OR`` are dropped (every word must appear)."""
    must: list[str] = []
    must_not: list[str] = []
    for m in re.finditer(r'(-?)"([^"]+)"|(-?)(\S+)', q):
        neg = m.group(1) or m.group(3)
        text = m.group(2) if m.group(2) is not None else m.group(4).strip('"')
        if not text or (m.group(4) in ("AND", "OR") and not neg):
            continue
        (must_not if neg else must).append(text)
    if not must:
        raise ApiError("q: give the words to search for")
    if len(must) + len(must_not) > MAX_TERMS:
        raise ApiError(f"q: at most {MAX_TERMS} words while the index is being built")
    return must, must_not


def scan(store: Any, run: str, q: str, page: int, size: int, kind: str | None,
         step: int | None, seconds: float = SCAN_SECONDS) -> dict[str, Any]:  # fmt: skip
    """Hits of ``q`` found by scanning run ``run``'s tables, in the index's answer shape, plus
    ``partial`` (always true here) and ``scan`` (what was scanned, how long, ``timed_out``)."""
    must, must_not = terms(q)
    kinds = [kind] if kind else list(FIELDS)
    want = (page + 1) * size + 1  # one more than the page: is there a next one?
    t0 = time.perf_counter()
    if not _LOCK.acquire(timeout=seconds):
        raise ApiError("another search is scanning the export; try again in a moment", 503)
    hits: list[dict[str, Any]] = []
    timed_out = False
    try:
        for k in kinds:
            left = seconds - (time.perf_counter() - t0)
            if left <= 0 or len(hits) >= want:
                timed_out = left <= 0
                break
            table, text, index = FIELDS[k]
            if table not in store.runs[run].tables:
                continue
            cond = [f"{text} ILIKE ? ESCAPE '\\'" for _ in must]
            cond += [f"coalesce({text}, '') NOT ILIKE ? ESCAPE '\\'" for _ in must_not]
            params: list[Any] = [like_pattern(t) for t in (*must, *must_not)]
            if step is not None:
                cond.append("step = ?")
                params.append(step)
            try:
                rows = store.query(f"SELECT trace_id, step, {index} AS idx, {text} AS text FROM "
                                   f"{store.table(run, table)} WHERE {' AND '.join(cond)} "
                                   f"LIMIT {want - len(hits)}", params, timeout=left)  # fmt: skip
            except TimeoutError:
                timed_out = True
                break
            for r in rows:
                fragment, ranges = _fragment(r["text"] or "", must)
                hits.append({"trace_id": r["trace_id"], "score": None, "step": r["step"],
                             "in": k, "index": r["idx"], "fragment": fragment,
                             "highlighted": ranges})  # fmt: skip
    finally:
        _LOCK.release()
    more = len(hits) >= want or timed_out
    return {"q": q, "total": len(hits), "total_at_least": more, "page": page, "size": size,
            "hits": hits[page * size:(page + 1) * size], "partial": True,
            "scan": {"seconds": round(time.perf_counter() - t0, 3), "timed_out": timed_out,
                     "limit": want}}  # fmt: skip


def _fragment(text: str, words: list[str]) -> tuple[str, list[list[int]]]:
    """Up to ``FRAGMENT_CHARS`` characters around the first match, and the character ranges
    of every word's matches in it (as the index's snippets give them)."""
    pattern = re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)),
                         re.IGNORECASE)  # fmt: skip
    first = pattern.search(text)
    start = max(0, (first.start() if first else 0) - FRAGMENT_CHARS // 4)
    fragment = text[start:start + FRAGMENT_CHARS]
    return fragment, [[m.start(), m.end()] for m in pattern.finditer(fragment)]
