"""Helpers for the explorer's tests: a generated export served by a real HTTP server."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.explore_data import generate
from tracer.readers.explore.search import SearchIndex
from tracer.readers.explore.server import Explorer, make_server, serve_in_thread
from tracer.readers.explore.store import Run, Store


def make_export(folder: Path, n: int, seed: int = 0, tokens_per_turn: int = 4,
                short_text: bool = True) -> Path:  # fmt: skip
    """A generated export; short texts unless a test needs text of realistic length (they
    make the files, the index and the copies several times smaller: quicker tests)."""
    generate(str(folder), n, tokens_per_turn=tokens_per_turn, seed=seed, short_text=short_text)
    return folder


@contextmanager
def serving(runs: list[tuple[str, Path]], cache: Path, search: int = 1,
            host: str = "127.0.0.1") -> Iterator[str]:  # fmt: skip
    """Serve the export folders on ``host`` (a free port), the first ``search`` of them with
    a search index; yields the base URL."""
    store = Store([Run(name, str(path), set()) for name, path in runs])
    explorer = Explorer(store)
    if search:
        explorer.indexes = {name: SearchIndex(str(path), str(cache))
                            for name, path in runs[:search]}  # fmt: skip
        explorer.build_indexes(cache_dir=str(cache))
    with served(explorer, host) as base:
        yield base


@contextmanager
def served(explorer: Explorer, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``explorer`` on ``host`` (a free port); yields the base URL."""
    server = make_server(explorer, host, 0)
    serve_in_thread(server)
    try:
        yield f"http://{'[' + host + ']' if ':' in host else host}:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def get(base: str, path: str, **params: Any) -> tuple[int, Any]:
    """GET ``base + path`` with ``params`` (lists repeat a parameter): (status, JSON body)."""
    pairs = [(k, v) for k, vs in params.items() for v in (vs if isinstance(vs, list) else [vs])]
    url = base + path + ("?" + urllib.parse.urlencode(pairs) if pairs else "")
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
