"""``rollout-tracer export`` and ``rollout-tracer report``: read what the tracer stored.

Registered in :mod:`rollout.cli`; the work is done by :mod:`tracer.readers`. Every option is
checked before the store is opened; a wrong store or experiment exits with status 2, a selection
that matches nothing with status 1, and neither creates nor changes a file.

    rollout-tracer export --from mlflow --tracking-uri sqlite:///mlflow.db --experiment gsm8k \\
        --steps 1:10 --out exports/gsm8k
    rollout-tracer export --from weave --entity my-team --experiment gsm8k --out exports/gsm8k
    rollout-tracer report --from mlflow --experiment gsm8k --out report.html
    rollout-tracer report --from verl-dump --path checkpoints/rollout_data --out report.html
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from typing import Any

DEFAULT_EXPERIMENT = "rollout-tracer"  # the tracer's default project_name, as `ui` uses
SOURCE_HELP = {
    "mlflow": "an MLflow store (--tracking-uri, --experiment)",
    "jsonl": "the JSONL file the jsonl backend wrote (--path)",
    "weave": "a Weave project (--experiment, --entity)",
    "parquet": "a folder written by `export --format parquet` (--path)",
    "verl-dump": "the JSONL files verl's trainer.rollout_data_dir holds (--path)",
}


def steps_arg(text: str) -> str:
    """argparse type of ``--steps``: checked when the command line is parsed."""
    from tracer.readers.selection import parse_steps

    try:
        parse_steps(None, text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--steps {text!r}: ")) from None
    return text


def _add_source_args(p: argparse.ArgumentParser, parquet: bool = False) -> None:
    sources = ["mlflow", "jsonl", "weave", "verl-dump"] + (["parquet"] if parquet else [])
    p.add_argument("--from", dest="source", required=True, choices=sources, metavar="SOURCE",
                   help="where the trajectories are: " + "; ".join(
                       f"{s}: {SOURCE_HELP[s]}" for s in sources))  # fmt: skip
    p.add_argument("--tracking-uri", metavar="URI", help="MLflow store (default: "
                   "$MLFLOW_TRACKING_URI, else sqlite:///./mlflow.db); never created by a "
                   "reader")  # fmt: skip
    p.add_argument("--path", help="the JSONL file (--from jsonl), export folder (parquet) or "
                   "verl's trainer.rollout_data_dir (verl-dump)")  # fmt: skip
    p.add_argument("--experiment", metavar="NAME", help="MLflow experiment or Weave project "
                   f"([entity/]name): the tracer's project_name (default: {DEFAULT_EXPERIMENT}; "
                   "--from jsonl: keeps records of this project or experiment_name, default "
                   "all)")  # fmt: skip
    p.add_argument("--entity", help="W&B entity of the Weave project (default: $WANDB_ENTITY, "
                   "else the account's default entity)")  # fmt: skip
    # every command that reads a run judges its reward (health flags, patterns): one option
    p.add_argument("--earned-by", default=None, metavar="PART",
                   help="the reward part that says an answer is correct, for the health flags "
                   "and possible reward hacking (default: accuracy, the reward's acc/accuracy "
                   "output; any numeric reward part, e.g. correct)")  # fmt: skip
    steps = p.add_mutually_exclusive_group()
    steps.add_argument("--step", type=int, metavar="N", help="only step N")
    steps.add_argument("--steps", type=steps_arg, metavar="SPEC",
                       help="steps FIRST:LAST (inclusive, e.g. 1:10) or a list (e.g. 1,4,7)")
    p.add_argument(
        "--validate",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--validate: validation rollouts only; --no-validate: training only (default both)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--tokenizer", help="the tokens table's token text: a builtin model name "
                   "(smollm2-135m-instruct, once `rollout-tracer run` has converted it) or a "
                   "local HF folder")  # fmt: skip


def configure_export(p: argparse.ArgumentParser) -> None:
    _add_source_args(p)
    p.add_argument("--out", required=True, metavar="FOLDER", help="output folder: "
                   "trajectories, turns, tool_calls and tokens tables (replaced only when the "
                   "export succeeds)")  # fmt: skip
    p.add_argument("--format", default="parquet", choices=["parquet", "jsonl", "inspect"],
                   help="table file format (default parquet); inspect: an Inspect eval log per "
                   "step (inspect view, Docent)")  # fmt: skip
    p.add_argument("--page-size", type=int, default=500, metavar="N",
                   help="trajectories per page/row group (default 500)")


def configure_report(p: argparse.ArgumentParser) -> None:
    _add_source_args(p, parquet=True)
    p.add_argument("--out", default="report.html", metavar="FILE",
                   help="the HTML file to write (default report.html; its folder must exist)")
    p.add_argument("--title", default=None,
                   help="report title (default: the experiment and run names in the data)")


def check_source(args: argparse.Namespace) -> str | None:
    """The options of the source, checked before anything is read: an error message or None."""
    if args.source in ("jsonl", "parquet") and not args.path:
        example = "traces/rollout-tracer/default.jsonl" if args.source == "jsonl" else "exports/"
        return f"--from {args.source} needs --path (e.g. --path {example})"
    if args.source in ("mlflow", "weave") and args.experiment is None:
        args.experiment = DEFAULT_EXPERIMENT
    return None


def check_out_folder(out: str) -> str | None:
    """``export --out``: an error message when the folder cannot be created or written."""
    if os.path.exists(out) and not os.path.isdir(out):
        return f"--out {out}: is a file; export writes a folder of tables"
    parent = os.path.abspath(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"--out {out}: {parent} is not a folder"
    return _unwritable(out, parent)


def check_out_file(out: str) -> str | None:
    """``report --out``: an error message when the file cannot be written (its folder must
    exist: a typo there should not become a new folder)."""
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        return f"--out {out}: is a folder; give the HTML file, e.g. --out {out}/report.html"
    if not os.path.isdir(folder):
        return f"--out {out}: folder {folder} does not exist (create it first)"
    return _unwritable(out, folder)


def _unwritable(out: str, folder: str) -> str | None:
    # os.access says yes to root everywhere (/proc included): only a real file tells
    try:
        fd, probe = tempfile.mkstemp(prefix=".rollout-tracer-probe-", dir=folder)
    except OSError as exc:
        return f"--out {out}: cannot write in {folder} ({exc.strerror or exc})"
    os.close(fd)
    os.unlink(probe)
    return None


def fail(command: str, message: str, status: int = 2) -> int:
    print(f"rollout-tracer {command}: error: {message}", file=sys.stderr)
    return status


def missing_extra(modules: tuple[str, ...], extra: str) -> str | None:
    """None when every module imports; else one line that names the install command."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError:
            return f"{name} is not installed: pip install 'rollout-tracer[{extra}]'"
    return None


