"""The exporter interface every backend implements: small on purpose (as in the OTel SDK)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from tracer.config import TraceConfig
    from tracer.record import TrajectoryRecord


class ExportResult(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"  # retryable: the pipeline retries with backoff, then spools
    REJECTED = "rejected"  # never retryable (the backend refuses this data): counted as lost


@runtime_checkable
class Exporter(Protocol):
    """Receives batches of finished trajectories on its own background thread.

    ``export`` must be idempotent per ``trace_id`` (a batch may be retried or replayed) and
    must not raise for expected failures: return ``ExportResult.FAILURE`` instead. An
    unexpected exception is treated as FAILURE.
    """

    name: str

    def export(self, batch: Sequence[TrajectoryRecord]) -> ExportResult: ...

    def force_flush(self, timeout_s: float = 30.0) -> bool: ...

    def shutdown(self, timeout_s: float = 30.0) -> None: ...


class ExporterFactory(Protocol):
    def __call__(self, config: TraceConfig) -> Exporter: ...
