"""``rollout-tracer replay``: export what a spool holds (after an outage or a crash).

    rollout-tracer replay                       # ./.rollout-tracer/spool
    rollout-tracer replay --spool-dir DIR --tracking-uri http://new-server:5000
"""

from __future__ import annotations

import argparse


def configure_replay(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spool-dir", help="spool folder (default: ./.rollout-tracer/spool)")
    p.add_argument("--tracking-uri", help="send MLflow batches here instead of the stored URI")


def cmd_replay(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tracer.replay import replay
    from tracer.spool import default_spool_dir, spool_folders

    spool_dir = args.spool_dir or default_spool_dir()
    folders = spool_folders(spool_dir)
    if not folders:
        print(f"nothing to replay: no spool under {spool_dir}")
        return 0
    overrides = {"tracking_uri": args.tracking_uri} if args.tracking_uri else None
    with tqdm(unit="traj", desc="replaying") as bar:
        result = replay(spool_dir, overrides, progress=bar.update)
    for name, n in sorted(result.replayed.items()):
        left = result.left.get(name, 0)
        print(f"{name}: {n} trajectories replayed" + (f", {left} batches left" if left else ""))
    for name, why in sorted(result.failed.items()):
        print(f"{name}: FAILED: {why} (the batches stay in the spool; run replay again)")
    return 0 if result.ok else 1
