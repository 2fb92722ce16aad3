"""benchmarks/ingest.py cleans up after itself: a writer that fails stops the others, and no
process it started is left behind (writers, and their export children), nor a folder (their
working folders and spools)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from benchmarks.ingest_procs import WriterFailed, leftovers, run_writers


def _descendants_alive(pids: set[int]) -> list[int]:
    """Processes whose parent is one of ``pids`` or whose session is one of theirs."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ppid, session = int(fields[1]), int(fields[4])
        if (ppid in pids or session in pids) and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


@pytest.mark.slow(seconds=20)
def test_a_writer_that_fails_stops_the_others_and_nothing_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    temp = tmp_path / "tmp"  # the writers' working folders and spools go here, then away
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    started: list[int] = []
    args = [[uri, "cleanup", "1000000", f"w{i}", "0"] for i in range(2)]
    args.append([uri, "cleanup", "not-a-number", "w2", "0"])  # fails at its start
    with pytest.raises(WriterFailed, match="writer 2"):
        run_writers(args, pin=None, timeout_s=300, on_start=started.append)
    assert len(started) == 3
    assert leftovers() == []
    assert list(temp.iterdir()) == []
    assert _descendants_alive(set(started)) == []
    assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in started)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_leftovers_names_only_this_runs_writers() -> None:
    assert os.getpid() not in leftovers()


def test_a_writers_cpu_counts_a_child_started_by_another_thread() -> None:
    """The export child is started by the tracer's launcher thread, so the kernel lists it
    under that thread's task: the writers' CPU column must still count it (it read 0.4 CPU-s
    per 1,000 traces instead of ~3-4 when only the main thread's children were counted)."""
    import subprocess
    import sys
    import threading

    from benchmarks.ingest_procs import stat_cpu_s, tree_cpu_s

    burn = "import time\nwhile time.process_time() < 0.5: pass\nprint(flush=True)\ntime.sleep(60)"
    children: list[subprocess.Popen[str]] = []
    done = threading.Event()

    # like the launcher thread, it stays alive while its child runs (a thread that exits
    # hands its children to the main thread, which the old count saw)
    def start_and_stay() -> None:
        children.append(subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE,
                                         text=True))  # fmt: skip
        done.wait(120)

    starter = threading.Thread(target=start_and_stay)
    starter.start()
    while not children:
        threading.Event().wait(0.01)
    child = children[0]
    try:
        before = tree_cpu_s(os.getpid()) - tree_cpu_s(child.pid)
        own = stat_cpu_s(os.getpid(), reaped=False)
        assert child.stdout is not None and child.stdout.readline() == "\n"  # it burned 0.5 s
        assert tree_cpu_s(child.pid) >= 0.45  # /proc counts in clock ticks
        assert tree_cpu_s(os.getpid()) - before >= 0.45
        # the held run's rollout column: this process alone, its live child not in it
        assert stat_cpu_s(os.getpid(), reaped=False) - own < 0.3
    finally:
        child.kill()
        child.wait()
        done.set()
        starter.join()


def test_the_lag_is_since_the_newest_stored_trajectory_was_made() -> None:
    """A writer's lag samples: at each, the seconds since the newest stored trajectory was
    made (none stored: since the first was made); samples after the last one was made are
    the drain, not the lag. The summary takes all writers' samples together."""
    from benchmarks.ingest_held import Lags, lag_summary

    lags = Lags([10.0, 11.0, 12.0], every_s=3600)  # its thread samples nothing here
    lags.stop()
    lags.taken = [(10.5, 0), (11.5, 1), (12.5, 3), (14.0, 3)]
    assert lags.samples(made=13.0) == [(10.5, 0.5), (11.5, 1.5), (12.5, 0.5)]
    summary = lag_summary([lags.samples(13.0), [(12.0, 4.0)]], start=10.0)
    assert summary["p50"] == 1.5 and summary["max"] == 4.0
    assert summary["max_by_tenth"] == [0, 0, 0.5, 0, 0, 0, 1.5, 0, 4.0, 0.5]
    assert lag_summary([[]], start=0.0) == {}
    # a writer that stored a warm-up trajectory first: the tracer's count includes it
    warm = Lags([10.0, 11.0, 12.0], every_s=3600, stored_before=1)
    warm.stop()
    warm.taken = [(10.5, 1), (11.5, 2), (12.5, 4)]
    assert warm.samples(made=13.0) == lags.samples(made=13.0)[:3]


def test_a_rate_is_held_when_the_store_keeps_up_not_when_it_drains_a_backlog() -> None:
    from benchmarks.ingest_held import is_held

    def run(made: float, wall: float, drain: float) -> dict[str, float]:
        return {"offered_per_s": 1100.0, "made_per_s": made, "wall_s": wall, "drain_s": drain}

    assert is_held(run(1098.1, 61.0, 1.0))  # a batch behind at the end
    assert is_held(run(1098.1, 62.8, 2.8))  # 5 % of a 60 s run
    assert not is_held(run(1098.1, 9.1, 4.1))  # a 5 s run that took 4 s more to store
    assert not is_held(run(1029.3, 123.8, 61.0))  # the writers fell behind, and the store
    assert not is_held(run(1000.0, 61.0, 1.0))  # made less than offered


def test_the_counts_sampler_keeps_a_process_that_exited() -> None:
    """benchmarks/pg_counts.py's Sampler: a child that burns ~0.3 s of CPU and exits before
    the sampler stops still counts, by both clocks (its last reading is kept)."""
    import subprocess
    import sys
    import time

    from benchmarks.pg_counts import Sampler

    child = subprocess.Popen([sys.executable, "-c", "import time\ninput()\n"
                              "t = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass"],
                             stdin=subprocess.PIPE)  # fmt: skip
    try:
        sampler = Sampler(lambda: [child.pid], every_s=0.01)
        time.sleep(0.2)  # its start-up done: it waits for the line
        sampler.start()
        child.communicate(b"go\n", timeout=30)  # it burns, then is gone before stop()
        ticks, run = sampler.stop()
    finally:
        child.kill()
        child.wait()
    assert child.pid in sampler.last
    assert 0.25 < run < 1.0 and 0.2 < ticks < 1.1, (ticks, run)