def read_errors() -> tuple[type[BaseException], ...]:
    """What a reader raises for a wrong source or selection (the rest are bugs: traceback)."""
    from tracer.readers.selection import NoTrajectories

    return (ValueError, NotImplementedError, FileNotFoundError, NotADirectoryError,
            NoTrajectories)  # fmt: skip


def exit_status(exc: BaseException) -> int:
    from tracer.readers.selection import NoTrajectories

    return 1 if isinstance(exc, NoTrajectories) else 2


def cmd_export(args: argparse.Namespace) -> int:
    """Export trajectories to Parquet (or JSONL) tables with a progress bar."""
    problem = check_source(args) or check_out_folder(args.out)
    if problem:
        return fail("export", problem)
    from tqdm import tqdm

    from tracer.readers import export

    t0 = time.perf_counter()
    bar = tqdm(desc="exporting", unit="traj", disable=args.no_progress)
    if args.format == "inspect":
        return _export_inspect(args, bar, t0)
    kwargs = _source_kwargs(args)
    try:
        summary = export(args.source, args.out, fmt=args.format, page_size=args.page_size,
                         on_page=bar.update, **kwargs)
    except read_errors() as exc:
        bar.close()
        return fail("export", str(exc), exit_status(exc))
    except ImportError as exc:  # Parquet needs pyarrow: imported once the source has answered
        bar.close()
        name = (exc.name or "").split(".")[0]
        if name not in ("pyarrow", "pandas"):
            raise
        return fail("export", f"{name} is not installed: pip install 'rollout-tracer[export]'")
    bar.close()
    rows = ", ".join(f"{n} {name}" for name, n in summary.rows.items())
    print(f"exported {rows} in {summary.pages} pages, {time.perf_counter() - t0:.1f} s:")
    for path in summary.files.values():
        print(f"  {path}")
    token_note(kwargs["tokenizers"], summary.rows.get("tokens", 0))
    return 0


