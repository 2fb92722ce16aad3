"""Faults that overlap, as on a real cluster: the durability promise under a seeded schedule.

Two rollout processes (``tests/_chaos_rollout.py``, each with a thread that holds the GIL a
quarter of the time and the MLflow export child of the default config) trace into one real
``mlflow server`` and share a spool on a small tmpfs. For ``CHAOS_SECONDS`` (default 60), at
``CHAOS_RATE`` trajectories a second per process (default 6), a schedule drawn from the seed:
- SIGKILLs the server and restarts it (3 times);
- SIGKILLs a rollout process and starts a replacement (2 times);
- fills the spool's disk to the last byte for 3-6 s (2 times; the first while the server is
  down too, so batches have nowhere to go but memory);
- SIGKILLs the export child of a live rollout process (2 times; the tracer starts another);
- hangs the server (SIGSTOP to its process group) for 3-8 s, then SIGCONT (once, away from
  its kills: a hung server, not a dead one);
- SIGKILLs a replay during its export call, after the server stored its batch, and replays
  again (``tests/_chaos_replay.py``: the spool of a third rollout process, SIGKILLed while the
  server was down; the replays count the copies a sink that does not deduplicate would hold);
- slows the spool disk: each create, rename and removal of a spool file takes 50-200 ms, in
  every process, for 5-10 s (twice).
At the end every survivor gets SIGINT on its process group (a terminal's Ctrl-C) and shuts down
gracefully; then ``rollout-tracer replay`` exports what the spool still holds.

The check, read back with MLflow's client: every trajectory a process finished more than 2 s
before that process was killed (all of them, for the survivors) is stored exactly once, and any
other finished trajectory that is missing is counted as dropped by its process (survivors) or
lies in the last 2 s before a kill. No export child outlives its parent. Of what the replays
sent, every trajectory sent twice was reported in doubt: duplicates and in-doubt are counted
apart, and a silent duplicate fails the test.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests._chaos_replay import ReplayKill
from tests._procs import parent_of
from tests._procs import running as alive
from tests._servers import MlflowServer, free_port, start_mlflow_server

pytest.importorskip("mlflow")

# The suite runs one 60 s schedule (seed 1: every fault kind, the first disk fill while the
# server is down); `python -m benchmarks.chaos` runs the full-size soak (150 s, several seeds)
SECONDS = float(os.environ.get("CHAOS_SECONDS", "60"))
SEEDS = [int(s) for s in os.environ.get("CHAOS_SEEDS", "1").split(",")]
# trajectories a second per rollout process: 6 in the suite (the server's ingest of both
# processes is half a core at 12; the faults overlap the same at 6), 12 in the soak
RATE = float(os.environ.get("CHAOS_RATE", "6"))
# the share of the time each rollout process's busy thread holds the GIL (20 ms bursts): 0.25
# in the suite, 0.5 in the soak
BUSY = float(os.environ.get("CHAOS_BUSY", "0.25"))
assert 0 < BUSY <= 1, f"CHAOS_BUSY={BUSY}: a share of the time, more than 0, at most 1"
# how the busy thread holds the GIL (tests/_chaos_rollout.py ``spin``): in the suite a C call
# that keeps it and spends no CPU ("hold"), in the soak Python code that runs ("spin")
BUSY_KIND = os.environ.get("CHAOS_BUSY_KIND", "hold")
assert BUSY_KIND in ("hold", "spin"), f"CHAOS_BUSY_KIND={BUSY_KIND}: hold or spin"
GRACE_S = 2.0  # what finished this close to its process's SIGKILL may be lost


class Rollout:
    """One rollout process: its ledger of finished trajectories, and when it was killed."""

    def __init__(self, worker: int, tmp: Path, uri: str, spool: Path) -> None:
        slow = tmp / "slow-disk"  # exists while the spool disk is slow
        self.worker = worker
        self.ledger = tmp / f"ledger-{worker}.txt"
        self.log = open(tmp / f"rollout-{worker}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests._chaos_rollout", str(self.ledger), uri, str(spool),
             str(worker), str(RATE), str(slow), str(BUSY), BUSY_KIND],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip
        self.killed_at: float | None = None
        self.children: set[int] = set()

    def finished(self) -> list[tuple[str, str, float]]:
        if not self.ledger.exists():
            return []
        rows = [line.split() for line in self.ledger.read_text().splitlines()]
        return [(r[0], r[1], float(r[2])) for r in rows if len(r) == 3]

    def kill(self) -> None:
        self.killed_at = time.time()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def interrupt(self) -> None:
        """Ctrl-C in its terminal: SIGINT to its whole process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGINT)

    def final(self) -> dict[str, Any]:
        path = Path(f"{self.ledger}.metrics.json")
        return json.loads(path.read_text()) if path.exists() else {}


