"""Write the three tables incrementally (Parquet: one row group per page) or load them as pandas
DataFrames.

    from tracer.readers import export, read_tables

    export("mlflow", out="runs/exp1", experiment="gsm8k", tracking_uri="sqlite:///mlflow.db")
    export("weave", out="runs/exp1", experiment="gsm8k", entity="my-team")
    tables = read_tables("jsonl", path="traces/gsm8k/default.jsonl", steps=[1, 2])
    tables.trajectories.groupby("step").reward.mean()
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tracer.readers.health import Health, analyze
from tracer.readers.rows import Rows, records_rows
from tracer.readers.schema import TABLES, arrow_schema
from tracer.readers.selection import NoTrajectories, StoreNotFound, no_match
from tracer.readers.sources import Selection, iter_records, parse_steps
from tracer.readers.timing.steps_table import write_steps
from tracer.record import TrajectoryRecord

FORMATS = ("parquet", "jsonl")


@dataclass
class ExportSummary:
    """What an export wrote: rows per table, pages (= Parquet row groups), files."""

    rows: dict[str, int]
    pages: int
    files: dict[str, str]


@dataclass
class Tables:
    """The exported tables as pandas DataFrames."""

    trajectories: Any
    turns: Any
    tool_calls: Any
    tokens: Any = None


def arrow_table(name: str, rows: list[dict[str, Any]]) -> Any:
    """Rows -> a ``pyarrow.Table`` with the declared schema of table ``name``."""
    import pyarrow as pa

    return pa.Table.from_pylist(rows, schema=arrow_schema(name))


class _JsonlWriter:
    def __init__(self, path: str) -> None:
        self._f = open(path, "w", encoding="utf-8")  # noqa: SIM115  (closed in close())

    def write_rows(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            out = dict(row)
            for key in ("start_time",):
                if isinstance(out.get(key), int):
                    ts = dt.datetime.fromtimestamp(out[key] / 1e6, tz=dt.timezone.utc)
                    out[key] = ts.isoformat()
            self._f.write(json.dumps(out, ensure_ascii=False) + "\n")

    def close(self) -> None:
        self._f.close()


class _ParquetWriter:
    def __init__(self, path: str, name: str) -> None:
        import pyarrow.parquet as pq

        self.name = name
        self._w = pq.ParquetWriter(path, arrow_schema(name), compression="zstd")

    def write_rows(self, rows: list[dict[str, Any]]) -> None:
        if rows:  # one write_table call per page = one row group per page
            self._w.write_table(arrow_table(self.name, rows))

    def close(self) -> None:
        self._w.close()


def export_pages(
    pages: Iterable[list[TrajectoryRecord]],
    out: str,
    fmt: str = "parquet",
    on_page: Callable[[int], None] | None = None,
    tokenizer: Any = None,
    step_flags: bool = True,
    *,
    tokenizers: Callable[[str | None], Any] | None = None,
    earned_by: str | None = None,
) -> ExportSummary:
    """Write ``out/{trajectories,turns,tool_calls,tokens}.{parquet,jsonl}`` in one pass over
    ``pages``; only one page of records is in memory at a time. ``on_page(n)`` is called after
    each page of n trajectories (e.g. a progress bar's ``update``); ``tokenizer`` fills the
    tokens table's ``token`` text, else ``tokenizers`` (see ``records_rows``) does with the
    tokenizer each trajectory names.

    Step health flags need every trajectory of a step, so the trajectories table is written
    last: its rows wait in a temporary JSON-lines file next to the output (one small row per
    trajectory) while the other tables stream, and the few numbers the rules need are kept in
    memory; then the rows are written with their ``flags`` (``earned_by``: the reward part
    that says correct, for ``reward_accuracy_divergence``; default ``accuracy``). The source
    is read once.

    The files are written under a staging folder in ``out`` and moved into place when all are
    complete, so a failed export leaves the previous one as it was; nothing is created when the
    source raises or ``pages`` is empty (:class:`NoTrajectories`)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    pages = iter(pages)
    first = next(pages, None)  # a wrong source or an empty selection raises here, before any
    if first is None:  # file is touched
        raise NoTrajectories("no trajectories to export")
    created = not os.path.isdir(out)
    os.makedirs(out, exist_ok=True)
    # Written under a staging folder and moved into place at the end: a run that fails half
    # way leaves the previous export as it was.
    stage = tempfile.mkdtemp(prefix=".export-partial-", dir=out)
    try:
        summary = _write_tables(itertools.chain([first], pages), stage, fmt, on_page,
                                tokenizer, step_flags, tokenizers, earned_by)  # fmt: skip
        files = {}
        for name, path in summary.files.items():
            files[name] = os.path.join(out, os.path.basename(path))
            os.replace(path, files[name])
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out)  # only when empty: never what someone else put there
        raise
    shutil.rmtree(stage, ignore_errors=True)
    return ExportSummary(rows=summary.rows, pages=summary.pages, files=files)


