"""``rollout-tracer replay``: export what a spool holds (after an outage or a crash).

    rollout-tracer replay                       # ./.rollout-tracer/spool
    rollout-tracer replay --spool-dir DIR --tracking-uri http://new-server:5000

Every line names its destination (credentials stripped). A destination that no longer exists,
or a project that moved since the spool was written, is reported before anything is sent, and
those batches stay in the spool (exit status 1). A backend whose package is not installed
(mlflow, opentelemetry) is one line naming the extra to install, exit status 2, as for every
command.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any


def configure_replay(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spool-dir", metavar="DIR", help="spool folder, as the run's spool_dir "
                   "(default: ./.rollout-tracer/spool)")  # fmt: skip
    p.add_argument("--tracking-uri", metavar="URI", help="send MLflow batches to this store or "
                   "server instead of the one the run used (a moved project, a new server)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_replay(args: argparse.Namespace) -> int:
    from tracer.replay import destination_of, destination_problem
    from tracer.spool_folders import default_spool_dir, spool_folders

    spool_dir = args.spool_dir or default_spool_dir()
    if args.spool_dir and not os.path.isdir(spool_dir):
        what = "is a file" if os.path.exists(spool_dir) else "does not exist"
        print(f"rollout-tracer replay: error: --spool-dir {spool_dir} {what}: give the spool "
              "folder of the run (its spool_dir; default ./.rollout-tracer/spool in the folder "
              "it ran in)", file=sys.stderr)  # fmt: skip
        return 2
    folders = spool_folders(spool_dir)
    if not folders:
        if args.spool_dir and os.listdir(spool_dir):
            print(f"rollout-tracer replay: error: {spool_dir} is not a spool folder (no "
                  "<backend>-<hash>/destination.json in it)", file=sys.stderr)  # fmt: skip
            return 2
        print(f"nothing to replay: no spool at {spool_dir}")
        return 0
    overrides = {"tracking_uri": args.tracking_uri} if args.tracking_uri else None
    blocked = set()
    for folder, meta in folders:  # before anything is sent
        problem = destination_problem(meta, spool_dir, overrides)
        waiting = sum(1 for _ in folder.glob("*.jsonl"))
        where = f"{meta.get('backend')} -> {destination_of(meta, overrides)}"
        if problem:
            blocked.add(folder.name)
            print(f"{where}: NOT SENT ({waiting} batches stay in {folder}): {problem}",
                  file=sys.stderr)
        elif waiting:
            print(f"{where}: {waiting} batches to replay from {folder}")
    if blocked and len(blocked) == len(folders):
        return 1
    if not any(any(folder.glob("*.jsonl")) for folder, _ in folders):
        print(f"nothing to replay: no batches waiting under {spool_dir}")
        return 1 if blocked else 0
    from tqdm import tqdm

    from tracer.replay import replay

    bars: list[Any] = []  # made at the first batch sent: a backend that cannot start shows none

    def progress(n: int) -> None:
        if not bars:
            bars.append(tqdm(unit="traj", desc="replaying", disable=args.no_progress))
        bars[0].update(n)

    try:
        result = replay(spool_dir, overrides, progress=progress)
    finally:
        for bar in bars:
            bar.close()
    for cause in result.causes.values():  # a backend's package missing: as every command
        from rollout.extras import missing_package

        if missing_package(cause):
            raise cause  # rollout/cli.py main: one line naming the extra, exit status 2
    for name, n in sorted(result.replayed.items()):
        left = result.left.get(name, 0)
        print(f"{result.destinations[name]}: {n} trajectories replayed"
              + (f", {left} batches left" if left else ""))  # fmt: skip
    for name, n in sorted(result.in_doubt.items()):
        print(f"{result.destinations[name]}: {n} of them were in doubt (an export call of "
              "unknown outcome had them: one still running at a shutdown's deadline, or in a "
              "process killed during it) and this backend does not deduplicate: they may be "
              "stored twice")  # fmt: skip
    for name, why in sorted(result.failed.items()):
        if name not in blocked:
            print(f"{result.destinations.get(name, name)}: FAILED: {why} (the batches stay in "
                  "the spool; run replay again)")  # fmt: skip
    return 0 if result.ok else 1
