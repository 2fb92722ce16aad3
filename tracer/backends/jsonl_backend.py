"""JSONL backend: one JSON object per trajectory, appended to a local file.

Schema: ``TrajectoryRecord.to_dict()`` (see ``tracer.record``; ``schema_version`` in every
line). Lines are written whole and flushed per batch, so a crash leaves at most a partial last
line, which readers skip.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence

from tracer.backends.base import ExportResult
from tracer.config import TraceConfig
from tracer.record import TrajectoryRecord


def default_jsonl_path(config: TraceConfig) -> str:
    if config.jsonl_path:
        return config.jsonl_path
    return os.path.join("traces", config.project_name, f"{config.experiment_name}.jsonl")


class JsonlExporter:
    name = "jsonl"

    def __init__(self, config: TraceConfig) -> None:
        self.path = os.path.abspath(default_jsonl_path(config))
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._lock = threading.Lock()
        self._written: set[str] = set()

    def export(self, batch: Sequence[TrajectoryRecord]) -> ExportResult:
        lines = []
        for record in batch:
            if record.trace_id in self._written:
                continue
            lines.append(json.dumps(record.to_dict(), ensure_ascii=False, default=str))
        if lines:
            with self._lock, open(self.path, "a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self._written.update(r.trace_id for r in batch)
        return ExportResult.SUCCESS

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        return None
