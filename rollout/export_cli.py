"""``rollout-tracer export`` and ``rollout-tracer report``: read what the tracer stored.

Registered in :mod:`rollout.cli`; the work is done by :mod:`tracer.readers`.

    rollout-tracer export --from mlflow --tracking-uri sqlite:///mlflow.db --experiment gsm8k \\
        --steps 1:10 --out exports/gsm8k
    rollout-tracer export --from weave --entity my-team --experiment gsm8k --out exports/gsm8k
    rollout-tracer report --from mlflow --experiment gsm8k --out report.html
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def _add_source_args(p: argparse.ArgumentParser, parquet: bool = False) -> None:
    sources = ["mlflow", "jsonl", "weave"] + (["parquet"] if parquet else [])
    p.add_argument("--from", dest="source", required=True, choices=sources)
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, "
                   "else sqlite:///./mlflow.db)")  # fmt: skip
    p.add_argument("--path", help="the JSONL file (--from jsonl) or export folder (parquet)")
    p.add_argument("--experiment", help="MLflow experiment or Weave project ([entity/]name): "
                   "the tracer's project_name")  # fmt: skip
    p.add_argument("--entity", help="W&B entity of the Weave project (default: $WANDB_ENTITY, "
                   "else the account's default entity)")  # fmt: skip
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--step", type=int, help="only this step")
    steps.add_argument("--steps", help="steps FIRST:LAST (inclusive) or a list 1,4,7")
    p.add_argument(
        "--validate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--validate: validation rollouts only; --no-validate: training only",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tokenizer", help="the tokens table's token text: a builtin model name "
                   "(smollm2-135m-instruct) or a local HF folder")  # fmt: skip


def configure_export(p: argparse.ArgumentParser) -> None:
    _add_source_args(p)
    p.add_argument("--out", required=True, help="output folder: trajectories/turns/tool_calls")
    p.add_argument("--format", default="parquet", choices=["parquet", "jsonl", "inspect"],
                   help="inspect: an Inspect eval log per step (inspect view, Docent)")  # fmt: skip
    p.add_argument("--page-size", type=int, default=500, help="trajectories per page/row group")


def configure_report(p: argparse.ArgumentParser) -> None:
    _add_source_args(p, parquet=True)
    p.add_argument("--out", default="report.html", help="the HTML file to write")
    p.add_argument("--title", default=None, help="report title")


def cmd_export(args: argparse.Namespace) -> int:
    """Export trajectories to Parquet (or JSONL) tables with a progress bar."""
    from tqdm import tqdm

    from tracer.readers import export

    t0 = time.perf_counter()
    bar = tqdm(desc="exporting", unit="traj", disable=args.no_progress)
    if args.format == "inspect":
        return _export_inspect(args, bar, t0)
    try:
        summary = export(
            args.source,
            args.out,
            fmt=args.format,
            page_size=args.page_size,
            on_page=bar.update,
            **_source_kwargs(args),
        )
    except (ValueError, NotImplementedError, FileNotFoundError) as exc:
        bar.close()
        print(f"rollout-tracer export: error: {exc}", file=sys.stderr)
        return 2
    bar.close()
    rows = ", ".join(f"{n} {name}" for name, n in summary.rows.items())
    print(f"exported {rows} in {summary.pages} pages, {time.perf_counter() - t0:.1f} s:")
    for path in summary.files.values():
        print(f"  {path}")
    return 0


def _export_inspect(args: argparse.Namespace, bar: Any, t0: float) -> int:
    from tracer.readers import Selection, iter_records
    from tracer.readers.inspect_log import export_inspect

    kwargs = _source_kwargs(args)
    try:
        pages = iter_records(
            args.source, experiment=kwargs["experiment"], tracking_uri=kwargs["tracking_uri"],
            path=kwargs["path"], entity=kwargs["entity"], page_size=args.page_size,
            selection=Selection(kwargs["steps"], kwargs["validate"]),
        )  # fmt: skip
        summary = export_inspect(pages, args.out, on_page=bar.update)
    except (ValueError, NotImplementedError, FileNotFoundError, ImportError) as exc:
        bar.close()
        print(f"rollout-tracer export: error: {exc}", file=sys.stderr)
        return 2
    bar.close()
    n = sum(summary.files.values())
    print(f"exported {n} trajectories as {len(summary.files)} Inspect logs in "
          f"{time.perf_counter() - t0:.1f} s (inspect view --log-dir {args.out}):")  # fmt: skip
    for path in summary.files:
        print(f"  {path}")
    return 0


def _source_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Where to read and what to keep: the options export and report share."""
    from tracer.readers import parse_steps

    return {
        "experiment": args.experiment,
        "tracking_uri": args.tracking_uri,
        "path": args.path,
        "entity": args.entity,
        "steps": parse_steps(args.step, args.steps),
        "validate": args.validate,
        "tokenizer": _tokenizer(args.tokenizer),
    }


def _tokenizer(path: str | None) -> Any:
    if not path:
        return None
    from rollout.models import load_tokenizer

    return load_tokenizer(path)


def cmd_report(args: argparse.Namespace) -> int:
    """Write the self-contained HTML report."""
    from tracer.readers import read_tables, write_report

    t0 = time.perf_counter()
    try:
        tables = read_tables(args.source, **_source_kwargs(args))
    except (ValueError, NotImplementedError, FileNotFoundError) as exc:
        print(f"rollout-tracer report: error: {exc}", file=sys.stderr)
        return 2
    title = args.title or f"rollout-tracer: {args.experiment or args.path}"
    write_report(tables, args.out, title)
    n = len(tables.trajectories)
    print(f"report of {n} trajectories: {args.out} ({time.perf_counter() - t0:.1f} s)")
    return 0
