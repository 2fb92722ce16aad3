"""Explorer benchmark: ``rollout-tracer explore`` over N generated trajectories (the export's
Parquet schema, made by benchmarks/explore_data.py), and MLflow's ``search_traces`` against the
explorer's API on the same traces.

    python -m benchmarks.explore --n 1000000 --data /tmp/explore-1m --mlflow-n 100000
    python -m benchmarks.explore --n 1000000 --scenario hacking --skip search --mlflow-n 0

Not part of ``python -m benchmarks.run --quick``: generating a million trajectories takes
minutes and its search index longer. The server runs in its own process (``rollout-tracer
explore``), so its RSS is its own; every figure is wall time of a real HTTP request.
Prints a Markdown section for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.explorer_http import get as _get
from benchmarks.explorer_http import percentile as _p
from benchmarks.explorer_http import start

ROOT = Path(__file__).resolve().parents[1]


def _rss_mb(pid: int) -> tuple[float, float]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            fields[k] = v.strip()
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def list_queries(rng: random.Random, steps: int) -> list[list[tuple[str, Any]]]:
    sorts = ["-reward", "latency_ms", "-response_tokens", "step", "-mismatch_kl_mean", ""]
    out = []
    for _ in range(40):
        a = rng.randint(1, steps)
        q: list[tuple[str, Any]] = [("step", f"{a}:{min(steps, a + rng.randint(0, 20))}"),
                                    ("size", 50), ("page", rng.randint(0, 5))]  # fmt: skip
        kind = rng.randrange(5)
        if kind == 0:
            q.append(("reward", "0.5:"))
        elif kind == 1:
            q.append(("flag", "truncated"))
        elif kind == 2:
            q += [("worker_id", f"worker-{rng.randrange(8)}"), ("validate", "false")]
        elif kind == 3:
            q += [("tool_errors", "true"), ("f", f"latency_ms>{rng.randint(500, 2000)}")]
        else:
            q = [("size", 50), ("page", rng.randint(0, 100))]  # no filter: every trajectory
        if s := rng.choice(sorts):
            q.append(("sort", s))
        out.append(q)
    return out


def bench_explorer(data: str, cache: str, steps: int, lines: list[str]) -> None:
    rng = random.Random(0)
    proc, base, ready = start(["--from", "parquet", "--path", data, "--cache-dir", cache,
                               "--no-search"])  # fmt: skip
    try:
        rss0 = _rss_mb(proc.pid)[0]
        t0 = time.perf_counter()
        while not _get(base, "api/runs")[1]["runs"][0]["compacted"]:
            time.sleep(1)  # the once-per-export copy with large row groups (cached)
        compacted = time.perf_counter() - t0 + ready
        times, fresh = [], []
        ids = []
        queries = list_queries(rng, steps)
        for q in queries:
            dt, body = _get(base, "api/list", q)
            times.append(dt)
            ids += [(r["trace_id"], r["step"]) for r in body["rows"][:2]]
        for i, q in enumerate(queries):
            # the same query with a condition true of every row and new to the server: no
            # count or histogram from its cache
            fresh.append(_get(base, "api/list", [*q, ("f", f"latency_ms<{10**9 + i}")])[0])
        picks = rng.sample(ids, 40)
        opens = [_get(base, "api/trajectory", [("id", i), ("step", s)])[0] for i, s in picks[:20]]
        bare = [_get(base, "api/trajectory", [("id", i)])[0] for i, _ in picks[20:]]
        groups = [_get(base, "api/groups", [("step", rng.randint(1, steps))])[0] for _ in range(10)]
        rss, hwm = _rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    lines += [
        f"| ready after start (views over the Parquet; nothing loaded) | {ready:.2f} s |",
        f"| compacted copy in use (built once per export; here: already cached) | after "
        f"{compacted:.1f} s |",
        f"| RSS after start / after the queries below (peak) | {rss0:.0f} MB / {rss:.0f} MB "
        f"({hwm:.0f} MB) |",
        f"| filter + sort + page of 50, with count and reward histogram (40 queries) | p50 "
        f"{_p(times, .5) * 1e3:.0f} ms, p95 {_p(times, .95) * 1e3:.0f} ms |",
        f"| the same 40, each filter new to the server's cache | p50 "
        f"{_p(fresh, .5) * 1e3:.0f} ms, p95 {_p(fresh, .95) * 1e3:.0f} ms |",
        f"| open one trajectory with turns, tool calls, tokens, by id and step as the page "
        f"does (20) | p50 {_p(opens, .5) * 1e3:.0f} ms, p95 {_p(opens, .95) * 1e3:.0f} ms |",
        f"| the same by id alone (20 others) | p50 "
        f"{_p(bare, .5) * 1e3:.0f} ms, p95 {_p(bare, .95) * 1e3:.0f} ms |",
        f"| a step's GRPO groups, page of 20 (10) | p50 {_p(groups, .5) * 1e3:.0f} ms, "
        f"p95 {_p(groups, .95) * 1e3:.0f} ms |",
    ]


def bench_search(data: str, cache: str, lines: list[str]) -> None:
    rng = random.Random(1)
    t0 = time.perf_counter()
    proc, base, _ = start(["--from", "parquet", "--path", data, "--cache-dir", cache])
    try:
        while True:
            run = _get(base, "api/runs")[1]["runs"][0]
            if run["search"] != "building":
                break
            time.sleep(2)
        wait = time.perf_counter() - t0
        if run["search"] != "ready":
            lines.append(f"| search | {run['search']} |")
            return
        words = [w for h in _get(base, "api/search", [("q", "question"), ("size", 50)])[1]["hits"]
                 for w in h["fragment"].split() if w.isalpha() and len(w) > 5][:200]  # fmt: skip
        qs = [rng.choice(words) for _ in range(15)] + ["timeout", '"what is 17"'] + [
            f"{rng.choice(words)} {rng.choice(words)}" for _ in range(13)]  # fmt: skip
        times, totals = [], []
        for q in qs:
            dt, body = _get(base, "api/search", [("q", q), ("size", 20)])
            times.append(dt)
            totals.append(body["total"])
        rss, hwm = _rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    info = run["index"]
    lines += [
        f"| search index: built once per export | {info['build_s']:.0f} s, "
        f"{info['bytes'] / 1e9:.2f} GB, {info['docs']:,} documents |",
        f"| start with the index built (open it, serve) | {wait:.1f} s |",
        f"| search in prompts/responses/tool calls, page of 20 (30 queries; median hits "
        f"{int(_p(totals, .5)):,}) | p50 {_p(times, .5) * 1e3:.0f} ms, p95 "
        f"{_p(times, .95) * 1e3:.0f} ms |",
        f"| RSS with the index open (peak) | {rss:.0f} MB ({hwm:.0f} MB) |",
    ]


def bench_first_start(data: str, tmp: str, lines: list[str]) -> None:
    """A first start with nothing cached: the compacted copy, then the search index, built
    inside the serving process. Meanwhile, every 2 s: a list query and a search (answered by
    the bounded scan until the index is ready). The peak RSS when the copy is done (the
    index starts after it) and at the end."""
    t0 = time.perf_counter()
    proc, base, ready = start(["--from", "parquet", "--path", data, "--cache-dir",
                               os.path.join(tmp, "first-start")])  # fmt: skip
    rng = random.Random(2)
    compacted = compact_hwm = None
    before, after, scans, indexed = [], [], [], []
    words = ["timeout", '"what is 17"']
    try:
        first_scan = _get(base, "api/search", [("q", "timeout"), ("size", 20)])
        while True:
            status = _get(base, "api/status")[1]
            run = status["runs"][0]
            if compacted is None and run["compaction"]["state"] in ("done", "failed"):
                compacted = time.perf_counter() - t0
                compact_hwm = _rss_mb(proc.pid)[1]
            dt = _get(base, "api/list", [("step", f"{rng.randint(1, 90)}:{rng.randint(91, 99)}"),
                                         ("sort", "-reward"), ("size", 50)])[0]  # fmt: skip
            (after if run["compaction"]["state"] == "done" else before).append(dt)
            if status["settled"]:
                break
            scans.append(_get(base, "api/search", [("q", rng.choice(words)), ("size", 20)]))
            time.sleep(2)
        searchable = time.perf_counter() - t0
        for _ in range(10):
            indexed.append(_get(base, "api/search", [("q", rng.choice(words)), ("size", 20)]))
        hwm = _rss_mb(proc.pid)[1]
    finally:
        proc.terminate()
        proc.wait(30)
    scan_s = [dt for dt, body in scans if body.get("partial")]
    lines += [
        f"| first start, nothing cached: ready / compaction {run['compaction']['state']} / "
        f"search {run['search']['state']} | {ready:.1f} s / {compacted or 0:.0f} s / "
        f"{searchable:.0f} s |",
        f"| a search at the first second (a scan: partial {first_scan[1].get('partial')}, "
        f"{first_scan[1]['total']} hits) | {first_scan[0] * 1e3:.0f} ms |",
        f"| searches while the index builds (scans, {len(scan_s)}) | p50 "
        f"{_p(scan_s or [0], .5) * 1e3:.0f} ms, p95 {_p(scan_s or [0], .95) * 1e3:.0f} ms |",
        f"| the same searches once the index is ready (10) | p50 "
        f"{_p([d for d, _ in indexed], .5) * 1e3:.0f} ms, p95 "
        f"{_p([d for d, _ in indexed], .95) * 1e3:.0f} ms |",
        f"| filter + sort + page of 50 before the copy is done ({len(before)}) / after "
        f"({len(after)}) | p95 {_p(before or [0], .95) * 1e3:.0f} ms / "
        f"{_p(after or [0], .95) * 1e3:.0f} ms |",
        f"| the server's peak RSS when the copy was done / at the end (index built too) | "
        f"{(compact_hwm or 0) / 1024:.2f} GB / {hwm / 1024:.2f} GB |",
    ]


def bench_mlflow(n: int, tmp: str, lines: list[str]) -> None:
    """n traces written into an MLflow sqlite store; listed and filtered by a tag page by page
    through MLflow's own ``search_traces`` vs the explorer (after its export). A store already
    in ``tmp`` (``--mlflow-dir``, from an earlier run) is reused, not written again."""
    sys.path.insert(0, str(ROOT))
    from mlflow.tracking import MlflowClient

    import tracer
    from tests.test_export import _records
    from tracer.backends.mlflow_backend import MlflowExporter

    uri = f"sqlite:///{tmp}/mlflow.db"
    exporter = MlflowExporter(tracer.TraceConfig(backend="mlflow", tracking_uri=uri,
                                                 project_name="big"))  # fmt: skip
    reused = os.path.exists(f"{tmp}/written")
    t0 = time.perf_counter()
    if not reused:
        for i in range(0, n, 2000):
            exporter.export(_shift(_records(min(2000, n - i)), i))
        Path(f"{tmp}/written").write_text(f"{n} {time.perf_counter() - t0:.0f}\n")
    exporter.shutdown()
    write_s = float(Path(f"{tmp}/written").read_text().split()[1])
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("big").experiment_id

    def mlflow_pages(filter_string: str | None) -> tuple[float, float, int]:
        t, first, count, token = time.perf_counter(), None, 0, None
        while True:
            page = client.search_traces(locations=[exp], filter_string=filter_string,
                                        max_results=500, page_token=token)  # fmt: skip
            first = first or time.perf_counter() - t
            count += len(page)
            token = page.token
            if not token:
                return time.perf_counter() - t, first, count

    ml_all = mlflow_pages(None)
    ml_tag = mlflow_pages("tags.step = '3'")
    proc, base, ready = start(["--from", "mlflow", "--tracking-uri", uri, "--experiment", "big",
                               "--cache-dir", f"{tmp}/cache", "--no-search"])  # fmt: skip
    try:
        def explorer_pages(params: list[tuple[str, Any]]) -> tuple[float, float, int]:
            t, first, count, page = time.perf_counter(), None, 0, 0
            while True:
                _, body = _get(base, "api/list", [*params, ("size", 500), ("page", page),
                                                  ("hist", "false")])  # fmt: skip
                first = first or time.perf_counter() - t
                count += len(body["rows"])
                page += 1
                if count >= body["total"]:
                    return time.perf_counter() - t, first, count

        ex_all = explorer_pages([])
        ex_tag = explorer_pages([("step", "3:3")])
    finally:
        proc.terminate()
        proc.wait(30)
    lines += [
        f"| {n:,} traces written to an MLflow sqlite store (the tracer's bulk writer) | "
        f"{write_s:.0f} s{' (an earlier run)' if reused else ''} |",
        f"| MLflow `search_traces`, every trace, pages of 500 | {ml_all[0]:.1f} s "
        f"({ml_all[2]:,} traces; first page {ml_all[1] * 1e3:.0f} ms) |",
        f"| MLflow `search_traces`, `tags.step = '3'`, pages of 500 | {ml_tag[0]:.2f} s "
        f"({ml_tag[2]:,} traces; first page {ml_tag[1] * 1e3:.0f} ms) |",
        f"| explore --from mlflow: export to its cache, then ready | {ready:.1f} s |",
        f"| explorer API, every trajectory, pages of 500 | {ex_all[0]:.1f} s "
        f"({ex_all[2]:,}; first page {ex_all[1] * 1e3:.0f} ms) |",
        f"| explorer API, `step=3:3`, pages of 500 | {ex_tag[0]:.2f} s ({ex_tag[2]:,}; first "
        f"page {ex_tag[1] * 1e3:.0f} ms) |",
    ]


def _shift(records: list[Any], offset: int) -> list[Any]:
    """Records i..i+k with unique ids and steps (the helper numbers from 0)."""
    import dataclasses

    out = []
    for j, r in enumerate(records):
        i = offset + j
        out.append(dataclasses.replace(r, trace_id=f"{i:032x}", step=i // 1000,
                                       sample_index=i % 1000 // 4))  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--data", default=None, help="folder of a generated set (made if missing)")
    p.add_argument("--cache", default=None, help="the explorer's cache folder")
    p.add_argument("--tokens-per-turn", type=int, default=8)
    p.add_argument("--short-text", action="store_true", help="generate ~45-word responses "
                   "and one-number tool results (default: realistic text, 60-100 words)")
    p.add_argument("--mlflow-n", type=int, default=100_000, help="0: skip the MLflow part")
    p.add_argument("--mlflow-dir", default=None, help="folder of the MLflow store (reused "
                   "when a run already wrote it)")
    p.add_argument("--skip", default="", help="comma list of parts to skip: "
                   "explorer,search,patterns")
    p.add_argument("--scenario", default="", choices=["", "hacking"], help="a behaviour "
                   "scenario in the generated data (benchmarks/patterns_data.py)")
    p.add_argument("--first-start", action="store_true", help="also time a first start with "
                   "nothing cached (the copy and the index built while serving: minutes)")
    p.add_argument("--output", default=None, help="also write the table to this Markdown file "
                   "(benchmarks/RESULTS-explore.md is kept in RESULTS.md by benchmarks.run)")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="explore-bench-")
    try:
        data = args.data or os.path.join(tmp, "data")
        cache = args.cache or os.path.join(tmp, "cache")
        lines = [f"| action ({args.n:,} trajectories, {3 * args.n:,} turns, {3 * args.n:,} tool "
                 "calls) | figure |", "|---|---|"]  # fmt: skip
        if not os.path.exists(os.path.join(data, "trajectories.parquet")):
            from benchmarks.explore_data import generate

            t0 = time.perf_counter()
            generate(data, args.n, tokens_per_turn=args.tokens_per_turn, progress=True,
                     short_text=args.short_text, scenario=args.scenario)
            lines.append(f"| generate the set (benchmarks/explore_data.py) | "
                         f"{time.perf_counter() - t0:.0f} s |")  # fmt: skip
        size = sum(f.stat().st_size for f in Path(data).glob("*.parquet"))
        lines.append(f"| Parquet on disk (4 tables, zstd) | {size / 1e9:.2f} GB |")
        steps = max(1, min(100, args.n // 400))
        skip = set(args.skip.split(","))
        if "explorer" not in skip:
            bench_explorer(data, cache, steps, lines)
        if "search" not in skip:
            bench_search(data, cache, lines)
        if "patterns" not in skip:
            from benchmarks.bench_patterns import explorer_tab

            explorer_tab(data, cache, steps, lines)
        if args.first_start:
            bench_first_start(data, tmp, lines)
        if args.mlflow_n:
            ml = args.mlflow_dir or os.path.join(tmp, "mlflow")
            os.makedirs(ml, exist_ok=True)
            bench_mlflow(args.mlflow_n, ml, lines)
        print("\n".join(lines))
        if args.output:
            Path(args.output).write_text("\n".join(lines) + "\n")
    finally:  # what this run made and was not told to keep (GBs: data, caches, stores)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
