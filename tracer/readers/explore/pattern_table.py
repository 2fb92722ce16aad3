"""The explorer's Patterns tab: the behaviour patterns of a run (tracer/readers/habits/patterns.py),
computed once per export and answered from memory.

The one DuckDB scan of :mod:`tracer.readers.habits.patterns_sql` (seconds for a million
trajectories) runs in the background, over the compacted copy when there is one. Its result,
one row per kept (step, signature) and one per step, is a few thousand rows whatever the
run's size; it is written to the cache folder (``patterns/<export signature>-v<N>-<rules>``,
like the compacted copy and the search index) and read back on the next start of the same
export. The rules (:func:`~tracer.readers.habits.patterns.analyze`) then run once over it in memory,
and a request for a step is a dictionary lookup.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from typing import Any

from tracer.readers.explore.cache import prune_folder, touch
from tracer.readers.explore.filters import ApiError
from tracer.readers.habits.evidence import add_pairs
from tracer.readers.habits.patterns import Patterns, PatternThresholds, Rising, analyze
from tracer.readers.habits.patterns_report import rules
from tracer.readers.habits.patterns_sql import Group, StepTotal, duckdb_groups

log = logging.getLogger(__name__)
VERSION = 4  # 2: groups by behaviour, with correctness and unearned counts; 3: tool calls and
# validation passes in the step totals; 4: not judged without a correct answer (n_unjudged)
KEEP = 2  # tables kept in the cache folder besides those in use


def folder_name(export_signature: str, th: PatternThresholds) -> str:
    """The cache entry's name: the export, this file's format and the rules' thresholds (``top``
    and ``min_count`` decide which signatures the scan keeps)."""
    rules = hashlib.sha256(repr(dataclasses.astuple(th)).encode()).hexdigest()[:8]
    return f"{export_signature}-v{VERSION}-{rules}"


class PatternTable:
    """One run's patterns: ``state`` waiting (nothing asked yet), building, ready or failed
    (``error`` says why). :meth:`start` computes them in a thread of their own, once."""

    def __init__(self, path: str, source: str | None = None, cache_dir: str | None = None,
                 thresholds: PatternThresholds | None = None,
                 stop: threading.Event | None = None) -> None:  # fmt: skip
        self.path = path  # the export folder: its files' signature keys the cache
        self.source = source or path  # where the trajectories are read (the compacted copy)
        self.cache_dir = cache_dir
        self.thresholds = thresholds or PatternThresholds()
        self.state = "waiting"
        self.error: str | None = None
        self.found: Patterns | None = None
        self.info: dict[str, Any] = {}
        self._curves: dict[str, dict[int, float]] = {}
        self._running: set[Any] = set()  # the scan's DuckDB connection, while it runs
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.stop = stop or threading.Event()

    # ------------------------------------------------------------------ building
    def start(self) -> threading.Thread:
        """Compute the table in the background (once; later calls return the same thread)."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._build, daemon=True,
                                                name="explore-patterns")  # fmt: skip
                self._thread.start()
            return self._thread

    def close(self) -> None:
        self.stop.set()
        for con in list(self._running):
            con.interrupt()

    def percent(self) -> int:
        if self.state == "ready":
            return 100
        for con in list(self._running):
            try:
                return int(max(0.0, min(99.0, con.query_progress())))
            except Exception:  # the connection closed meanwhile
                break
        return 0

    def folder_name(self) -> str:
        from tracer.readers.explore.search import signature

        return folder_name(signature(self.path), self.thresholds)

    def _cache_folder(self) -> str | None:
        if not self.cache_dir:
            return None
        return os.path.join(self.cache_dir, "patterns", self.folder_name())

    def _build(self) -> None:
        self.state = "building"
        try:
            groups, totals = self._load_or_compute()
            self.found = analyze(groups, totals, self.thresholds)
            add_pairs(self.source, self.found)
            self._curves = {}
            for g in groups:
                if g.step in totals and totals[g.step].n:
                    self._curves.setdefault(g.signature, {})[g.step] = g.n / totals[g.step].n
            self.state = "ready"
        except Exception as exc:  # every other view keeps working
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = "failed"
            if not self.stop.is_set():
                log.warning("patterns of %s failed: %s", self.path, exc)

    def _load_or_compute(self) -> tuple[list[Group], dict[int, StepTotal]]:
        import pyarrow.parquet as pq

        out = self._cache_folder()
        if out and os.path.exists(os.path.join(out, "built.json")):
            touch(out)
            with open(os.path.join(out, "built.json"), encoding="utf-8") as f:
                self.info = dict(json.load(f), cached=True)
            groups = [Group(**r) for r in pq.read_table(os.path.join(out, "groups.parquet"))
                      .to_pylist()]  # fmt: skip
            totals = {int(r["step"]): StepTotal(**r) for r in
                      pq.read_table(os.path.join(out, "totals.parquet")).to_pylist()}  # fmt: skip
            return groups, totals
        t0 = time.perf_counter()
        groups, totals = duckdb_groups(self.source, self.thresholds.top,
                                       self.thresholds.min_count, self._running,
                                       self.thresholds.earned_by)  # fmt: skip
        self.info = {"groups": len(groups), "steps": len(totals),
                     "computed_s": round(time.perf_counter() - t0, 2), "cached": False}
        if out:
            self._write(out, groups, totals)
        return groups, totals

    def _write(self, out: str, groups: list[Group], totals: dict[int, StepTotal]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        tmp = out + ".building"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for name, rows in (("groups", groups), ("totals", list(totals.values()))):
            table = pa.Table.from_pylist([dataclasses.asdict(r) for r in rows])
            pq.write_table(table, os.path.join(tmp, f"{name}.parquet"))
        with open(os.path.join(tmp, "built.json"), "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in self.info.items() if k != "cached"}, f)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)

    # ------------------------------------------------------------------ answering
    def unavailable(self) -> ApiError | None:
        """The 503 to answer while the table is not ready (None once it is)."""
        if self.state == "ready":
            return None
        if self.state == "failed":
            return ApiError(f"the patterns could not be computed: {self.error}", 503)
        return ApiError(f"the patterns are being computed ({self.percent()} %); try again "
                        "shortly (/api/status follows it)", 503)  # fmt: skip

    def answer(self, step: int | None, top: int) -> dict[str, Any]:
        """The ranked patterns of ``step`` (default: the last), each with its share over
        every step, the run's flagged patterns and its summary line. ``top`` beyond the
        patterns kept per step (``PatternThresholds.top``) is said in ``note``."""
        found = self.found
        assert found is not None
        th = found.thresholds
        note = (f"top={top}: {th.top} patterns are kept per step (the rules' top); "
                f"{th.top} at most shown" if top > th.top else None)  # fmt: skip
        top = min(top, th.top)
        head = {"summary": found.summary(), "checked": found.checked, "top_kept": th.top,
                "note": note, "thresholds": dataclasses.asdict(th), "rules": rules(th)}
        if not found.steps:
            return {"steps": [], "step": None, "patterns": [], "rising": [], **head}
        if step is None:
            step = found.steps[-1]
        elif step not in found.top:
            raise ApiError(f"step: {step} is not a training step of this run (steps "
                           f"{found.steps[0]}-{found.steps[-1]}, {len(found.steps)} of them)")
        by_sig = {r.signature: r for r in found.rising}
        patterns = []
        for rank, p in enumerate(found.top[step][:top], 1):
            r = by_sig.get(p.signature)
            labels = (["rising"] if p.rising else []) + (["possible reward hacking"]
                                                         if p.hacking else [])  # fmt: skip
            patterns.append({**dataclasses.asdict(p), "rank": rank, "labels": labels,
                             "why": _why(r, th) if p.rising and r else None,
                             "reason": r.reason if p.hacking and r else None,
                             "curve": self.curve(p.signature)})  # fmt: skip
        rising = [{**_rising(r, th), "rank": i + 1, "curve": self.curve(r.signature)}
                  for i, r in enumerate(found.rising)]  # fmt: skip
        return {"steps": found.steps, "step": step, "trajectories": found.n,
                "patterns": patterns, "rising": rising, **head}

    def curve(self, signature: str) -> list[list[float]]:
        """(step, share) at every step of the run, 0 where the signature is absent."""
        assert self.found is not None
        mine = self._curves.get(signature, {})
        return [[s, round(mine.get(s, 0.0), 5)] for s in self.found.steps]


def _pct(v: float) -> str:
    return f"{100 * v:.1f} %"


def _why(r: Rising, th: PatternThresholds) -> str | None:
    """Why a pattern is flagged rising, in words."""
    if not r.steps:
        return None
    return (f"its share grew from {_pct(r.share_then)} at step {r.since} to "
            f"{_pct(r.share_now)} by step {r.last_step} (the rule: at least {th.growth:g}x what "
            f"it was {th.window} steps earlier); when first flagged, at step {r.first_step}, "
            f"its reward was {r.reward:.2f} against {r.step_reward:.2f} for all trajectories "
            f"of the last {th.smooth} steps")  # fmt: skip


def _rising(r: Rising, th: PatternThresholds) -> dict[str, Any]:
    out = {k: v for k, v in dataclasses.asdict(r).items() if k != "curve"}
    out.update(labels=r.labels, hacking_step=r.hacking_step, why=_why(r, th))
    return out


class PatternTables:
    """The patterns of every run of a store, for the explorer's server."""

    def __init__(self, store: Any, earned_by: str | None = None) -> None:
        self.store = store
        self.cache_dir: str | None = None
        # earned_by: the reward part that says correct (explore --earned-by)
        self.thresholds = PatternThresholds(earned_by=earned_by)
        self.tables = {name: PatternTable(r.path, thresholds=self.thresholds, stop=store.stop)
                       for name, r in store.runs.items()}  # fmt: skip

    def __getitem__(self, name: str) -> PatternTable:
        return self.tables[name]

    def use_cache(self, cache_dir: str) -> None:
        """Keep the tables in ``cache_dir`` (even one a request starts before the copy)."""
        self.cache_dir = cache_dir
        for table in self.tables.values():
            table.cache_dir = cache_dir

    def build_all(self) -> None:
        """Compute each run's table, in turn, from its compacted copy where there is one."""
        for name, table in self.tables.items():
            table.source = self.store.runs[name].folder
            table.start().join()
            if self.store.stop.is_set():
                return
        self.prune()

    def refresh(self, name: str) -> None:
        """Compute run ``name``'s table again (its export changed); the old one answers
        until the new one is ready."""
        run = self.store.runs[name]
        table = PatternTable(run.path, run.folder, self.cache_dir, self.thresholds,
                             stop=self.store.stop)  # fmt: skip
        table.start().join()
        self.tables[name] = table
        self.prune()

    def prune(self) -> list[str]:
        """Delete the cache folder's tables beyond ``KEEP`` besides those in use."""
        if not self.cache_dir:
            return []
        keep = {t.folder_name() for t in self.tables.values()}
        return prune_folder(os.path.join(self.cache_dir, "patterns"), keep, KEEP)

    def close(self) -> None:
        for table in self.tables.values():
            table.close()

    def status(self, name: str) -> dict[str, Any]:
        table = self.tables[name]
        summary = table.found.summary() if table.state == "ready" and table.found else None
        return {"state": table.state, "percent": table.percent(), "error": table.error,
                "summary": summary}

    def answer(self, name: str, step: int | None, top: int) -> dict[str, Any]:
        """``/api/patterns``: 503 (and the computation started) until the table is ready."""
        table = self.tables[name]
        # the state is read before the start: the first request hears 503, never a race
        busy = table.unavailable()
        if busy is not None:
            table.start()
            raise busy
        return table.answer(step, top)
