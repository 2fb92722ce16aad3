"""``rollout-tracer flags``: the health flags of a run, and its rising behaviour patterns, for a
terminal user.

    rollout-tracer flags --from mlflow --tracking-uri sqlite:///mlflow.db --experiment gsm8k
    rollout-tracer flags --from parquet --path exports/gsm8k --examples 3
    rollout-tracer flags --from mlflow --experiment gsm8k --write-tags   # flag.<name> tags
    rollout-tracer flags --from parquet --path exports/gsm8k --pattern-window 20 --pattern-growth 2

The rules and thresholds are in :mod:`~tracer.readers.health` and :mod:`~.habits.patterns`
(``--pattern-<threshold>`` sets one of the latter); registered in :mod:`rollout.cli`.
"""

from __future__ import annotations

import argparse
import dataclasses
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
    from tracer.readers.habits.patterns import PatternThresholds

    for f in dataclasses.fields(PatternThresholds):
        if f.name not in ("top", "earned_by"):
            p.add_argument(f"--pattern-{f.name.replace('_', '-')}", dest=f"pattern_{f.name}",
                           type=type(f.default), default=f.default, metavar="X",
                           help=f"behaviour patterns: {f.name} (default {f.default}; "
                           "tracer/readers/habits/patterns.py)")  # fmt: skip


def _patterns(args: argparse.Namespace, trajectories: Any) -> tuple[Any, str | None]:
    """The run's behaviour patterns, or None and why not."""
    from tracer.readers.habits.patterns import PatternThresholds, step_patterns
    from tracer.readers.habits.patterns_sql import NoSignatures

    names = [f.name for f in dataclasses.fields(PatternThresholds)
             if f.name not in ("top", "earned_by")]  # fmt: skip
    th = PatternThresholds(**{name: getattr(args, f"pattern_{name}") for name in names},
                           earned_by=args.earned_by)  # fmt: skip
    try:
        return step_patterns(trajectories, th), None
    except NoSignatures as exc:
        return None, str(exc)


def rising_json(r: Any) -> dict[str, Any]:
    return {"signature": r.signature, "text": r.text, "flags": r.labels, "since": r.since,
            "first_step": r.first_step, "last_step": r.last_step,
            "share_then": round(r.share_then, 4), "share_now": round(r.share_now, 4),
            "peak_share": round(r.peak_share, 4), "peak_step": r.peak_step,
            "reward": round(r.reward, 4), "step_reward": round(r.step_reward, 4),
            "steps": r.steps, "hacking_steps": r.hacking_steps,
            "hacking_step": r.hacking_step, "reason": r.reason, "note": r.note,
            "correct": r.correct, "example": r.example, "template": r.template, "pair": r.pair,
            "curve": [[s, round(v, 4)] for s, v in r.curve]}  # fmt: skip


