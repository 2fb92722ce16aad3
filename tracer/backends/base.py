"""The exporter interface every backend implements: small on purpose (as in the OTel SDK).

Everything the pipeline asks of a backend is declared here once, with its default:

- ``name``: the backend's name (metrics ``tracer/<name>/...``, spool folder ``<name>-<hash>``);
- ``destination``: where it writes, without credentials (``""`` = ``name``); it names the
  spool folder, so two destinations of one backend never share batches;
- ``spoolable``: whether its batches may wait in the spool and be replayed by another process
  (False for an in-memory backend);
- ``heavy_export``: whether its export is much Python per trace (MLflow): with the default
  ``export_in_subprocess=None`` a built-in backend that says so exports from a child process;
- ``writes_ahead``: whether a successful ``export_encoded`` leaves the lines in a local file
  that outlives the process as the spool would (JSONL): the pipeline then writes there first,
  on the thread that hands the batch over, and spools only a batch it refuses;
- ``lines_suffice``: whether ``export_encoded`` needs only the lines (the export child's
  proxy): its batches then wait as lines, and the records it is given are read from them if
  it asks (``tracer.batch.LineRecords``);
- ``deduplicates``: whether a batch sent again adds nothing (True: MLflow, JSONL's readers);
  False for a sink that appends whatever arrives (an OTLP collector): a batch that was in an
  export call at shutdown's deadline may then arrive twice, and the pipeline says so;
- ``export(batch, *, replay=False)``: store a batch, idempotently per ``trace_id``. ``replay``
  is True when the batch may already be stored in part (a retry after a failure, a replay of
  the spool): the backend then checks before adding what it cannot upsert. Expected failures
  return ``FAILURE`` (retried, then spooled) or ``REJECTED`` (never retried; counted as lost);
  an unexpected exception counts as ``FAILURE``;
- ``export_encoded(batch, lines, *, replay=False)``: the same, with each record's JSON line
  as the spool holds it (``tracer.encode``, redacted); a byte-oriented backend writes these
  instead of encoding again. By default it calls ``export``;
- ``force_flush(timeout_s)`` and ``shutdown(timeout_s)``;
- ``abort()``: shutdown's deadline passed while an export call is still running; called from
  another thread, it ends that call if it can (the export process: killed) and says so. The
  call's batch stays in the spool. By default it cannot (False);
- ``annotate(batch)`` (optional, ``supports_annotations``): attach values computed after the
  rollout (``tracer.annotations.AnnotationRecord``) to traces already stored,
  idempotently; returns, per annotation, whether its trace was found (False: skipped).

The pipeline calls one exporter from one thread at a time, never concurrently.
``register_backend`` also accepts any object with ``export(batch)``: ``as_exporter`` adapts
it to this interface (the only place where such an object's attributes are probed).
"""

from __future__ import annotations

import collections
import enum
import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from tracer.annotations import AnnotationRecord
    from tracer.record import TrajectoryRecord


V = TypeVar("V")

# how many trace ids a backend remembers to skip a batch sent again: retries and replays concern
# recent batches, and a run that exports millions must not grow its host's memory with each one
MAX_REMEMBERED = 100_000


class RecentIds(Generic[V]):
    """The last ``limit`` trace ids a backend stored, each with a value (None, or what tells
    two trajectories with one id apart); the oldest is forgotten first."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = MAX_REMEMBERED if limit is None else limit
        self._ids: collections.OrderedDict[str, V] = collections.OrderedDict()

    def __contains__(self, trace_id: object) -> bool:
        return trace_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, trace_id: str) -> V | None:
        return self._ids.get(trace_id)

    def add(self, trace_id: str, value: V) -> None:
        self._ids[trace_id] = value
        self._ids.move_to_end(trace_id)
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)


class ExportResult(enum.Enum):
    SUCCESS = "success"
    FAILURE = "failure"  # retryable: the pipeline retries with backoff, then spools
    REJECTED = "rejected"  # never retryable (the backend refuses this data): counted as lost


class Exporter:
    """Base class of every backend; see the module docstring for each member's contract."""

    name: str = "exporter"
    destination: str = ""
    spoolable: bool = True
    heavy_export: bool = False
    writes_ahead: bool = False
    lines_suffice: bool = False
    deduplicates: bool = True
    supports_annotations: bool = False

    def export(
        self, batch: Sequence[TrajectoryRecord], *, replay: bool = False
    ) -> ExportResult:
        raise NotImplementedError

    def export_encoded(
        self, batch: Sequence[TrajectoryRecord], lines: Sequence[bytes], *, replay: bool = False
    ) -> ExportResult:
        return self.export(batch, replay=replay)

    def annotate(self, batch: Sequence[AnnotationRecord]) -> list[bool]:
        raise NotImplementedError(f"backend {self.name!r} cannot annotate stored traces")

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        return None

    def abort(self) -> bool:
        return False

    @property
    def spool_key(self) -> str:
        """What names this backend's spool folder: its destination, else its name."""
        return self.destination or self.name


class BackendStartError(RuntimeError):
    """An export child started but could not make its backend; the text is its error, which
    names the error's type (tracer/backends/subprocess_proxy.py)."""


def as_exporter(obj: Any) -> Exporter:
    """``obj`` itself when it is an ``Exporter``, else an adapter with the defaults above."""
    return obj if isinstance(obj, Exporter) else _Adapted(obj)


class _Adapted(Exporter):
    """A duck-typed exporter (``register_backend`` takes any object with ``export(batch)``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = str(getattr(inner, "name", type(inner).__name__))
        self.destination = str(getattr(inner, "destination", "") or "")
        self.spoolable = bool(getattr(inner, "spoolable", True))
        self.deduplicates = bool(getattr(inner, "deduplicates", True))
        try:
            params = inspect.signature(inner.export).parameters
            self._takes_replay = "replay" in params
        except (TypeError, ValueError):
            self._takes_replay = False

    def export(
        self, batch: Sequence[TrajectoryRecord], *, replay: bool = False
    ) -> ExportResult:
        if self._takes_replay:
            return self.inner.export(batch, replay=replay)  # type: ignore[no-any-return]
        return self.inner.export(batch)  # type: ignore[no-any-return]

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        fn = getattr(self.inner, "force_flush", None)
        return bool(fn(timeout_s)) if fn is not None else True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        fn = getattr(self.inner, "shutdown", None)
        if fn is not None:
            fn(timeout_s)
