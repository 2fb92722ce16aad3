"""``rollout-tracer flags``: the health flags of a run, for a terminal user.

    rollout-tracer flags --from mlflow --tracking-uri sqlite:///mlflow.db --experiment gsm8k
    rollout-tracer flags --from parquet --path exports/gsm8k --examples 3
    rollout-tracer flags --from mlflow --experiment gsm8k --write-tags   # flag.<name> tags

The rules and thresholds are in :mod:`tracer.readers.health`; registered in :mod:`rollout.cli`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rollout.export_cli import (
    _add_source_args,
    _source_kwargs,
    check_source,
    exit_status,
    fail,
    read_errors,
)


def configure_flags(p: argparse.ArgumentParser) -> None:
    _add_source_args(p, parquet=True)
    p.add_argument("--examples", type=int, default=3, metavar="N",
                   help="example trace ids (tr-..., as MLflow shows them) per flag (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--write-tags", action="store_true",
                   help="--from mlflow: tag each flagged trace flag.<name>=true in MLflow "
                   "(filter tags.`flag.truncated` = 'true' in the UI)")  # fmt: skip


def cmd_flags(args: argparse.Namespace) -> int:
    if args.write_tags and args.source != "mlflow":
        return fail("flags", f"--write-tags writes MLflow trace tags: it needs --from mlflow "
                    f"(not --from {args.source})")  # fmt: skip
    problem = check_source(args)
    if problem:
        return fail("flags", problem)
    from tracer.readers import read_tables
    from tracer.readers.health import MEANINGS, STEP_FLAGS, analyze

    try:
        # health flags need no token text: no tokenizer is loaded
        kwargs = _source_kwargs(args) | {"tokenizers": None}
        tables = read_tables(args.source, allow_empty=False, **kwargs)
    except read_errors() as exc:
        return fail("flags", str(exc), exit_status(exc))
    health = analyze(tables.trajectories.to_dict("records"))
    counts = health.counts()
    if args.write_tags:
        written = write_tags(args.tracking_uri, health.by_trace)
        print(f"wrote {written} flag tags (flag.<name>) to MLflow", file=sys.stderr)
    if args.json:
        flags = {
            name: {"steps": {str(k): v for k, v in per_step.items()},
                   "examples": health.examples(name, args.examples)}
            for name, per_step in counts.items()
        }  # fmt: skip
        steps = [
            {"step": f.step, "validate": f.validate, "flag": f.name, "value": round(f.value, 4),
             "trace_ids": f.trace_ids}
            for f in health.steps
        ]  # fmt: skip
        out: dict[str, Any] = {"flags": flags, "steps": steps}
        print(json.dumps(out, indent=1, default=str))
        return 0
    n = len(tables.trajectories)
    if not counts:
        print(f"no health flags in {n} trajectories")
        return 0
    validation = set(tables.trajectories.loc[tables.trajectories["validate"].astype(bool),
                                             "trace_id"])  # fmt: skip
    print(f"health flags in {n} trajectories ({len(health.by_trace)} flagged):")
    for name, per_step in counts.items():
        level = "step" if name in STEP_FLAGS else "trajectory"
        where = ", ".join(f"{k}:{v}" for k, v in sorted(per_step.items(), key=lambda kv:
                                                         str(kv[0])))  # fmt: skip
        print(f"  {name:<28} {sum(per_step.values()):>5} trajectories ({level}; per step "
              f"{where})")  # fmt: skip
        print(f"      {MEANINGS.get(name, '')}")
        for trace_id in health.examples(name, args.examples):
            kind = "validation" if trace_id in validation else "training"
            print(f"      tr-{trace_id}  (step {health.step_of.get(trace_id)}, {kind})")
    if args.source == "mlflow":
        print("open a trace in the MLflow UI (rollout-tracer ui) by its tr- id; --write-tags "
              "tags them flag.<name>")  # fmt: skip
    return 0


def write_tags(tracking_uri: str | None, by_trace: dict[str, list[str]]) -> int:
    """``flag.<name> = "true"`` on each flagged trace, through MLflow's own client."""
    from mlflow.tracking import MlflowClient

    from tracer.backends.mlflow_backend import mlflow_trace_id
    from tracer.readers.health import TAG_PREFIX
    from tracer.readers.sources import _default_tracking_uri

    client = MlflowClient(tracking_uri=tracking_uri or _default_tracking_uri())
    n = 0
    for trace_id, names in by_trace.items():
        for name in names:
            client.set_trace_tag(mlflow_trace_id(trace_id), TAG_PREFIX + name, "true")
            n += 1
    return n