def _write_tables(
    pages: Iterable[list[TrajectoryRecord]],
    out: str,
    fmt: str,
    on_page: Callable[[int], None] | None,
    tokenizer: Any,
    step_flags: bool,
    tokenizers: Callable[[str | None], Any] | None = None,
    earned_by: str | None = None,
) -> ExportSummary:
    files = {name: os.path.join(out, f"{name}.{fmt}") for name in TABLES}
    writers: dict[str, Any] = {
        name: _ParquetWriter(path, name) if fmt == "parquet" else _JsonlWriter(path)
        for name, path in files.items()
    }
    counts = dict.fromkeys(TABLES, 0)
    pages_written = 0
    held = os.path.join(out, ".trajectories.pending.jsonl")
    facts: list[dict[str, Any]] = []
    page_rows: list[int] = []  # trajectories per page: the table keeps one row group a page
    try:
        with open(held, "w", encoding="utf-8") as pending:
            for page in pages:
                rows = records_rows(page, tokenizer, tokenizers)
                for name, writer in writers.items():
                    table_rows = rows.table(name)
                    counts[name] += len(table_rows)
                    if name == "trajectories" and step_flags:
                        page_rows.append(len(table_rows))
                        for row in table_rows:
                            facts.append({k: row.get(k) for k in _HEALTH_COLUMNS})
                            pending.write(json.dumps(row, default=_json_default) + "\n")
                    else:
                        writer.write_rows(table_rows)
                pages_written += 1
                if on_page is not None:
                    on_page(len(page))
        if step_flags:
            health = analyze(facts, earned_by=earned_by)
            del facts
            writer = writers["trajectories"]
            rows_iter = _read_pending(held)
            for n in page_rows:
                batch = [next(rows_iter) for _ in range(n)]
                apply_flags(batch, health)
                writer.write_rows(batch)
    finally:
        for writer in writers.values():
            writer.close()
        with contextlib.suppress(OSError):
            os.unlink(held)
    files["steps"], counts["steps"] = write_steps(files["trajectories"], out, fmt)
    return ExportSummary(rows=counts, pages=pages_written, files=files)


