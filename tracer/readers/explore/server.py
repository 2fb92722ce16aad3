"""The explorer's HTTP server: the page and a read-only JSON API (GET only).

    GET /api/runs                      the runs (export folders) served, with counts
    GET /api/list?step=3:7&reward=0:0.5&flag=truncated&sort=-reward&page=0&size=50&cols=...
                                       a page of trajectories, the total count, the reward
                                       histogram of the selection (bins: the run's reward
                                       range in 20, empty ends left out; filters:
                                       filters.py)
    GET /api/search?q=timeout&in=result&step=3&page=0&size=20
                                       hits in prompts, responses, tool arguments and results,
                                       with the highlighted fragment; while the index is built
                                       (or when it failed), a bounded scan's hits, marked
                                       ``partial`` (scan.py)
    GET /api/status                    per run: the search index (waiting, building with its
                                       percent, ready, failed and why, off), the compacted
                                       copy (waiting, building, done, failed and why, off) and
                                       the patterns (waiting, building with its percent, ready,
                                       failed and why)
    GET /api/trajectory?id=<trace_id>&step=3
                                       one trajectory: row, turns, tool calls, per-token values
                                       (step is optional: it makes the lookup read one step)
    GET /api/groups?step=3&validate=false&zero=true&page=0&size=20
                                       a step's GRPO groups, rewards and advantages
    GET /api/group?step=3&sample=7&validate=false
                                       one GRPO group's rollouts side by side: rewards,
                                       advantages, texts, word diffs against the best one
    GET /api/prompt?id=<trace_id> | ?prompt=<text>
                                       one prompt across steps, with the word diff between steps
    GET /api/steps                     metrics per step
    GET /api/patterns?step=40&top=10   behaviour patterns: the step's (default: the last)
                                       ranked by share, with reward mean and spread, mean
                                       length, tool-error rate, an example, labels and the
                                       share at every step; the run's rising ones with why.
                                       Computed once per export in the background (503 with
                                       its percent meanwhile; pattern_table.py)
    GET /api/compare?step=3&prompt=<text>  the same prompt at the same step in every run
    GET /api/timing?step=3&validate=false&top=100
                                       the Time tab (static/time.js): see time_view.py

Every endpoint takes ``run=<name>`` (default: the first). Errors are JSON ``{"error": ...}``
with status 400 (bad input), 404 (unknown run or id) or 503 (index still building); an
unexpected failure is a 500 with its message, and the server keeps serving.

Only this machine reads a run unless told otherwise: a request whose ``Host`` is not
127.0.0.1, localhost, [::1] or a name the server was given (any port), or whose ``Origin`` is
not the explorer's own, gets 403. A page on another site that rebinds its domain to 127.0.0.1
(DNS rebinding) sends its own domain as ``Host``, so it cannot read a prompt or a response.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlparse

import orjson

from tracer.readers.explore import across, steps, time_view
from tracer.readers.explore.cache import prune_folder
from tracer.readers.explore.filters import ApiError, parse_int
from tracer.readers.explore.pattern_table import PatternTables
from tracer.readers.explore.scan import SCAN_SECONDS, scan
from tracer.readers.explore.search import SearchIndex
from tracer.readers.explore.store import KEEP_COMPACTED, Store

log = logging.getLogger(__name__)
MAX_PAGE_SIZE = 500
MAX_PAGE = 1_000_000
MAX_URL = 8192
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


class Explorer:
    """The store, the runs' search indexes, and the API's dispatch (usable without HTTP)."""

    def __init__(self, store: Store, indexes: dict[str, SearchIndex] | None = None,
                 earned_by: str | None = None) -> None:  # fmt: skip
        self.store = store
        self.indexes = indexes or {}
        self.index_errors: dict[str, str] = {}
        # why runs without an index have none: --no-search, or tantivy is not installed
        self.search_off: str | None = "search is off (no index was given)"
        # per run: off (no cache folder), waiting, building, done, or "failed: why"
        self.compaction: dict[str, str] = dict.fromkeys(store.runs, "off")
        self.scan_seconds = SCAN_SECONDS
        self.patterns = PatternTables(store, earned_by)  # built on first request/build_indexes

    def build_indexes(self, progress: Any = None, cache_dir: str | None = None) -> None:
        """Once per export, in the background: the compacted tables (``cache_dir``), the
        behaviour patterns, then the search indexes."""
        if cache_dir:
            self.patterns.use_cache(cache_dir)
            self.compaction = dict.fromkeys(self.store.runs, "waiting")
            for name in list(self.store.runs):
                self.compaction[name] = "building"
                try:
                    self.store.compact(name, cache_dir)
                    self.compaction[name] = "done"
                except Exception as exc:  # the original files keep serving
                    self.compaction[name] = f"failed: {type(exc).__name__}: {exc}"
                    if self.store.stop.is_set():
                        return
                    log.warning("compacting run %s failed: %s", name, exc)
        self.patterns.build_all()
        if self.store.stop.is_set():
            return
        for name, index in self.indexes.items():
            try:
                index.open_or_build(progress, self.store.stop)
            except Exception as exc:  # the list and every other view keep working
                if self.store.stop.is_set():
                    return
                self.index_errors[name] = f"{type(exc).__name__}: {exc}"
                log.warning("search index of run %s failed: %s", name, exc)
        if cache_dir:
            self.prune_indexes(cache_dir)

    def prune_indexes(self, cache_dir: str) -> list[str]:
        """Delete the cache folder's search indexes beyond ``KEEP_COMPACTED`` besides those in
        use (each export, and each refresh of one, has its own)."""
        keep = {os.path.basename(ix.dir) for ix in self.indexes.values()}
        return prune_folder(os.path.join(cache_dir, "search"), keep, KEEP_COMPACTED)

    def close(self) -> None:
        """Stop background work: the store's and the patterns'."""
        self.store.close()
        self.patterns.close()

    def handle(self, path: str, query: dict[str, list[str]]) -> Any:
        route = ROUTES.get(path)
        if route is None:
            raise ApiError(f"no endpoint {path!r}; endpoints: {', '.join(ROUTES)}", 404)
        allowed = route[1]
        unknown = sorted(set(query) - allowed - {"run"})
        if unknown:
            raise ApiError(f"unknown parameter {unknown[0]!r} for {path}; valid: "
                           f"{', '.join(sorted(allowed | {'run'}))}")  # fmt: skip
        return route[0](self, query)

    def _runs(self, q: dict[str, list[str]]) -> Any:
        runs = self.store.run_list()
        for r in runs:
            idx = self.indexes.get(r["name"])
            if r["name"] in self.index_errors:
                r["search"] = "error: " + self.index_errors[r["name"]]
            else:
                r["search"] = "off" if idx is None else "ready" if idx.ready() else "building"
            r["index"] = idx.info if idx and idx.ready() else None
        return {"runs": runs}

    def _status(self, q: dict[str, list[str]]) -> Any:
        """What the background work has reached, for the page's header (it polls this)."""
        out: list[dict[str, Any]] = []
        for name in self.store.runs:
            state, _, why = self.compaction.get(name, "off").partition(": ")
            out.append({"name": name, "search": self._search_state(name),
                        "compaction": {"state": state, "error": why or None},
                        "patterns": self.patterns.status(name)})  # fmt: skip
        # patterns waiting: nobody asked for them (build_indexes computes them after the copy)
        done = all(r["search"]["state"] in ("ready", "failed", "off")
                   and r["compaction"]["state"] in ("done", "failed", "off")
                   and r["patterns"]["state"] != "building" for r in out)
        return {"runs": out, "settled": done}

    def _search_state(self, name: str) -> dict[str, Any]:
        idx = self.indexes.get(name)
        if name in self.index_errors:
            return {"state": "failed", "percent": None, "error": self.index_errors[name]}
        if idx is None:
            return {"state": "off", "percent": None, "error": self.search_off}
        if idx.ready():
            return {"state": "ready", "percent": 100, "error": None}
        return {"state": "building" if idx.docs_expected else "waiting",
                "percent": idx.percent(), "error": None}  # fmt: skip

    def _list(self, q: dict[str, list[str]]) -> Any:
        if q.get("signature") and not self.store.has_column(_one(q, "run"), "signature"):
            raise ApiError("signature: this export has no signature column (exported before "
                           "behaviour signatures existed): export the run again")  # fmt: skip
        return self.store.list_page(q, _one(q, "run"), parse_int(q, "page", 0, 0, MAX_PAGE),
                               parse_int(q, "size", 50, 1, MAX_PAGE_SIZE), _one(q, "sort"),
                               _one(q, "cols"), _one(q, "hist") != "false")  # fmt: skip

    def _patterns(self, q: dict[str, list[str]]) -> Any:
        run = _one(q, "run") or next(iter(self.store.runs))
        self.store.table(run, "trajectories")  # unknown run -> 404
        step = parse_int(q, "step", 0, -(2**62), 2**62) if _one(q, "step") else None
        top = parse_int(q, "top", 10, 1, 100)
        return self.patterns.answer(run, step, top)

    def _search(self, q: dict[str, list[str]]) -> Any:
        run = _one(q, "run") or next(iter(self.store.runs))
        self.store.table(run, "trajectories")  # unknown run -> 404
        index = self.indexes.get(run)
        if index is None:
            raise ApiError(self.search_off or "search is off", 503)
        step = parse_int(q, "step", -1, -(2**62), 2**62) if _one(q, "step") else None
        args = (_one(q, "q") or "", parse_int(q, "page", 0, 0, 10_000),
                parse_int(q, "size", 20, 1, 200), _one(q, "in"), step)  # fmt: skip
        if index.ready():
            return index.search(*args)
        # the index is being built, or failed: a bounded scan answers meanwhile. The state is
        # read once, before the scan: the build may finish while the scan runs
        state = self._search_state(run)
        text, page, size, kind, step = args
        index.check(text, kind)
        out = scan(self.store, run, text.strip(), page, size, kind, step, self.scan_seconds)
        out["index"] = {"failed": f"failed: {state['error']}", "waiting": "waiting to build",
                        "building": f"building ({state['percent']} %)",
                        "ready": "ready"}[state["state"]]
        return out

    def _trajectory(self, q: dict[str, list[str]]) -> Any:
        step = parse_int(q, "step", 0, -(2**62), 2**62) if _one(q, "step") else None
        return self.store.trajectory(_one(q, "run"), _required(q, "id"), step)

    def _groups(self, q: dict[str, list[str]]) -> Any:
        step = parse_int(q, "step", 0, -(2**62), 2**62)
        if _one(q, "step") is None:
            raise ApiError("step: required (the training step whose groups to show)")
        return steps.groups(self.store, _one(q, "run"), step, _flag(q, "validate", False),
                            parse_int(q, "page", 0, 0, MAX_PAGE), parse_int(q, "size", 20, 1, 200),
                            _flag(q, "zero", False))  # fmt: skip

    def _group(self, q: dict[str, list[str]]) -> Any:
        if _one(q, "step") is None:
            raise ApiError("step: required (the training step of the group)")
        return across.group(self.store, _one(q, "run"), parse_int(q, "step", 0, -(2**62), 2**62),
                            _required(q, "sample"), _flag(q, "validate", False))  # fmt: skip

    def _prompt(self, q: dict[str, list[str]]) -> Any:
        step = parse_int(q, "step", 0, -(2**62), 2**62) if _one(q, "step") else None
        return across.prompt(self.store, _one(q, "run"), _one(q, "id"), _one(q, "prompt"),
                            step)  # fmt: skip

    def _steps(self, q: dict[str, list[str]]) -> Any:
        return {"steps": steps.steps(self.store, _one(q, "run"))}

    def _compare(self, q: dict[str, list[str]]) -> Any:
        step = parse_int(q, "step", 0, -(2**62), 2**62)
        text = _one(q, "prompt")
        if not text:
            if not _one(q, "id"):
                raise ApiError("compare: give prompt=<text> or id=<trace id>, and step")
            row = self.store.locate(_one(q, "run"), _required(q, "id"))
            text, step = row["prompt"], row["step"] if _one(q, "step") is None else step
        return across.compare(self.store, step, text)


