"""The full-size chaos soak: tests/test_chaos.py with longer schedules and more seeds.

    python -m benchmarks.chaos                      # 150 s per seed, seeds 1,2,3
    python -m benchmarks.chaos --seconds 300 --seeds 4,5

The test suite runs one 60 s schedule (seed 1, 6 trajectories a second per process), enough
to overlap every fault kind once; this runs what issue 37 first reproduced (150 s at 12 a
second: server kills, rollout kills and disk fills overlapping; since issue 47 also export
children SIGKILLed and the server hung for 3-8 s; since issue 56 a replay SIGKILLed inside its
export call and replayed again, and a slow spool disk) for several seeds, one after another
(each takes both cores). It needs root for the tmpfs the spool fills. Exits with
pytest's status; each seed prints its ledger summary.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.chaos", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--seconds", type=float, default=150.0, help="schedule length per seed")
    parser.add_argument("--seeds", default="1,2,3", help="comma-separated seeds")
    parser.add_argument("--rate", type=float, default=12.0,
                        help="trajectories a second per rollout process (the suite runs 6)")
    parser.add_argument("--busy", type=float, default=0.5,
                        help="share of the time each rollout process's busy thread holds the "
                             "GIL, spinning Python (the suite runs 0.25, in a C call that "
                             "keeps the GIL without spending CPU)")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not 0 < args.busy <= 1:
        parser.error("--busy is a share of the time: more than 0, at most 1")
    if not seeds or args.seconds < 50:
        parser.error("give at least one seed and --seconds >= 50 (the schedule needs the room)")
    env = dict(os.environ, CHAOS_SECONDS=str(args.seconds), CHAOS_RATE=str(args.rate),
               CHAOS_SEEDS=",".join(map(str, seeds)), CHAOS_BUSY=str(args.busy),
               CHAOS_BUSY_KIND="spin")  # the soak's busy threads spend the CPU too  # fmt: skip
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-s", "-q",
           "--durations=0", "tests/test_chaos.py"]  # fmt: skip
    return subprocess.call(cmd, cwd=ROOT, env=env)


if __name__ == "__main__":
    raise SystemExit(main())