def token_note(tokenizers: Any, token_rows: int) -> None:
    """Say so when the tokens table has ids only, and how to add their text."""
    note = tokenizers.note(token_rows) if tokenizers is not None else None
    if note:
        print(f"note: {note}", file=sys.stderr)


def _export_inspect(args: argparse.Namespace, bar: Any, t0: float) -> int:
    from tracer.readers import Selection, iter_records
    from tracer.readers.inspect_log import export_inspect

    kwargs = _source_kwargs(args)
    # ImportError: inspect-ai is not installed
    errors: tuple[type[BaseException], ...] = (*read_errors(), ImportError)
    try:
        pages = iter_records(
            args.source, experiment=kwargs["experiment"], tracking_uri=kwargs["tracking_uri"],
            path=kwargs["path"], entity=kwargs["entity"], page_size=args.page_size,
            selection=Selection(kwargs["steps"], kwargs["validate"]),
        )  # fmt: skip
        summary = export_inspect(pages, args.out, on_page=bar.update)
    except errors as exc:
        bar.close()
        return fail("export", str(exc), exit_status(exc))
    bar.close()
    n = sum(summary.files.values())
    print(f"exported {n} trajectories as {len(summary.files)} Inspect logs in "
          f"{time.perf_counter() - t0:.1f} s (inspect view --log-dir {args.out}):")  # fmt: skip
    for path in summary.files:
        print(f"  {path}")
    return 0


def _source_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Where to read and what to keep: the options export and report share."""
    from tracer.readers.selection import parse_steps

    return {
        "experiment": args.experiment,
        "tracking_uri": args.tracking_uri,
        "path": args.path,
        "entity": args.entity,
        "steps": parse_steps(args.step, args.steps),
        "validate": args.validate,
        "earned_by": args.earned_by,
        "tokenizer": _tokenizer(args.tokenizer),
        # without --tokenizer: the one each trace names (token2text's), when it can be loaded
        "tokenizers": None if args.tokenizer else _trace_tokenizers(),
    }


def _trace_tokenizers() -> Any:
    from tracer.readers.tokenizers import TraceTokenizers

    return TraceTokenizers()


def _tokenizer(path: str | None) -> Any:
    if not path:
        return None
    from tracer.readers.tokenizers import load_tokenizer

    return load_tokenizer(path)


def cmd_report(args: argparse.Namespace) -> int:
    """Write the self-contained HTML report."""
    problem = check_source(args) or check_out_file(args.out)
    if problem:
        return fail("report", problem)
    from tracer.readers import read_tables, write_report
    from tracer.readers.habits.earned import UnknownPart

    t0 = time.perf_counter()
    try:
        tables = read_tables(args.source, allow_empty=False, **_source_kwargs(args))
    except read_errors() as exc:
        return fail("report", str(exc), exit_status(exc))
    try:
        write_report(tables, args.out, args.title, earned_by=args.earned_by)
    except UnknownPart as exc:  # --earned-by names a part no trajectory has (--from parquet)
        return fail("report", str(exc))
    traj = tables.trajectories
    n_val = int(traj["validate"].sum()) if len(traj) else 0
    print(f"report of {len(traj) - n_val} training and {n_val} validation trajectories: "
          f"{args.out} ({time.perf_counter() - t0:.1f} s)")  # fmt: skip
    return 0