def _two(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def print_rising(found: Any, examples: int) -> None:
    """The run's summary, then the flagged patterns, one block each: flags, the steps flagged
    (first to last) and share, the pattern, why, and the evidence side by side."""
    print(found.summary())
    if not found.rising:
        print(f"no flagged behaviour pattern over {len(found.steps)} training steps")
        return
    print(f"flagged behaviour patterns ({len(found.rising)}; rules: readers/habits/patterns.py):")
    for r in found.rising:
        first = r.hacking_step if r.hacking else r.first_step
        print(f"  {', '.join(r.labels)}: steps {first}-{r.last_step} (first flagged at step "
              f"{first}), share {100 * r.share_then:.1f}% at step {r.since} -> "
              f"{100 * r.share_now:.1f}% (peak {100 * r.peak_share:.1f}% at step "
              f"{r.peak_step}), reward {r.reward:.2f} vs the step's "
              f"{r.step_reward:.2f}")  # fmt: skip
        print(f"      {r.text}")
        if r.reason:
            print(f"      why: {r.reason}")
        elif r.note:
            print(f"      note: {r.note}")
        if examples and r.pair:
            for name in ("flagged", "earned"):
                t = r.pair[name]
                if t is not None:
                    print(f"      {name}: tr-{t['trace_id']}  (step {t['step']}, reward "
                          f"{_two(t['reward'])}, correctness {_two(t['correct'])})")  # fmt: skip
        elif examples:
            print(f"      tr-{r.example}  (step {r.last_step})")


def cmd_flags(args: argparse.Namespace) -> int:
    if args.write_tags and args.source != "mlflow":
        return fail("flags", f"--write-tags writes MLflow trace tags: it needs --from mlflow "
                    f"(not --from {args.source})")  # fmt: skip
    problem = check_source(args)
    if problem:
        return fail("flags", problem)
    from tracer.readers import read_tables
    from tracer.readers.habits.earned import UnknownPart
    from tracer.readers.health import analyze

    try:
        # health flags need no token text: no tokenizer is loaded
        kwargs = _source_kwargs(args) | {"tokenizers": None}
        tables = read_tables(args.source, allow_empty=False, **kwargs)
    except read_errors() as exc:
        return fail("flags", str(exc), exit_status(exc))
    try:
        health = analyze(tables.trajectories.to_dict("records"), earned_by=args.earned_by)
    except UnknownPart as exc:  # --earned-by names a part no trajectory has
        return fail("flags", str(exc))
    counts = health.counts()
    found, no_patterns = _patterns(args, tables.trajectories)
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
             "trace_ids": f.trace_ids, "detail": f.detail}
            for f in health.steps
        ]  # fmt: skip
        out: dict[str, Any] = {"flags": flags, "steps": steps, "not_judged": health.notes(),
                               "summary": found.summary() if found is not None else None,
                               "rising_patterns": [rising_json(r) for r in found.rising]
                               if found is not None else None}  # fmt: skip
        print(json.dumps(out, indent=1, default=str))
        return 0
    n = len(tables.trajectories)
    if counts:
        _print_health(health, counts, tables.trajectories, args.examples)
    else:
        print(f"no health flags in {n} trajectories")
    for note in health.notes():  # reward not judged: no correct answer to compare with
        print(f"  {note}")
    if found is not None:
        print_rising(found, args.examples)
    else:
        print(f"no behaviour patterns: {no_patterns}")
    if args.source == "mlflow" and (counts or (found is not None and found.rising)):
        print("open a trace in the MLflow UI (rollout-tracer ui) by its tr- id; --write-tags "
              "tags them flag.<name>")  # fmt: skip
    return 0


def _print_health(health: Any, counts: dict[str, dict[Any, int]], trajectories: Any,
                  examples: int) -> None:  # fmt: skip
    from tracer.readers.health import MEANINGS, STEP_FLAGS

    validation = set(trajectories.loc[trajectories["validate"].astype(bool), "trace_id"])
    print(f"health flags in {len(trajectories)} trajectories ({len(health.by_trace)} flagged):")
    for name, per_step in counts.items():
        level = "step" if name in STEP_FLAGS else "trajectory"
        where = ", ".join(f"{k}:{v}" for k, v in sorted(per_step.items(), key=lambda kv:
                                                         str(kv[0])))  # fmt: skip
        print(f"  {name:<28} {sum(per_step.values()):>5} trajectories ({level}; per step "
              f"{where})")  # fmt: skip
        print(f"      {MEANINGS.get(name, '')}")
        for f in health.steps:  # the numbers behind a step flag, where its rule gives them
            if f.name == name and f.detail:
                kind = "validation" if f.validate else "training"
                print(f"      step {f.step} ({kind}): {f.detail}")
        for trace_id in health.examples(name, examples):
            kind = "validation" if trace_id in validation else "training"
            print(f"      tr-{trace_id}  (step {health.step_of.get(trace_id)}, {kind})")


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
