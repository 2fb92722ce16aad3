"""``rollout-tracer explore``: a local, read-only web app over a run's exported tables.

    rollout-tracer explore --from parquet --path exports/gsm8k
    rollout-tracer explore --from mlflow --tracking-uri sqlite:///mlflow.db --experiment gsm8k
    rollout-tracer explore --from parquet --path exports/run-a --compare exports/run-b

An MLflow, JSONL or Weave source is first exported into a cache folder (with a progress bar);
``--refresh S`` exports it again every S seconds while a run goes on and switches the views to
the new tables when the export is complete (a whole re-export, simple and always consistent).
The compacted copy, the behaviour patterns and the search index are built in the background
on first use of an export and cached.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import socket
import sys
import threading
import time
from typing import Any

from rollout.export_cli import (
    _add_source_args,
    _source_kwargs,
    check_source,
    missing_extra,
    token_note,
)

SEARCH_OFF = "search is off (started with --no-search)"


def configure_explore(p: argparse.ArgumentParser) -> None:
    _add_source_args(p, parquet=True)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; any other "
                   "needs --allow-host)")  # fmt: skip
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a host name or address browsers use to reach the explorer (their "
                   "Host header; repeatable); needed with a --host that is not loopback, "
                   "whereupon anyone on the network who can reach it reads the run")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0: any free)")
    p.add_argument("--compare", action="append", default=[], metavar="[NAME=]DIR",
                   help="another export folder to open side by side (repeatable)")  # fmt: skip
    p.add_argument("--cache-dir", help="where exports of mlflow/jsonl sources and search "
                   "indexes go (default: $XDG_CACHE_HOME or ~/.cache, /rollout-tracer/explore)")
    p.add_argument("--no-search", action="store_true", help="no search index")
    p.add_argument("--refresh", type=float, default=0.0, metavar="S",
                   help="re-export an mlflow/jsonl/weave source every S seconds (0: never)")
    p.add_argument("--mlflow-ui", default="http://127.0.0.1:5000", help="MLflow UI base URL "
                   "for links to traces (what `rollout-tracer ui` serves)")  # fmt: skip


def cache_dir(arg: str | None) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return arg or os.path.join(base, "rollout-tracer", "explore")


def _export_key(args: argparse.Namespace) -> str:
    parts = [args.source, args.tracking_uri, args.path, args.experiment, args.entity,
             args.step, args.steps, args.validate, args.earned_by]  # fmt: skip
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def export_source(args: argparse.Namespace, out: str,
                  stop: threading.Event | None = None) -> Any:  # fmt: skip
    """Export the source into ``out`` with a progress bar; returns the export's summary.
    ``stop`` ends it early, after a page (InterruptedError)."""
    from tqdm import tqdm

    from tracer.readers import export

    tmp = out + ".part"
    bars: list[Any] = []  # made at the first page: a source that fails first (a missing
    # package, a wrong path) says one line, not a bar and then the line

    def on_page(n: int) -> None:
        if stop is not None and stop.is_set():
            raise InterruptedError("the explorer is stopping")
        if not bars:
            bars.append(tqdm(desc=f"exporting {args.source}", unit="traj",
                             disable=args.no_progress))  # fmt: skip
        bars[0].update(n)

    kwargs = _source_kwargs(args)
    try:
        summary = export(args.source, tmp, on_page=on_page, **kwargs)
    finally:
        for bar in bars:
            bar.close()
    token_note(kwargs["tokenizers"], summary.rows.get("tokens", 0))
    if os.path.isdir(out):
        old = out + f".old{time.time_ns()}"
        os.replace(out, old)
        os.replace(tmp, out)
        import shutil

        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    return summary


def _mlflow_link(args: argparse.Namespace) -> dict[str, str] | None:
    if args.source != "mlflow" or not args.experiment:
        return None
    from rollout.ui import experiment_id, resolve_tracking_uri

    exp = experiment_id(resolve_tracking_uri(args.tracking_uri), args.experiment)
    return None if exp is None else {"ui": args.mlflow_ui, "experiment_id": exp}


def _runs(args: argparse.Namespace, cache: str) -> tuple[list[Any], str | None]:
    from tracer.readers.explore.store import Run

    runs = []
    exported = None
    if args.source == "parquet":
        if not args.path:
            raise ValueError("--from parquet needs --path: the export folder")
        main = os.path.abspath(args.path)
        from tracer.readers.habits.patterns_sql import check_export_part

        check_export_part(main, args.earned_by)  # UnknownPart: a ValueError, one line
    else:
        exported = main = os.path.join(cache, "exports", _export_key(args))
        summary = export_source(args, main)
        print(f"exported {summary.rows['trajectories']} trajectories to {main}")
    runs.append(Run(os.path.basename(main.rstrip("/")) if args.source == "parquet"
                    else (args.experiment or args.source), main, set(), _mlflow_link(args)))
    for item in args.compare:
        name, _, path = item.rpartition("=") if "=" in item else ("", "", item)
        name = name or os.path.basename(os.path.abspath(path).rstrip("/"))
        if name in {r.name for r in runs}:
            name = f"{name}-{len(runs)}"
        runs.append(Run(name, os.path.abspath(path), set()))
    return runs, exported


def cmd_explore(args: argparse.Namespace) -> int:
    """Serve the explorer until Ctrl-C."""
    from tracer.readers.explore.search import SearchIndex
    from tracer.readers.explore.server import Explorer, make_server
    from tracer.readers.explore.store import Store

    t0 = time.perf_counter()
    named = args.experiment is not None
    problem = (_check_host(args) or missing_extra(("duckdb", "pyarrow"), "explore")
               or check_source(args))  # fmt: skip
    if problem:
        print(f"rollout-tracer explore: error: {problem}", file=sys.stderr)
        return 2
    if args.source in ("mlflow", "weave") and not named:
        print(f"reading {args.source} experiment {args.experiment!r} (the tracer's default "
              "project; --experiment NAME reads another)", flush=True)  # fmt: skip
    cache = cache_dir(args.cache_dir)
    try:
        runs, exported = _runs(args, cache)
        store = Store(runs)
        explorer = Explorer(store, earned_by=args.earned_by)
        server = make_server(explorer, args.host, args.port, tuple(args.allow_host))
    except (ValueError, NotImplementedError, FileNotFoundError, OSError) as exc:
        print(f"rollout-tracer explore: error: {exc}", file=sys.stderr)
        return 2
    explorer = server.RequestHandlerClass.explorer  # type: ignore[attr-defined]
    explorer.search_off = SEARCH_OFF if args.no_search else missing_extra(("tantivy",), "explore")
    if explorer.search_off is None:
        explorer.indexes = {r.name: SearchIndex(r.path, cache) for r in runs}
    elif not args.no_search:
        print(f"rollout-tracer explore: search is off: {explorer.search_off}", file=sys.stderr)
    workers = [threading.Thread(target=_build_indexes, args=(explorer, cache), daemon=True)]
    if exported and args.refresh > 0:
        workers.append(threading.Thread(target=_refresh_loop, daemon=True,
                                        args=(args, explorer, runs[0], cache)))  # fmt: skip
    for worker in workers:
        worker.start()
    host, port = str(server.server_address[0]), server.server_address[1]
    print(f"explore {', '.join(r.name for r in runs)}: http://{host}:{port}/ "
          f"(ready in {time.perf_counter() - t0:.1f} s; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        # the builders and the refresh stop at their next check; the interpreter must not
        # exit under them while they are inside DuckDB or Arrow (a daemon thread stopped in
        # C++ code at exit aborts the process)
        explorer.close()
        for worker in workers:
            worker.join(timeout=60)
    return 0


def _check_host(args: argparse.Namespace) -> str | None:
    """A --host other than loopback serves the run to the network: say so, and ask for the
    names browsers will use (the Host checks need them; a name is also a sign of intent)."""
    from tracer.readers.explore.server import is_loopback

    if is_loopback(args.host):
        return None
    print(f"rollout-tracer explore: warning: --host {args.host} makes this run (prompts, "
          "responses, tool arguments and results) readable by anyone on the network who can "
          "reach this machine", file=sys.stderr)  # fmt: skip
    if not args.allow_host:
        return (f"--host {args.host} needs --allow-host NAME: the host name or address "
                "browsers will use to reach the explorer (e.g. --allow-host "
                f"{socket.gethostname()}); repeat it for each name")  # fmt: skip
    return None


def _build_indexes(explorer: Any, cache: str) -> None:
    t0 = time.perf_counter()
    explorer.build_indexes(cache_dir=cache)
    for name in explorer.store.runs:
        table = explorer.patterns[name]
        if table.state == "ready":
            info = table.info
            how = "from the cache" if info.get("cached") else f"in {info['computed_s']} s"
            print(f"patterns of {name}: {info['groups']} (step, signature) groups of "
                  f"{info['steps']} steps ({how})", flush=True)  # fmt: skip
        elif table.state == "failed":
            print(f"patterns of {name}: {table.error}", file=sys.stderr, flush=True)
    for name, index in explorer.indexes.items():
        if index.ready():
            info = index.info
            print(f"search index of {name}: {info['docs']} documents, "
                  f"{info['bytes'] / 1e6:.1f} MB (built in {info['build_s']} s; "
                  f"ready after {time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip


def _refresh_loop(args: argparse.Namespace, explorer: Any, run: Any, cache: str) -> None:
    from tracer.readers.explore.search import SearchIndex

    args.no_progress = True
    stop = explorer.store.stop
    while not stop.wait(args.refresh):
        try:
            fresh = run.path + f".v{time.time_ns()}"
            export_source(args, fresh, stop)
            old = run.path
            explorer.store.repoint(run.name, fresh)
            explorer.store.compact(run.name, cache)
            explorer.patterns.refresh(run.name)
            if run.name in explorer.indexes:
                index = SearchIndex(fresh, cache)
                index.open_or_build(stop=stop)
                explorer.indexes[run.name] = index
                explorer.prune_indexes(cache)
            if old != fresh and ".v" in os.path.basename(old):
                import shutil

                shutil.rmtree(old, ignore_errors=True)
        except Exception as exc:  # a failed refresh keeps the last good tables
            if stop.is_set():
                return
            print(f"rollout-tracer explore: refresh failed: {exc}", file=sys.stderr, flush=True)