def _one(q: dict[str, list[str]], name: str) -> str | None:
    values = q.get(name)
    return values[-1] if values else None


def _required(q: dict[str, list[str]], name: str) -> str:
    value = _one(q, name)
    if not value:
        raise ApiError(f"{name}: required")
    return value


def _flag(q: dict[str, list[str]], name: str, default: bool) -> bool:
    raw = _one(q, name)
    if raw is None or raw == "":
        return default
    if raw.lower() not in ("true", "false", "1", "0"):
        raise ApiError(f"{name}: {raw[:50]!r} is not true or false")
    return raw.lower() in ("true", "1")


_LIST = {"page", "size", "sort", "cols", "hist", "step", "reward", "validate", "finish_reason",
         "worker_id", "kept_by", "policy_version", "status", "sample_key", "experiment_name",
         "name", "trace_id", "signature", "behaviour", "flag", "tool_errors", "f"}  # fmt: skip
ROUTES: dict[str, tuple[Any, set[str]]] = {
    "/api/runs": (Explorer._runs, set()),
    "/api/status": (Explorer._status, set()),
    "/api/list": (Explorer._list, _LIST),
    "/api/search": (Explorer._search, {"q", "in", "step", "page", "size"}),
    "/api/trajectory": (Explorer._trajectory, {"id", "step"}),
    "/api/groups": (Explorer._groups, {"step", "validate", "zero", "page", "size"}),
    "/api/group": (Explorer._group, {"step", "sample", "validate"}),
    "/api/prompt": (Explorer._prompt, {"id", "prompt", "step"}),
    "/api/steps": (Explorer._steps, set()),
    "/api/patterns": (Explorer._patterns, {"step", "top"}),
    "/api/compare": (Explorer._compare, {"step", "prompt", "id"}),
    "/api/timing": (lambda ex, q: time_view.api(ex.store, q), {"step", "validate", "top"}),
}


