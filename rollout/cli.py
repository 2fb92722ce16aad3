"""``rollout-tracer`` command line. Subcommands register themselves in :data:`SUBCOMMANDS`
(``run`` here; ``export``, ``report``, ``ui``, ``replay`` can be added the same way)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable
from typing import Any

DESCRIPTION = """\
Trace agentic RL rollouts and read the traces back.

  rollout-tracer run                                  a traced rollout into ./mlflow.db
  rollout-tracer ui                                   browse the traces in MLflow's UI
  rollout-tracer export --from mlflow --out exports/  trajectories, turns, tool calls as Parquet
  rollout-tracer report --from mlflow                 a self-contained HTML report
  rollout-tracer flags --from mlflow                  health flags, with example trace ids
  rollout-tracer replay                               send what an outage or crash left spooled

Readers use ./mlflow.db (or $MLFLOW_TRACKING_URI) and the experiment rollout-tracer unless told
otherwise, and never create a store. `rollout-tracer COMMAND --help` for a command's options.
"""

SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[..., int]]]
SUBCOMMANDS = {}


def subcommand(name: str, help: str, configure: Callable[[argparse.ArgumentParser], None]):
    """Decorator registering ``fn(args) -> exit code`` as subcommand ``name``."""

    def wrap(fn: Callable[..., int]) -> Callable[..., int]:
        SUBCOMMANDS[name] = (help, configure, fn)
        return fn

    return wrap


def _configure_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=4")
    p.add_argument("--config", help="a YAML config file instead of the packaged rollout.yaml")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _tracking_uri(trace: dict[str, Any]) -> str:
    uri = trace.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or f"sqlite:///{os.path.abspath('mlflow.db')}"


@subcommand("run", "run the rollout (verl-style config, dotted overrides)", _configure_run)
def cmd_run(args: argparse.Namespace) -> int:
    """Run the configured rollout with tracing; print where the traces are."""
    import tracer
    from rollout.config import load_config, trace_config
    from rollout.engines import make_engine
    from rollout.rewards import check_mode
    from rollout.trackers import Tracking
    from rollout.worker import RolloutWorker, done_line

    tracking: Any = None
    try:  # configuration errors: a clear message and exit code 2, no traceback
        config = load_config(args.overrides, args.config)
        check_mode(str((config.get("reward") or {}).get("mode", "strict")))
        from tracer.config_sources import merged_options

        trace = merged_options(trace_config(config))  # + $ROLLOUT_TRACER_CONFIG, _<FIELD>
        backends = trace.get("backend")
        names = backends if isinstance(backends, list) else [backends] if backends else []
        if "mlflow" in names:
            trace["tracking_uri"] = _tracking_uri(trace)
        tracking = args.tracking = Tracking.from_config(config, trace)  # trainer.logger
        if tracking.mlflow_run_id and "mlflow" in names:
            trace["mlflow_run_id"] = tracking.mlflow_run_id  # traces linked to the MLflow run
        trace.setdefault("run_salt", tracer.new_run_salt())  # annotate() finds the traces
        tracer.init(trace)
        from rollout.ray_cli import cmd_run_ray
        from rollout.ray_workers import num_workers

        ray_workers = num_workers(config)  # agent.num_workers > 0: rollout in Ray actors
    except (KeyError, ValueError) as exc:
        if tracking is not None:
            tracking.finish(failed=True)
        print(f"rollout-tracer: error: {exc}", file=sys.stderr)
        return 2
    if ray_workers:
        return cmd_run_ray(args, config, trace, lambda: _print_browse_hint(trace, names))
    steps = int(config["trainer"]["total_steps"])
    rollout = config["actor_rollout_ref"]["rollout"]
    total = steps * int(config["data"]["train_batch_size"]) * int(rollout["n"])
    t0 = time.perf_counter()
    print(f"loading {rollout['name']} engine for {config['actor_rollout_ref']['model']['path']}")
    engine = make_engine(config)
    worker = RolloutWorker(config, engine)
    from rollout.after_step import AfterStep

    after_step = AfterStep(config, engine, tracking)  # trainer pass, rollout_corr/*, heatmaps

    from tqdm import tqdm

    bar = tqdm(total=total, desc="trajectories", unit="traj", disable=args.no_progress)

    def on_step(result: Any) -> None:
        m = result.metrics()
        bar.set_postfix(step=result.step, score=f"{m['score']:.2f}", turns=f"{m['turns']:.1f}")
        tracer.end_step(result.step)  # keep rules: the step's min/max and groups decide now
        extra = after_step(result)
        tracking.log_step(result, {**tracer.metrics(), **extra})  # console, trainer.logger

    results: list[Any] = []
    validations: list[Any] = []

    def on_validate(result: Any) -> None:
        validations.append(result)
        tracking.log_validation(result, tracer.metrics())  # val/ metrics, val/generations

    async def main() -> None:
        try:
            results.extend(await worker.run(steps, on_done=lambda _: bar.update(1),
                                            on_step=on_step, on_validate=on_validate))  # fmt: skip
        finally:
            await engine.close()

    try:
        asyncio.run(main())
    finally:
        bar.close()
        tracer.flush(timeout_s=60)
        stats = tracer.metrics()
        tracer.shutdown()
        tracking.finish(failed=sys.exc_info()[1] is not None)
    print(f"{done_line(results, validations)} in {time.perf_counter() - t0:.1f} s; "
          f"tracer: {stats}")  # fmt: skip
    _print_browse_hint(trace, names)
    return 0


def _print_browse_hint(trace: dict[str, Any], names: list[str]) -> None:
    if "mlflow" in names:
        uri = trace["tracking_uri"]
        project = trace.get("project_name")
        print("browse the traces:")
        if uri.startswith(("http://", "https://")):
            print(f"  open {uri} (experiment {project!r}, Traces tab)")
        else:
            print(f"  rollout-tracer ui --tracking-uri {uri}")
            print(f"  (or: mlflow ui --backend-store-uri {uri} --workers 1)")
        print(f"  MLflow experiment: {project}; filter e.g. tags.step = '1' "
              f"and tags.experiment_name = '{trace.get('experiment_name')}'")  # fmt: skip
        print("export and report:")
        print(f"  rollout-tracer export --from mlflow --tracking-uri {uri} "
              f"--experiment {project} --out exports/ --format parquet")  # fmt: skip
        print(f"  rollout-tracer report --from mlflow --tracking-uri {uri} "
              f"--experiment {project} --out report.html")  # fmt: skip
    elif "jsonl" in names:
        print(f"traces written as JSONL (jsonl_path={trace.get('jsonl_path') or './traces/'})")


def _register_readers() -> None:
    """``export`` and ``report`` (rollout/export_cli.py): readers of what the tracer stored."""
    from rollout import export_cli

    subcommand("export", "export trajectories to Parquet/JSONL tables",
               export_cli.configure_export)(export_cli.cmd_export)  # fmt: skip
    subcommand("report", "write a self-contained HTML report of a run",
               export_cli.configure_report)(export_cli.cmd_report)  # fmt: skip

    from rollout import flags_cli

    subcommand("flags", "print the health flags of a run (and tag them in MLflow)",
               flags_cli.configure_flags)(flags_cli.cmd_flags)  # fmt: skip


_register_readers()


def _register_replay() -> None:
    """``replay`` (rollout/replay_cli.py): export what the spool kept after an outage/crash."""
    from rollout import replay_cli

    subcommand("replay", "export spooled trajectories (after an outage or a crash)",
               replay_cli.configure_replay)(replay_cli.cmd_replay)  # fmt: skip


_register_replay()


def _register_ui() -> None:
    """``ui`` (rollout/ui.py): the MLflow trace UI on the store the run used."""
    from rollout import ui

    subcommand("ui", "browse the traces in the MLflow UI (starts a local mlflow server)",
               ui.configure_ui)(ui.cmd_ui)  # fmt: skip


_register_ui()


def _register_explore() -> None:
    """``explore`` (rollout/explore_cli.py over tracer/readers/explore/): a local web app
    over the exported tables."""
    from rollout import explore_cli

    subcommand("explore", "browse, filter and search trajectories in a local web app",
               explore_cli.configure_explore)(explore_cli.cmd_explore)  # fmt: skip


_register_explore()


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with every registered subcommand."""
    parser = argparse.ArgumentParser(prog="rollout-tracer", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"rollout-tracer {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help_text, configure, fn) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text[:1].upper() + help_text[1:]
                           + ".")  # fmt: skip
        configure(p)
        p.set_defaults(func=fn)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rollout-tracer")
    except PackageNotFoundError:  # run from a checkout without installing
        from tracer import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rollout-tracer`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except Exception as exc:  # an optional package missing: one line, exit 2 (rollout/extras.py)
        from rollout.extras import missing_extra_line

        line = missing_extra_line(exc, args.command)
        if line is None:
            raise
        print(f"rollout-tracer {args.command}: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
