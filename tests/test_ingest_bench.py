"""benchmarks/ingest.py cleans up after itself: a writer that fails stops the others, and no
process it started is left behind (writers, and their export children)."""

from __future__ import annotations

import os
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
def test_a_writer_that_fails_stops_the_others_and_nothing_is_left(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    started: list[int] = []
    args = [[uri, "cleanup", "1000000", f"w{i}", "0"] for i in range(2)]
    args.append([uri, "cleanup", "not-a-number", "w2", "0"])  # fails at its start
    with pytest.raises(WriterFailed, match="writer 2"):
        run_writers(args, pin=None, timeout_s=300, on_start=started.append)
    assert len(started) == 3
    assert leftovers() == []
    assert _descendants_alive(set(started)) == []
    assert all(not Path(f"/proc/{pid}").exists() or _zombie(pid) for pid in started)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_leftovers_names_only_this_runs_writers() -> None:
    assert os.getpid() not in leftovers()
