"""A backend that ``writes_ahead`` (JSONL) is its own write-ahead log: each batch is appended
there once, on the thread that hands it over, and goes to the spool only when the append
fails; then it waits there (in order, before any later batch) and is written when the disk
takes it again, each trajectory once.

The fault is real where the machine allows it: the JSONL file's folder on a 512 KB tmpfs
filled to the last byte (else ENOSPC from the JSONL backend's write call).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tracer
import tracer.backends.jsonl_backend as jsonl_backend
from tests._disks import full_disk
from tracer.spool import BackendSpool


@tracer.trace_op(kind="generate")
def generate(prompt: str) -> dict[str, Any]:
    return {"text": f"answer to {prompt}", "response_ids": list(range(50))}


def trace(n: int, step: int) -> None:
    for i in range(n):
        with tracer.trace_attr(step=step, sample_index=i, rollout_n=0):
            generate(f"question {i}")


def jsonl_keys(path: Path) -> list[tuple[int, int]]:
    rows = [json.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    return [(r["step"], r["sample_index"]) for r in rows if "trace_id" in r]


@contextlib.contextmanager
def spool_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Records how many lines each spool write took (the real write still happens)."""
    seen: list[int] = []
    real = BackendSpool.write

    def counted(self: BackendSpool, lines: list[bytes]) -> Any:
        seen.append(len(lines))
        return real(self, lines)

    monkeypatch.setattr(BackendSpool, "write", counted)
    yield seen


def config(tmp_path: Path, jsonl: Path, **kw: Any) -> dict[str, Any]:
    return {"backend": "jsonl", "jsonl_path": str(jsonl), "spool_dir": str(tmp_path / "spool"),
            "flush_interval_s": 0.05, "export_batch_size": 10, "export_max_retries": 1,
            "replay_interval_s": 0.3, **kw}  # fmt: skip


def test_jsonl_batches_are_written_once_not_spooled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "out" / "t.jsonl"
    with spool_writes(monkeypatch) as spooled:
        tracer.init(config(tmp_path, path))
        trace(40, step=0)
        assert tracer.flush(60)
        m = tracer.metrics()
        tracer.reset()
    assert sorted(jsonl_keys(path)) == [(0, i) for i in range(40)]
    assert m["tracer/jsonl/exported"] == 40 and m["tracer/jsonl/spool_errors"] == 0
    assert spooled == []  # the appends are the log (the next test sees the spy count)


def test_jsonl_on_a_full_disk_waits_in_the_spool_then_writes_each_once_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    path = out / "t.jsonl"
    with (
        spool_writes(monkeypatch) as spooled,
        full_disk(out, monkeypatch, jsonl_backend, "write_lines") as free_space,
    ):
        tracer.init(config(tmp_path, path))
        trace(20, step=0)  # the append fails: each batch goes to the spool and waits
        assert not tracer.flush(1.5)
        m = tracer.metrics()
        assert m["tracer/jsonl/pending"] == 20 and m["tracer/jsonl/down"] == 1, m
        assert sum(spooled) == 20 and m["tracer/jsonl/dropped"] == 0
        assert sum(1 for _ in (tmp_path / "spool").glob("jsonl-*/*.jsonl")) == len(spooled)
        trace(20, step=1)  # behind waiting batches: queued (spooled), never written first
        time.sleep(0.5)
        assert tracer.metrics()["tracer/jsonl/pending"] == 40
        free_space()
        assert tracer.flush(60)
        trace(20, step=2)  # the backend is back: appended at once again
        assert tracer.flush(60)
        m = tracer.metrics()
        assert m["tracer/jsonl/exported"] == 60 and m["tracer/jsonl/pending"] == 0, m
        assert sum(spooled) == 40  # step 2 was not spooled
        assert not list((tmp_path / "spool").glob("jsonl-*/*.jsonl"))
        keys = jsonl_keys(path)  # before the tmpfs goes
    assert len(keys) == 60 and len(set(keys)) == 60  # each once
    assert [s for s, _ in keys] == sorted(s for s, _ in keys)  # steps in the order they ran
