"""The JSONL file's disk is full: the log says so in one line, with the file and the free
space, and no traceback; nothing is lost (the batches wait in the spool, on another disk, and
are written once the disk has room). The full disk is a real 512 KB tmpfs filled to the last
byte (tests/_disks.py); where none can be mounted, the write raises ENOSPC instead."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import tracer
from tests._disks import full_disk
from tracer.backends import jsonl_backend


def _trace(first: int, n: int) -> None:
    for i in range(first, first + n):
        with tracer.trace_attr(step=0, sample_index=i):
            pass


def test_a_full_disk_under_the_jsonl_file_is_one_line_with_the_path_and_free_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    disk = tmp_path / "disk"
    path = disk / "traces.jsonl"
    with full_disk(disk, monkeypatch, jsonl_backend, "write_lines") as free:
        caplog.set_level(logging.INFO, logger="tracer")
        tracer.init(
            backend="jsonl",
            jsonl_path=str(path),
            spool_dir=str(tmp_path / "spool"),
            flush_interval_s=0.05,
            replay_interval_s=0.1,
            export_max_retries=0,
        )
        _trace(0, 5)
        assert not tracer.flush(2)
        lines = [r for r in caplog.records if r.name == "tracer" and r.levelno >= logging.WARNING]
        assert lines, caplog.text
        for record in lines:
            assert record.exc_info is None and "\n" not in record.getMessage(), caplog.text
        said = " ".join(r.getMessage() for r in lines)
        assert str(path) in said and "free" in said and "No space left" in said, said
        free()
        assert tracer.flush(30), caplog.text
        stored = [json.loads(x) for x in path.read_text().splitlines()]
        assert sorted(r["sample_index"] for r in stored) == list(range(5))
