"""Full-text search inside messages: a tantivy index over each trajectory's prompt, responses,
tool arguments and tool results, built once per export (rebuilt when the export's files change)
and kept in a cache folder, never in the export itself (the explorer only reads that).

One index document per prompt (trajectory), response (turn), tool call's arguments and tool
call's result (with its error), so a hit names the turn or tool call it is in; the query
language is tantivy's (words, ``"a phrase"``, ``AND``/``OR``/``-``).
A substring scan of the Parquet text is 2-3 s for a million trajectories on 2 cores (FACTS.md);
the index answers in milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any

from tracer.readers.explore.filters import ApiError

KINDS = ("prompt", "response", "arguments", "result")
MAX_QUERY_CHARS = 500
INDEX_VERSION = 2


def signature(path: str) -> str:
    """Changes whenever the export's Parquet files do (size and modification time)."""
    parts = [os.path.abspath(path)]
    for name in ("trajectories", "turns", "tool_calls"):
        st = os.stat(os.path.join(path, f"{name}.parquet"))
        parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def _schema() -> Any:
    import tantivy

    b = tantivy.SchemaBuilder()
    # ids and kinds are matched whole: no term frequencies or positions to write
    b.add_text_field("trace_id", stored=True, tokenizer_name="raw", index_option="basic")
    b.add_integer_field("step", stored=True, indexed=True, fast=True)
    b.add_text_field("kind", stored=True, tokenizer_name="raw", index_option="basic")
    b.add_integer_field("index", stored=True)
    b.add_text_field("text", stored=True)
    return b.build()


# (table, text expression columns, kind, index column): one index document per row and field
SOURCES = (
    ("trajectories", ("prompt",), "prompt", None),
    ("turns", ("response_text",), "response", "turn_index"),
    ("tool_calls", ("name", "arguments"), "arguments", "call_index"),
    ("tool_calls", ("result", "error"), "result", "call_index"),
)


def _documents(path: str) -> Any:
    """(trace_id, step, kind, index, text) for every row of every text field, streamed one
    record batch at a time with pyarrow (no join: each hit names its turn or tool call)."""
    import pyarrow.parquet as pq

    for table, columns, kind, index in SOURCES:
        wanted = ["trace_id", "step", *columns] + ([index] if index else [])
        f = pq.ParquetFile(os.path.join(path, f"{table}.parquet"))
        for batch in f.iter_batches(batch_size=8192, columns=wanted):
            cols = batch.to_pydict()
            idx = cols[index] if index else [None] * batch.num_rows
            texts = [cols[c] for c in columns]
            for i, (tid, step) in enumerate(zip(cols["trace_id"], cols["step"], strict=True)):
                text = " ".join(t[i] for t in texts if t[i])
                if text:
                    yield tid, step, kind, idx[i], text


def expected_documents(path: str) -> int:
    """The index's documents at most: a row per text field (empty ones are left out)."""
    import pyarrow.parquet as pq

    return sum(pq.ParquetFile(os.path.join(path, f"{table}.parquet")).metadata.num_rows
               for table, *_ in SOURCES)  # fmt: skip


