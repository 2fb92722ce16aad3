"""Trajectories that arrive while a batch is being processed wait for the next wake (a whole
batch, ``flush_interval_s`` or a flush) instead of going out at once as a batch of a few: each
batch costs a spool file, an export call and a store transaction whatever its size."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import tracer
from tracer.backends import register_backend
from tracer.backends.base import Exporter, ExportResult


class _Sizes(Exporter):
    """Keeps the size of each batch it is handed."""

    name = "batch_sizes"
    sizes: list[int] = []
    lock = threading.Lock()

    def __init__(self, config: Any = None) -> None:
        pass

    def export(self, batch: Sequence[Any], *, replay: bool = False) -> ExportResult:
        with self.lock:
            _Sizes.sizes.append(len(batch))
        return ExportResult.SUCCESS


def test_a_busy_process_makes_few_full_batches_not_many_small_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tracer.pipeline import Pipeline

    process = Pipeline._process_guarded

    def busy(self: Any, batch: Any, token: Any) -> Any:
        time.sleep(0.05)  # a busy rollout process: each batch's processing takes a while
        return process(self, batch, token)

    monkeypatch.setattr(Pipeline, "_process_guarded", busy)
    register_backend("batch_sizes", _Sizes)
    _Sizes.sizes = []
    tracer.init(backend="batch_sizes", spool_dir=str(tmp_path / "spool"), flush_interval_s=0.5,
                export_batch_size=64)  # fmt: skip
    try:
        t0 = time.monotonic()
        for i in range(300):  # ~150 a second for 2 s
            with tracer.trace_attr(step=0, sample_index=i, rollout_n=0):
                pass
            time.sleep(max(0.0, t0 + (i + 1) / 150 - time.monotonic()))
        assert tracer.flush(30)
    finally:
        tracer.reset()
    sizes = _Sizes.sizes
    assert sum(sizes) == 300
    # a batch per wake (every 0.5 s, or 64 waiting) and the flush's: about 8-10, not dozens
    assert len(sizes) <= 14, sizes
    assert sum(1 for n in sizes if n < 16) <= 3, sizes
