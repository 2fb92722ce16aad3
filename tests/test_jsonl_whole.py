"""A JSONL append is whole or absent, and readers count each trajectory once whatever is on
disk: a disk that fills part way through an append (a real 512 KB tmpfs, where one can be
mounted), a cut-back that fails too, and a hand-made file with a repeated line, a fragment
and a truncated last line. Read back with the file's readers and ``rollout-tracer export``.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer
import tracer.backends.jsonl_backend as jsonl_backend
from rollout.cli import main
from tracer.readers.sources import iter_jsonl
from tracer.record import read_jsonl
from tracer.testing import InMemoryExporter

PAGE = 4096
FREE = 2 * PAGE  # room for about five of the ten lines: the append fails part way


@tracer.trace_op(kind="generate")
def generate(prompt: str) -> dict[str, Any]:
    return {"text": f"answer to {prompt}", "notes": "x" * 1200}


def trace(n: int) -> None:
    for i in range(n):
        with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
            generate(f"question {i}")


@contextlib.contextmanager
def nearly_full_disk(path: Path) -> Iterator[Any]:
    """``path`` on a 512 KB tmpfs with only FREE bytes left; yields a function that frees the
    rest. Skips where no tmpfs can be mounted (no privilege): the fault must be the kernel's."""
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(path)],
                             capture_output=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode().strip()}): a partial "
                    "append needs a real disk that fills part way")  # fmt: skip
    try:
        filler = path / "filler"
        with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"x" * PAGE)
        os.truncate(filler, filler.stat().st_size - FREE)
        yield filler.unlink
    finally:
        tracer.reset()
        subprocess.run(["umount", "-l", str(path)], check=False)


def raw_lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")


def trace_ids_on_disk(path: Path) -> list[str]:
    """The trace id of every whole line in the file, repeats included (the readers' view is
    checked separately)."""
    ids = []
    for line in raw_lines(path)[:-1]:  # the text after the last newline is not a line
        with contextlib.suppress(ValueError):
            ids.append(json.loads(line)["trace_id"])
    return ids


def config(tmp_path: Path, jsonl: Path) -> dict[str, Any]:
    # one batch of ten (the tenth wakes the processor), retried every 0.2 s while the disk is
    # full; the spool is on the real disk
    return {"backend": "jsonl", "jsonl_path": str(jsonl), "spool_dir": str(tmp_path / "spool"),
            "flush_interval_s": 30.0, "export_batch_size": 10, "export_max_retries": 0,
            "replay_interval_s": 0.2}  # fmt: skip