def children_of(pids: set[int]) -> set[int]:
    """Processes whose parent is one of ``pids`` (read from /proc)."""
    out = set()
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if entry.isdigit() and parent_of(int(entry)) in pids:
                out.add(int(entry))
    return out


class Disk:
    """A small tmpfs for the spool, filled to the last byte on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir()
        mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(path)],
                               capture_output=True, text=True)  # fmt: skip
        if mount.returncode != 0:
            pytest.skip(f"the chaos test needs a tmpfs for the spool: {mount.stderr.strip()}")
        self.filler = path / "filler"
        self.full = False

    def fill(self) -> None:
        self.full = True
        with open(self.filler, "ab", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"x" * 65536)
        with open(self.filler, "ab", buffering=0) as f, contextlib.suppress(OSError):
            while True:  # the last bytes
                f.write(b"x")

    def free(self) -> None:
        self.full = False
        with contextlib.suppress(FileNotFoundError):
            self.filler.unlink()

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


def schedule(seed: int) -> list[tuple[float, str]]:
    """The seeded timeline: (seconds from the start, event)."""
    rng = random.Random(seed)
    span = SECONDS - 20  # leave the end quiet enough to see the last events settle
    events: list[tuple[float, str]] = []
    server_kills: list[float] = []
    while len(server_kills) < 3:  # 6 s apart at least: each kill finds a server up
        server_kills = sorted(rng.uniform(5, span) for _ in range(3))
        if any(b - a < 6 for a, b in itertools.pairwise(server_kills)):
            server_kills = []
    starts = [t + rng.uniform(2, 4) for t in server_kills]
    for t, up in zip(server_kills, starts, strict=True):
        events += [(t, "server_kill"), (up, "server_start")]
    # the first disk fill starts while the server is down: memory is the batches' only home
    fills = [server_kills[0] + 0.5, rng.uniform(10, span)]
    for t in fills:
        events += [(t, "disk_fill"), (t + rng.uniform(3, 6), "disk_free")]
    busy = [(t - GRACE_S, t + 9) for t in fills]  # no process kill while the disk is full
    free = [x / 2 for x in range(16, int(span * 2)) if all(not a <= x / 2 <= b for a, b in busy)]
    assert len(free) >= 8, f"CHAOS_SECONDS={SECONDS} leaves no room for the process kills"
    first = rng.choice(free[: len(free) // 2])
    second = rng.choice([t for t in free if t > first + 4] or free[-1:])
    events += [(first, "rollout_kill"), (second, "rollout_kill")]
    # drawn after the others, so a seed's earlier faults stay where they were
    events += [(rng.uniform(5, span), "child_kill") for _ in range(2)]
    for _ in range(1000):  # the hang: the server is up (a kill leaves it down up to 4 s)
        hang, length = rng.uniform(5, span), rng.uniform(3, 8)  # and is not killed meanwhile
        if all(not hang - 5 <= t <= hang + length + 3 for t in server_kills):
            break
    else:
        raise AssertionError(f"CHAOS_SECONDS={SECONDS} leaves no room for the server's hang")
    events += [(hang, "server_stop"), (hang + length, "server_cont")]
    # the replay's source dies while the server is down (its spool then holds batches; if it
    # holds none, later, when it does), and its spool is replayed once the server is back; they
    # use no draw: the rest stays put
    events += [(server_kills[0] + 1, "source_kill"), (starts[0] + 1, "replay_kill")]
    for low, high in ((5, span / 2 - 5), (span / 2 + 5, span)):  # two, apart
        slow = rng.uniform(low, high)
        events += [(slow, "disk_slow"), (slow + rng.uniform(5, 10), "disk_fast")]
    return sorted(events)


def export_children(pid: int) -> list[int]:
    """The export children of rollout process ``pid`` (by their command line)."""
    out = []
    for child in children_of({pid}):
        with contextlib.suppress(OSError):
            if b"export_process" in Path(f"/proc/{child}/cmdline").read_bytes():
                out.append(child)
    return out


@pytest.mark.slow(seconds=100)
@pytest.mark.long
@pytest.mark.export_child  # the default config's export child is part of what is tested
@pytest.mark.parametrize("seed", SEEDS)
def test_overlapping_faults_lose_nothing_uncounted(tmp_path: Path, seed: int) -> None:
    # about CHAOS_SECONDS + a minute: the point is faults overlapping over time, in one run
    root = tmp_path / "server"
    root.mkdir()
    port = free_port()
    server: MlflowServer | None = start_mlflow_server(root, port)
    assert server is not None
    url = server.url
    disk = Disk(tmp_path / "spooldisk")
    spool = disk.path / "spool"
    rollouts: list[Rollout] = []
    slow = tmp_path / "slow-disk"
    # the replay-kill fault's source: its spool is its own (no live tracer replays it) and on
    # the test's disk (it dies while the tmpfs may be full: what it kept in memory would go)
    source_spool = tmp_path / "source-spool"
    replays = ReplayKill(tmp_path, source_spool, slow)
    source = Rollout(0, tmp_path, url, source_spool)
    try:
        rollouts = [Rollout(w, tmp_path, url, spool) for w in (1, 2)]
        start = time.monotonic()
        events = schedule(seed)
        rng = random.Random(seed)  # which export child a child_kill takes
        child_kills = 0
        hung: MlflowServer | None = None
        # when the disk was last freed and fast since: what a fill left in memory goes back to
        # disk one batch file at a time, at the disk's speed (None: freed while slow, waiting)
        freed_at: float | None = 0.0
        while events or replays.running or time.monotonic() - start < SECONDS:
            said = replays.poll()
            if said == "replay_kill failed" and time.monotonic() - start < SECONDS + 20:
                events = sorted([*events, (time.monotonic() - start + 1, "replay_kill")])
            if said:
                print(f"{time.monotonic() - start:6.1f} s  {said}", flush=True)
            live = {r.proc.pid for r in [*rollouts, source] if r.proc.poll() is None}
            for r in [*rollouts, source]:  # remember every export child, to check none is orphaned
                r.children |= children_of({r.proc.pid}) if r.proc.pid in live else set()
            due = events and time.monotonic() - start >= events[0][0]
            # a process kill waits while the disk is full (a restart ran late) and until the
            # freed disk has been fast for 3 s: what waited in memory is on disk by then; and
            # not just before a fill (its replacement would start on a full disk)
            now = time.monotonic() - start
            held = disk.full or freed_at is None or now - (freed_at - start) < 3 or any(
                e == "disk_fill" and t - now < GRACE_S + 1 for t, e in events)  # fmt: skip
            if due and events[0][1] == "rollout_kill" and held:
                events = sorted([*events[1:], (time.monotonic() - start + 0.5, "rollout_kill")])
                continue
            if due:
                planned, event = events.pop(0)
                if event not in ("child_kill", "replay_kill", "source_kill"):  # once done
                    print(f"{time.monotonic() - start:6.1f} s  {event}", flush=True)
                if event == "server_kill" and server is not None:
                    server.stop(kill=True)
                    server = None
                elif event == "server_start" and server is None:
                    server = start_mlflow_server(root, port)
                elif event == "disk_fill":
                    disk.fill()
                elif event == "disk_free":
                    disk.free()
                    freed_at = None if slow.exists() else time.monotonic()
                elif event == "disk_slow":
                    slow.touch()
                    if freed_at is not None and time.monotonic() - freed_at < 3:
                        freed_at = None  # its backlog is not on disk yet
                elif event == "disk_fast":
                    slow.unlink(missing_ok=True)
                    if freed_at is None:
                        freed_at = time.monotonic()
                elif event == "source_kill" and source.proc.poll() is not None:
                    raise AssertionError(f"the replay's source ended: {source.log.name}")
                elif event == "source_kill" and not any(source_spool.glob("*/*.jsonl")):
                    # still starting, or everything exported: a moment with batches on disk
                    events = sorted([*events, (time.monotonic() - start + 0.2, event)])
                elif event == "source_kill":
                    source.kill()
                    print(f"{time.monotonic() - start:6.1f} s  {event}", flush=True)
                elif event == "replay_kill" and source.killed_at is None:
                    events = sorted([*events, (time.monotonic() - start + 0.5, event)])
                elif event == "replay_kill" and not replays.running:
                    replays.start("kill")
                elif event == "rollout_kill":
                    victim = next(r for r in rollouts if r.proc.poll() is None)
                    victim.kill()
                    rollouts.append(Rollout(len(rollouts) + 1, tmp_path, url, spool))
                elif event == "child_kill":
                    children = [c for r in rollouts if r.proc.poll() is None
                                for c in export_children(r.proc.pid)]  # fmt: skip
                    if children:
                        os.kill(rng.choice(children), signal.SIGKILL)
                        child_kills += 1
                        print(f"{time.monotonic() - start:6.1f} s  {event}", flush=True)
                    elif time.monotonic() - start < SECONDS + 20:  # none now (starting): later
                        # (past SECONDS too, as replay_kill: at a load of 6-8 a replacement's
                        # child was still starting when the schedule ended)
                        events = sorted([*events, (time.monotonic() - start + 0.5, event)])
                elif event == "server_stop" and server is not None:
                    os.killpg(server.proc.pid, signal.SIGSTOP)
                    hung = server
                    # hung for as long as planned, from now (a late loop must not shorten it)
                    now = time.monotonic() - start
                    events = sorted((now + t - planned, e) if e == "server_cont" else (t, e)
                                    for t, e in events)  # fmt: skip
                elif event == "server_cont" and hung is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(hung.proc.pid, signal.SIGCONT)
                    hung = None
                continue
            time.sleep(0.1)
        disk.free()
        slow.unlink(missing_ok=True)
        if hung is not None:
            os.killpg(hung.proc.pid, signal.SIGCONT)
            hung = None
        # on a loaded machine a replacement's child may miss its 10 s start and the process
        # exports in-process (one warning): then there is none to kill
        assert child_kills >= 1, "no export child was there to kill"
        if server is None:
            server = start_mlflow_server(root, port)
        assert replays.kills >= 1, "no replay was killed in its call"
        replays.finish()  # replay again until the source's spool is empty
        assert replays.done, "the replays after the kill never stored what was left"
        deadline = time.monotonic() + 120  # a replacement still starting: Ctrl-C after init
        while any(r.proc.poll() is None and not r.finished() for r in rollouts):
            assert time.monotonic() < deadline, "a rollout process never finished a trajectory"
            time.sleep(0.2)
        print(f"{time.monotonic() - start:6.1f} s  Ctrl-C to the survivors", flush=True)
        for r in rollouts:
            if r.proc.poll() is None:
                r.interrupt()
        for r in rollouts:
            if r.killed_at is None:
                assert r.proc.wait(120) == 0, (r.log.name, Path(r.log.name).read_text()[-3000:])
        print(f"{time.monotonic() - start:6.1f} s  replay", flush=True)
        replay = subprocess.run(
            [str(Path(sys.executable).with_name("rollout-tracer")), "replay", "--spool-dir",
             str(spool)], capture_output=True, text=True, timeout=300)  # fmt: skip
        assert replay.returncode == 0, replay.stdout + replay.stderr

        print(f"{time.monotonic() - start:6.1f} s  reading back", flush=True)
        stored = Counter(_stored_keys(root))
        twice = {k: n for k, n in stored.items() if n > 1}
        assert not twice, f"stored more than once: {list(twice.items())[:10]}"
        problems = []
        for r in [*rollouts, source]:
            done = r.finished()
            missing = [(s, i, t) for s, i, t in done if (s, i) not in stored]
            if r.killed_at is None:
                final = r.final()
                assert final, f"rollout {r.worker} wrote no final metrics"
                m = final["metrics"]
                dropped = m.get("tracer/mlflow/dropped", 0)
                if len(missing) != dropped:
                    problems.append(
                        f"rollout {r.worker} (Ctrl-C): {len(missing)} of {len(done)} "
                        f"missing, {dropped} counted dropped: {missing[:5]}"
                    )
            else:
                late = [x for x in missing if x[2] < r.killed_at - GRACE_S]
                if late:
                    problems.append(
                        f"rollout {r.worker} (SIGKILL): {len(late)} of {len(done)} "
                        f"finished > {GRACE_S} s before the kill are missing: "
                        f"{late[:5]}"
                    )
        assert not problems, "\n".join(problems)
        everyone = [*rollouts, source]
        finished = sum(len(r.finished()) for r in everyone)
        in_grace = sum(1 for r in everyone for s, i, _ in r.finished() if (s, i) not in stored)
        sent = replays.summary()
        print(
            f"chaos seed {seed}: {finished} finished in {len(everyone)} processes "
            f"({sum(r.killed_at is not None for r in everyone)} SIGKILLed, {child_kills} "
            f"export children SIGKILLed), {len(stored)} "
            f"stored once, {in_grace} missing, each within {GRACE_S} s of its process's kill; "
            f"{sent['kills']} replay SIGKILLed in its call: {sent['duplicates']} trajectories "
            f"sent twice by the replays, {sent['in_doubt']} reported in doubt, "
            f"{sent['silent']} silent duplicates"
        )
        assert sent["silent"] == 0, f"sent twice without a word: {sent}"
        assert sent["duplicates"] >= 1, f"the killed replay's batch was never sent again: {sent}"
        # it really ran: every process that lived past its start traced, through the faults
        assert all(r.finished() for r in rollouts if r.killed_at is None)
        assert sum(len(r.finished()) for r in rollouts) > RATE  # (63 at a load average of 10)
        deadline = time.monotonic() + 10
        orphans = {pid for r in everyone for pid in r.children if alive(pid)}
        while orphans and time.monotonic() < deadline:
            time.sleep(0.1)
            orphans = {pid for pid in orphans if alive(pid)}
        assert not orphans, f"export children outlived their rollout process: {orphans}"
    finally:
        replays.close()
        for r in [*rollouts, source]:
            if r.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.proc.pid, signal.SIGKILL)
                r.proc.wait(10)
            r.log.close()
            for pid in r.children:  # never leave ours behind, even when the test failed
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    if alive(pid):
                        os.kill(pid, signal.SIGKILL)
        if server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.proc.pid, signal.SIGCONT)  # a hung one can stop
            server.stop()
        disk.unmount()


def _stored_keys(root: Path) -> list[tuple[str, str]]:
    """(step, sample_index) of every stored trace, read with MLflow's client from the
    server's own store (no spans: only the trace tags are needed)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("chaos")
    assert exp is not None, "nothing was stored"
    keys: list[tuple[str, str]] = []
    token = None
    while True:
        page = client.search_traces(locations=[exp.experiment_id], max_results=500,
                                    page_token=token, include_spans=False)  # fmt: skip
        keys += [(t.info.tags["step"], t.info.tags["sample_index"]) for t in page]
        token = page.token
        if not token:
            return keys
