"""Test helpers for users' own code: an in-memory backend and a pytest fixture.

Registered as a pytest plugin (entry point ``rollout_tracer``), so in any project with
rollout-tracer installed::

    def test_my_agent_loop(traces):
        with tracer.trace_attr(step=0, sample_index=0):
            run_my_loop()
        tracer.flush()
        [record] = traces.records
        assert [s.kind for s in record.spans] == ["trajectory", "generate", "tool"]
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from tracer.annotations import AnnotationRecord, apply_to_record
from tracer.backends.base import Exporter, ExportResult
from tracer.config import TraceConfig
from tracer.record import TrajectoryRecord

try:
    import pytest
except ImportError:  # pragma: no cover - pytest is optional for the library
    pytest = None  # type: ignore[assignment]


class InMemoryExporter(Exporter):
    """Keeps every exported record in a list; backend name ``memory``."""

    name = "memory"
    supports_annotations = True
    spoolable = False  # a new process has a new memory: nothing to replay into
    _instances: list[InMemoryExporter] = []

    def __init__(self, config: TraceConfig | None = None) -> None:
        self.records: list[TrajectoryRecord] = []
        self._lock = threading.Lock()
        InMemoryExporter._instances.append(self)

    def export(
        self, batch: Sequence[TrajectoryRecord], *, replay: bool = False
    ) -> ExportResult:
        with self._lock:
            seen = {r.trace_id for r in self.records}
            self.records.extend(r for r in batch if r.trace_id not in seen)
        return ExportResult.SUCCESS

    def annotate(self, batch: Sequence[AnnotationRecord]) -> list[bool]:
        """Add each annotation's span to its record, in whichever in-memory exporter of this
        process holds it (the annotating tracer has exporters of its own)."""
        found = []
        with self._lock:
            by_id = {r.trace_id: r for e in InMemoryExporter._instances for r in e.records}
            for ann in batch:
                record = by_id.get(ann.trace_id)
                if record is not None:
                    for key, value in apply_to_record(record, ann).items():
                        record.attributes[key] = value
                found.append(record is not None)
        return found

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        return None

    @classmethod
    def latest(cls) -> InMemoryExporter:
        return cls._instances[-1]

    def clear(self) -> None:
        with self._lock:
            self.records.clear()


if pytest is not None:

    @pytest.fixture
    def traces(request: Any) -> Iterator[InMemoryExporter]:
        """A tracer writing to memory (token2text on); yields the exporter with ``.records``."""
        import tracer

        marker = request.node.get_closest_marker("trace_config")
        overrides = dict(marker.kwargs) if marker is not None else {}
        tracer.init({"backend": "memory", "token2text": True, **overrides})
        try:
            yield InMemoryExporter.latest()
        finally:
            tracer.reset()

    def pytest_configure(config: Any) -> None:
        config.addinivalue_line("markers", "trace_config(**kw): TraceConfig overrides for `traces`")