def _json_default(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return {"__datetime__": value.isoformat()}
    return str(value)


def _read_pending(path: str) -> Iterator[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            for key, value in row.items():
                if isinstance(value, dict) and "__datetime__" in value:
                    row[key] = dt.datetime.fromisoformat(value["__datetime__"])
            yield row


def export(
    source: str,
    out: str,
    *,
    fmt: str = "parquet",
    experiment: str | None = None,
    tracking_uri: str | None = None,
    path: str | None = None,
    entity: str | None = None,
    steps: Sequence[int] | None = None,
    validate: bool | None = None,
    page_size: int = 500,
    on_page: Callable[[int], None] | None = None,
    tokenizer: Any = None,
    tokenizers: Callable[[str | None], Any] | None = None,
    earned_by: str | None = None,
) -> ExportSummary:
    """Export trajectories stored by a backend (``mlflow``, ``jsonl``, ``weave``) to the
    tables (see ``export_pages``). ``entity`` is the W&B entity of a Weave project (default
    ``$WANDB_ENTITY``)."""
    pages = iter_records(
        source,
        experiment=experiment,
        tracking_uri=tracking_uri,
        path=path,
        entity=entity,
        selection=Selection(steps, validate),
        page_size=page_size,
    )
    return export_pages(pages, out, fmt, on_page, tokenizer, tokenizers=tokenizers,
                        earned_by=earned_by)  # fmt: skip


_HEALTH_COLUMNS = ("trace_id", "step", "validate", "sample_key", "reward", "accuracy",
                   "reward_parts", "response_tokens", "flags")  # fmt: skip


def apply_flags(trajectory_rows: list[dict[str, Any]], health: Health) -> None:
    """Set each row's ``flags`` to what ``health`` found for its trace id (step flags too)."""
    for row in trajectory_rows:
        row["flags"] = list(health.by_trace.get(str(row["trace_id"]), []))


def rows_to_tables(rows: Rows) -> Tables:
    frames = {name: arrow_table(name, rows.table(name)).to_pandas() for name in TABLES}
    return Tables(**frames)


def read_tables(
    source: str,
    *,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    path: str | None = None,
    entity: str | None = None,
    steps: Sequence[int] | None = None,
    validate: bool | None = None,
    tokenizer: Any = None,
    allow_empty: bool = True,
    tokenizers: Callable[[str | None], Any] | None = None,
    earned_by: str | None = None,
) -> Tables:
    """The tables as pandas DataFrames (everything in memory: for large runs export to
    Parquet and query it with DuckDB or polars). ``source="parquet"`` reads an export
    directory ``path``. A selection that matches nothing gives empty tables, or with
    ``allow_empty=False`` raises :class:`NoTrajectories` saying what the source holds (what
    the commands do). ``earned_by`` (default ``accuracy``) is the reward part the ``flags``
    column judges correctness by; an export folder keeps the flags it was written with."""
    try:
        return _read_tables(source, experiment, tracking_uri, path, entity, steps, validate,
                            tokenizer, tokenizers, earned_by)  # fmt: skip
    except NoTrajectories:
        if not allow_empty:
            raise
        return rows_to_tables(Rows())


def _read_tables(source: str, experiment: str | None, tracking_uri: str | None,
                 path: str | None, entity: str | None, steps: Sequence[int] | None,
                 validate: bool | None, tokenizer: Any,
                 tokenizers: Callable[[str | None], Any] | None = None,
                 earned_by: str | None = None) -> Tables:  # fmt: skip
    if source == "parquet":
        return read_parquet_dir(str(path), steps, validate)
    rows = Rows()
    for page in iter_records(
        source,
        experiment=experiment,
        tracking_uri=tracking_uri,
        path=path,
        entity=entity,
        selection=Selection(steps, validate),
    ):
        rows.extend(records_rows(page, tokenizer, tokenizers))
    if not rows.trajectories:  # a source that does not say so itself (weave)
        raise no_match(f"{source} {experiment or path or ''}".strip(), Selection(steps, validate),
                       None)  # fmt: skip
    apply_flags(rows.trajectories, analyze(rows.trajectories, earned_by=earned_by))
    return rows_to_tables(rows)


def read_parquet_dir(
    path: str, steps: Sequence[int] | None = None, validate: bool | None = None
) -> Tables:
    """Load an export directory written by :func:`export` (optionally filtered)."""
    if not os.path.isfile(os.path.join(path, "trajectories.parquet")):
        what = "is not an export folder (no trajectories.parquet)" if os.path.isdir(path) \
            else "does not exist"
        raise StoreNotFound(f"--path {path} {what}: --from parquet reads a folder written by "
                            "`rollout-tracer export --format parquet --out FOLDER`")
    import pandas as pd

    frames: dict[str, Any] = {}
    for name in TABLES:
        file = os.path.join(path, f"{name}.parquet")
        if name == "tokens" and not os.path.exists(file):  # an export from before the table
            frames[name] = arrow_table(name, []).to_pandas()
            continue
        frames[name] = pd.read_parquet(file)
    keep = frames["trajectories"]
    if steps is not None:
        keep = keep[keep["step"].isin(list(steps))]
    if validate is not None:
        keep = keep[keep["validate"] == validate]
    if keep.empty:
        whole = frames["trajectories"]
        raise no_match(path, Selection(steps, validate), None, [int(s) for s in
                       whole["step"].dropna().unique()])  # fmt: skip
    ids = set(keep["trace_id"])
    frames["trajectories"] = keep
    for name in ("turns", "tool_calls", "tokens"):
        frames[name] = frames[name][frames[name]["trace_id"].isin(ids)]
    return Tables(**frames)


__all__ = [
    "FORMATS",
    "ExportSummary",
    "NoTrajectories",
    "StoreNotFound",
    "Tables",
    "export",
    "export_pages",
    "parse_steps",
    "read_parquet_dir",
    "read_tables",
]