class SearchIndex:
    """The index of one export folder (``path``) under ``cache_dir``."""

    def __init__(self, path: str, cache_dir: str) -> None:
        self.path = path
        self.dir = os.path.join(cache_dir, "search", f"{signature(path)}-v{INDEX_VERSION}")
        self.index: Any = None
        self.info: dict[str, Any] = {}
        self.docs_done = 0  # while building: documents added, of about docs_expected
        self.docs_expected = 0

    def ready(self) -> bool:
        return self.index is not None

    def percent(self) -> int:
        """How far the build is (0 before it starts; documents added over the text rows)."""
        if self.ready():
            return 100
        return min(99, 100 * self.docs_done // self.docs_expected) if self.docs_expected else 0

    def open_or_build(self, progress: Callable[[int], None] | None = None,
                      stop: threading.Event | None = None) -> dict[str, Any]:  # fmt: skip
        """Open the index, building it first if this export has none yet (``stop`` ends a
        build early: InterruptedError)."""
        try:
            import tantivy
        except ImportError:  # one line in the log and the header, not a traceback
            raise RuntimeError("tantivy is not installed: pip install "
                               "'rollout-tracer[explore]'") from None  # fmt: skip

        meta = os.path.join(self.dir, "built.json")
        if not os.path.exists(meta):
            self._build(progress, stop)
        with open(meta, encoding="utf-8") as f:
            self.info = json.load(f)
        self.index = tantivy.Index.open(self.dir)
        return self.info

    def _build(self, progress: Callable[[int], None] | None,
               stop: threading.Event | None = None) -> None:  # fmt: skip
        import tantivy

        tmp = self.dir + ".building"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        t0 = time.perf_counter()
        index = tantivy.Index(_schema(), path=tmp)
        self.docs_done, self.docs_expected = 0, expected_documents(self.path)
        # the build runs inside the server: a smaller heap keeps its peak memory down, at no
        # measurable cost in time (benchmarks/RESULTS.md section 10)
        writer = index.writer(heap_size=128_000_000, num_threads=2)
        docs = 0
        for tid, step, kind, idx, text in _documents(self.path):
            doc = tantivy.Document(trace_id=tid, kind=kind, text=text)
            if step is not None:
                doc.add_integer("step", step)
            if idx is not None:
                doc.add_integer("index", idx)
            writer.add_document(doc)
            docs += 1
            if docs % 2_000 == 0:
                self.docs_done = docs
            if docs % 10_000 == 0:
                _check(stop)
                if progress is not None:
                    progress(10_000)
        _check(stop)
        writer.commit()
        writer.wait_merging_threads()
        size = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
        info = {"docs": docs, "build_s": round(time.perf_counter() - t0, 2), "bytes": size}
        with open(os.path.join(tmp, "built.json"), "w", encoding="utf-8") as f:
            json.dump(info, f)
        shutil.rmtree(self.dir, ignore_errors=True)
        os.replace(tmp, self.dir)

    @staticmethod
    def check(q: str, kind: str | None) -> str:
        """``q`` stripped, or an ApiError saying what is wrong with the query."""
        q = (q or "").strip()
        if not q:
            raise ApiError("q: give the words to search for")
        if len(q) > MAX_QUERY_CHARS:
            raise ApiError(f"q: longer than {MAX_QUERY_CHARS} characters")
        if kind is not None and kind not in KINDS:
            raise ApiError(f"in: {kind!r} is not one of {', '.join(KINDS)}")
        return q

    def search(self, q: str, page: int, size: int, kind: str | None = None,
               step: int | None = None) -> dict[str, Any]:  # fmt: skip
        """Hits (one per turn, tool call or prompt), best first, each with its fragment and
        the highlighted character ranges in it."""
        import tantivy

        if self.index is None:
            raise ApiError("the search index is still being built; try again shortly", 503)
        q = self.check(q, kind)
        try:
            query = self.index.parse_query(q, ["text"])
        except ValueError as exc:
            raise ApiError(f"q: cannot parse {q!r}: {exc}") from None
        schema = self.index.schema
        must = [(tantivy.Occur.Must, query)]
        if kind is not None:
            must.append((tantivy.Occur.Must, tantivy.Query.term_query(schema, "kind", kind)))
        if step is not None:
            must.append((tantivy.Occur.Must, tantivy.Query.range_query(
                schema, "step", tantivy.FieldType.Integer, step, step)))  # fmt: skip
        full = tantivy.Query.boolean_query(must) if len(must) > 1 else query
        searcher = self.index.searcher()
        result = searcher.search(full, size, count=True, offset=page * size)
        snippets = tantivy.SnippetGenerator.create(searcher, query, schema, "text")
        snippets.set_max_num_chars(240)
        hits = []
        for score, address in result.hits:
            doc = searcher.doc(address)
            snip = snippets.snippet_from_doc(doc)
            fragment = snip.fragment()
            hits.append({"trace_id": _first(doc, "trace_id"), "score": round(score, 3),
                         "step": _first(doc, "step"), "in": _first(doc, "kind"),
                         "index": _first(doc, "index"), "fragment": fragment,
                         "highlighted": _char_ranges(fragment, snip.highlighted())})  # fmt: skip
        return {"q": q, "total": result.count, "page": page, "size": size, "hits": hits}


def _check(stop: threading.Event | None) -> None:
    if stop is not None and stop.is_set():
        raise InterruptedError("the explorer is stopping")


def _first(doc: Any, name: str) -> Any:
    values = doc.to_dict().get(name) or []
    return values[0] if values else None


def _char_ranges(text: str, ranges: Any) -> list[list[int]]:
    """tantivy's highlighted ranges are UTF-8 byte offsets; the page indexes characters."""
    raw = text.encode()
    return [[len(raw[: r.start].decode(errors="ignore")), len(raw[: r.end].decode(errors="ignore"))]
            for r in ranges]  # fmt: skip