def exported_rows(tmp_path: Path, jsonl: Path, capsys: pytest.CaptureFixture[str]) -> int:
    import pyarrow.parquet as pq

    out = tmp_path / "export"
    assert main(["export", "--from", "jsonl", "--path", str(jsonl), "--out", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    assert "exported 10 trajectories" in capsys.readouterr().out
    return int(pq.read_table(out / "trajectories.parquet").num_rows)


def check_read_once(tmp_path: Path, jsonl: Path, capsys: pytest.CaptureFixture[str]) -> None:
    records = list(read_jsonl(jsonl))
    assert sorted(r.sample_index for r in records) == list(range(10))
    assert sum(len(page) for page in iter_jsonl(str(jsonl))) == 10
    assert exported_rows(tmp_path, jsonl, capsys) == 10


def test_a_disk_that_fills_mid_append_keeps_the_file_whole(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    path = out / "t.jsonl"
    with nearly_full_disk(out) as free_space:
        tracer.init(config(tmp_path, path))
        trace(10)
        assert not tracer.flush(1.0)  # the append failed: the batch waits in the spool
        m = tracer.metrics()
        assert m["tracer/jsonl/pending"] == 10 and m["tracer/jsonl/down"] == 1, m
        assert path.read_bytes() == b""  # the lines that fit were cut back
        free_space()
        assert tracer.flush(60)
        assert tracer.metrics()["tracer/jsonl/exported"] == 10
        on_disk = trace_ids_on_disk(path)
        assert raw_lines(path)[-1] == b""  # no fragment at the end
        assert len(on_disk) == len(set(on_disk)) == 10  # each line written once
        check_read_once(tmp_path, path, capsys)


def test_a_cut_back_that_fails_too_leaves_the_whole_lines_written_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The disk fills part way and the cut-back fails as well: the lines that stayed whole
    count as written (the retry appends only the rest), the fragment is skipped by readers."""
    out = tmp_path / "out"
    path = out / "t.jsonl"

    def no_truncate(fd: int, length: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    real_truncate = os.ftruncate
    with nearly_full_disk(out) as free_space:
        monkeypatch.setattr(jsonl_backend.os, "ftruncate", no_truncate)
        tracer.init(config(tmp_path, path))
        trace(10)
        assert not tracer.flush(1.0)
        whole = trace_ids_on_disk(path)
        assert 0 < len(whole) < 10 and raw_lines(path)[-1] != b""  # a partial line is last
        monkeypatch.setattr(jsonl_backend.os, "ftruncate", real_truncate)
        free_space()
        assert tracer.flush(60)
        on_disk = trace_ids_on_disk(path)
        assert on_disk[: len(whole)] == whole
        assert len(on_disk) == len(set(on_disk)) == 10  # the retry skipped the whole ones
        skipped: collections.Counter[str] = collections.Counter()
        assert len(list(read_jsonl(path, skipped=skipped))) == 10
        assert skipped == {"not_a_record": 1}  # the fragment, followed by the retry's lines
        check_read_once(tmp_path, path, capsys)


def test_readers_keep_the_first_line_of_each_trajectory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A hand-made file: a line repeated (a retried append of another writer), a fragment
    before later appends, a truncated last line; and another trajectory that carries an id
    already used (the same attempt named twice: another start), which is kept."""
    tracer.init(backend="memory")
    trace(10)
    assert tracer.flush(30)
    lines = [json.dumps(r.to_dict()) for r in InMemoryExporter.latest().records]
    tracer.reset()
    assert len(lines) == 10
    same_id = {**json.loads(lines[3]), "start_ns": json.loads(lines[3])["start_ns"] + 1}
    path = tmp_path / "t.jsonl"
    body = [*lines[:6], lines[2], lines[6][:70], *lines[6:9], json.dumps(same_id), lines[3]]
    path.write_text("\n".join(body) + "\n" + lines[9][:120])

    skipped: collections.Counter[str] = collections.Counter()
    with caplog.at_level("WARNING", logger="tracer"):
        records = list(read_jsonl(path, skipped=skipped))
    assert skipped == {"duplicate": 2, "not_a_record": 1, "partial_last_line": 1}
    assert "repeats 2 trajectories" in caplog.text and "partial line" in caplog.text
    assert [r.sample_index for r in records] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 3]
    assert records[3].trace_id == records[-1].trace_id
    assert sum(len(page) for page in iter_jsonl(str(path))) == 10

    out = tmp_path / "export"
    assert main(["export", "--from", "jsonl", "--path", str(path), "--out", str(out),
                 "--no-progress"]) == 0  # fmt: skip
    import pyarrow.parquet as pq

    table = pq.read_table(out / "trajectories.parquet").to_pylist()
    assert sorted(r["sample_index"] for r in table) == [0, 1, 2, 3, 3, 4, 5, 6, 7, 8]


def test_an_append_waits_for_another_writer_of_the_file_then_gives_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several processes append to one file; each append holds the file's lock, so the size
    it may cut back to is its own. A writer that keeps the lock (stopped mid-append) does not
    stall the tracer: past LOCK_WAIT_S the batch waits in the spool, and is written once the
    file is free."""
    import fcntl

    monkeypatch.setattr(jsonl_backend, "LOCK_WAIT_S", 0.3)
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"")
    with open(path, "ab") as other:  # another writer, mid-append
        fcntl.flock(other.fileno(), fcntl.LOCK_EX)
        tracer.init(config(tmp_path, path))
        trace(10)
        assert not tracer.flush(1.5)
        assert path.read_bytes() == b""  # not written under another writer's lock
        assert tracer.metrics()["tracer/jsonl/pending"] == 10
    assert tracer.flush(60)
    on_disk = trace_ids_on_disk(path)
    assert len(on_disk) == len(set(on_disk)) == 10
