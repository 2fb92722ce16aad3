"""Readers: stored trajectories (MLflow, JSONL, Weave) back as tables, Parquet and an HTML report.

They depend only on what a backend stored, never on the tracing hot path. pandas, pyarrow and
mlflow are imported when a function runs, not when this package is imported.

    from tracer.readers import export, read_tables, write_report

    export("mlflow", "out/", experiment="gsm8k", tracking_uri="sqlite:///mlflow.db")
    tables = read_tables("parquet", path="out/")
    write_report(tables, "report.html")
    step_patterns("out/").rising   # behaviour patterns that take over (readers.habits.patterns)
"""

from __future__ import annotations

from tracer.readers.export import (
    FORMATS,
    ExportSummary,
    NoTrajectories,
    StoreNotFound,
    Tables,
    export,
    export_pages,
    read_parquet_dir,
    read_tables,
)
from tracer.readers.habits.patterns import PatternThresholds, step_patterns
from tracer.readers.report import build_report, write_report
from tracer.readers.rows import Rows, record_rows, records_rows
from tracer.readers.schema import TABLES, arrow_schema
from tracer.readers.sources import (
    SOURCES,
    Selection,
    iter_records,
    mlflow_to_record,
    parse_steps,
    weave_to_record,
)

__all__ = [
    "FORMATS",
    "SOURCES",
    "TABLES",
    "ExportSummary",
    "NoTrajectories",
    "PatternThresholds",
    "Rows",
    "Selection",
    "StoreNotFound",
    "Tables",
    "arrow_schema",
    "build_report",
    "export",
    "export_pages",
    "iter_records",
    "mlflow_to_record",
    "parse_steps",
    "read_parquet_dir",
    "read_tables",
    "record_rows",
    "records_rows",
    "step_patterns",
    "weave_to_record",
    "write_report",
]
