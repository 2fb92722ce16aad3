"""The replay-kill fault of the chaos test (tests/test_chaos.py): a replay SIGKILLed during its
export call, then a replay again.

A rollout process of its own (``source``) traces into the chaos server with a spool of its own,
and is SIGKILLed while the server is down, so its spool holds batches nobody else replays (the
live tracers scan only their own folder). Then ``python -m tests._chaos_replay kill SPOOL OUT
SLOW`` runs ``tracer.replay.replay`` on it; its first export call stores its batch in the server
and writes the batch's keys to OUT, and the test SIGKILLs it there, inside the call. Then
``python -m tests._chaos_replay again SPOOL OUT SLOW`` replays what is left (until one of them
stores everything: a server kill or a hang fails its calls meanwhile) and writes what it stored
and what it reported in doubt to OUT.

Both declare the sink as one that does not deduplicate (an OTLP collector appends what it
gets), so replay reports what it sends while it may be stored already. The MLflow server below
does deduplicate by trace id (the test's read-back still sees each trajectory once), so the test
counts the copies an appending sink would hold: one per call that stored a trajectory. A
trajectory with two copies is a duplicate; reported in doubt, it is accounted for; otherwise it
is a silent duplicate, the bug of issue 56 (a replay killed after the sink stored its batch left
it unmarked, and the next replay sent it again without a word).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _write_json(path: Path, payload: Any) -> None:
    """All at once (the test polls for the file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def main() -> None:
    mode, spool, out, slow = sys.argv[1:5]
    print(f"{mode}: started at {time.time():.1f}", flush=True)
    from tests._chaos_rollout import slow_disk
    from tracer.backends import register_backend
    from tracer.backends.base import ExportResult
    from tracer.backends.mlflow_backend import MlflowExporter
    from tracer.replay import replay

    slow_disk(Path(slow))
    delivered: list[list[Any]] = []

    class Appending(MlflowExporter):
        """The real MLflow exporter, declared as a sink that keeps every copy it is sent."""

        deduplicates = False

        def export(self, batch: Any, *, replay: bool = False) -> ExportResult:
            result = super().export(batch, replay=replay)
            if result is ExportResult.FAILURE:
                return result
            keys = [[str(r.step), str(r.sample_index)] for r in batch]
            if mode == "kill":  # stored: the test SIGKILLs us here, inside the call
                _write_json(Path(out), keys)
                time.sleep(600)
            delivered.extend(keys)
            return result

    register_backend("mlflow", Appending)  # the name its spool folder was written with
    in_doubt = 0
    while True:  # until a call stores (kill) or all is stored (again): the server comes back
        result = replay(spool)
        in_doubt += sum(result.in_doubt.values())
        print(f"{mode}: {result.replayed} replayed, failed: {result.failed}", flush=True)
        if result.ok and (mode == "again" or not any(Path(spool).glob("*/*.jsonl"))):
            break  # all stored; or (kill) nothing there to be killed in the call of
        time.sleep(1)
    if mode == "again":
        _write_json(Path(out), {"ok": True, "in_doubt": in_doubt, "delivered": delivered})


class ReplayKill:
    """The test's side of the fault: start the replay, kill it in its call, replay again."""

    def __init__(self, tmp: Path, spool: Path, slow: Path) -> None:
        self.tmp, self.spool, self.slow = tmp, spool, slow
        self.proc: subprocess.Popen[bytes] | None = None
        self.mode = ""
        self.out = tmp / "replay-out.json"
        self.log = open(tmp / "replays.log", "ab")  # noqa: SIM115
        self.kills = 0
        self.copies: Counter[tuple[str, str]] = Counter()  # what an appending sink holds
        self.in_doubt = 0  # trajectories the replays reported as maybe stored twice
        self.done = False  # a replay again stored everything that was left

    def start(self, mode: str) -> None:
        self.out.unlink(missing_ok=True)
        self.mode = mode
        # MLflow's client retries a dead server for minutes with backoff; one attempt of at
        # most 10 s, and the replay again a second later, keeps the replay among the faults
        env = {**os.environ, "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests._chaos_replay", mode, str(self.spool), str(self.out),
             str(self.slow)], stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=ROOT, env=env)  # fmt: skip

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll(self) -> str | None:
        """Advance: kill a replay that has stored in its call, collect a finished one. Returns
        what happened, None while nothing did."""
        if self.proc is None:
            return None
        if self.mode == "kill" and self.out.exists() and self.running:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
            self.copies.update(tuple(k) for k in json.loads(self.out.read_text()))
            self.kills += 1
            self.proc = None
            self.start("again")
            return "replay_kill"
        if self.running:
            return None
        self.proc.wait()
        self.proc = None
        if self.mode == "kill":
            return "replay_kill failed"  # nothing was there to replay
        if self.out.exists():  # it stored everything
            report = json.loads(self.out.read_text())
            self.copies.update(tuple(k) for k in report["delivered"])
            self.in_doubt += report["in_doubt"]
            self.done = True
        return "replay_again" if self.done else "replay_again failed"

    def finish(self, timeout: float = 180) -> None:
        """Replay again until everything is stored (the server is up now)."""
        deadline = time.monotonic() + timeout
        while not self.done and time.monotonic() < deadline:
            if self.proc is None:
                self.start("again")
            self.poll()
            time.sleep(0.2)

    def close(self) -> None:
        if self.running and self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()

    def summary(self) -> dict[str, int]:
        twice = sum(1 for n in self.copies.values() if n > 1)
        return {"kills": self.kills, "duplicates": twice, "in_doubt": self.in_doubt,
                "silent": max(0, twice - self.in_doubt)}  # fmt: skip


if __name__ == "__main__":
    main()