# the page and its scripts (static/; package data), by URL path: nothing else is served
STATIC = {"/": "explore.html", "/index.html": "explore.html", "/patterns.js": "patterns.js",
          "/time.js": "time.js"}
TYPES = {"html": "text/html; charset=utf-8", "js": "text/javascript; charset=utf-8"}


def page_html(name: str = "explore.html") -> bytes:
    return resources.files("tracer.readers.explore").joinpath("static", name).read_bytes()


def host_name(value: str) -> str:
    """The host of a ``Host`` header or an origin's authority, without its port, lower case
    (``[::1]:8765`` -> ``::1``)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only."""
    if host_name(host) == "localhost":
        return True
    try:
        return ipaddress.ip_address(host_name(host)).is_loopback
    except ValueError:
        return False


class Handler(BaseHTTPRequestHandler):
    explorer: Explorer
    allowed_hosts: frozenset[str] = LOOPBACK_NAMES
    server_version = "rollout-tracer-explore"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        # orjson writes NaN/inf as null (JSON has neither) and datetimes as ISO 8601
        body = orjson.dumps(obj, default=str, option=orjson.OPT_NON_STR_KEYS)
        self._send(status, body, "application/json; charset=utf-8")

    def _foreign(self) -> str | None:
        """Why the request is refused (a Host or Origin not this explorer's), or None."""
        host = self.headers.get("Host")
        if host is None or host_name(host) not in self.allowed_hosts:
            return (f"Host {host!r} is not one this explorer serves "
                    f"({', '.join(sorted(self.allowed_hosts))}; see --allow-host)")  # fmt: skip
        origin = self.headers.get("Origin")
        if origin is not None and origin.lower() != f"http://{host.strip().lower()}":
            return f"Origin {origin!r} is not this explorer's (http://{host})"
        return None

    def do_GET(self) -> None:
        refused = self._foreign()
        if refused:
            self._json(403, {"error": refused})
            return
        if len(self.path) > MAX_URL:
            self._json(414, {"error": f"URL longer than {MAX_URL} characters"})
            return
        url = urlparse(self.path)
        name = STATIC.get(url.path)
        if name:
            self._send(200, page_html(name), TYPES[name.rsplit(".", 1)[1]])
            return
        try:
            query = parse_qs(url.query, keep_blank_values=True, max_num_fields=100)
            self._json(200, self.explorer.handle(url.path, query))
        except ApiError as exc:
            self._json(exc.status, {"error": str(exc)})
        except ValueError as exc:  # parse_qs: too many fields, bad encoding
            self._json(400, {"error": f"bad request: {exc}"})
        except Exception as exc:  # a bug or an unreadable file: say so, keep serving
            log.exception("explore: %s failed", url.path)
            self._json(500, {"error": f"internal error: {type(exc).__name__}: {exc}"})

    def _read_only(self) -> None:
        refused = self._foreign()
        if refused:
            self._json(403, {"error": refused})
        else:
            self._json(405, {"error": "read-only: only GET is served"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _read_only


def make_server(explorer: Explorer, host: str = "127.0.0.1", port: int = 0,
                allow_hosts: tuple[str, ...] = ()) -> ThreadingHTTPServer:  # fmt: skip
    """A server bound to ``host:port`` (0: any free port); call ``serve_forever``. It answers
    requests whose Host is a loopback name, ``host`` itself (unless a wildcard such as 0.0.0.0)
    or one of ``allow_hosts``."""
    names = set(LOOPBACK_NAMES) | {host_name(h) for h in allow_hosts}
    if host_name(host) not in ("0.0.0.0", "::", ""):
        names.add(host_name(host))
    handler = type("ExploreHandler", (Handler,), {"explorer": explorer,
                                                  "allowed_hosts": frozenset(names)})
    cls = _Server6 if ":" in host else ThreadingHTTPServer
    server = cls((host, port), handler)
    server.daemon_threads = True
    return server


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def serve_in_thread(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name="explore-http", daemon=True)
    thread.start()
    return thread
