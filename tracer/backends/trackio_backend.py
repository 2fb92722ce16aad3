"""Trackio backend: every op of a trajectory becomes one ``trackio.Trace``, as verl logs it.

Local-first, like trackio itself: the run writes to trackio's sqlite store under
``TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``; browse it with ``trackio show``),
or to a Space / server when trackio's own environment variables say so.

What is logged, in verl's shape (``verl/utils/rollout_trace.py``, trackio branch), for every
span except the root that ``trace_attr`` opened: key ``rollout_trace/<op name>`` at the
trajectory's step, a ``Trace`` whose messages are the op's input ``messages`` (or a system line
naming the op and the inputs as JSON) followed by an assistant message (the output's
``response_text``, else ``answer``, else the output or the exception as JSON), and whose
metadata holds ``op``, ``backend``, ``experiment_name``, ``inputs`` (without ``messages``),
``status``, ``output`` or ``exception_type``, the trajectory's ``step``, ``sample_index``,
``rollout_n``, ``validate``, plus ``kind``, ``attempt`` and ``trace_id`` (ours).

The run: the caller's current run when it is in ``project_name`` (``trackio.init`` called by
the user, as verl checks), else a run of its own, ``trackio.init(project=project_name,
name=experiment_name, config={"framework": "verl"})`` started in a copy of the caller's
context (a current run of another project is left running and current), finished at
shutdown. Within a process a trajectory is logged once (a retried batch is not logged twice);
trackio has no upsert, so a batch replayed by another process after a crash can appear twice.

``export`` returns SUCCESS only once trackio has stored the batch; otherwise FAILURE, so the
batch stays in the spool and is retried (a retry does not log again what trackio still holds).
trackio 0.43 has no public flush, so this reads what its own sender does (private members,
checked at start; trackio is pinned, 0.43.0):

- local store: ``Run._flush_queues_inline`` under ``Run._client_lock`` (what its sender thread
  and ``finish()`` call) writes the queue to its sqlite file. trackio swallows a failed write
  (one warning, the rows are dropped: a project lock held by another process for 10 s, a full
  disk), so the run's row count (``SQLiteStorage.get_log_count``) must then hold every row this
  exporter logged; rows it lacks are logged again at the retry. (In a run shared with the
  caller, the caller's own rows count too.)
- a Space or server: its sender thread posts the queue in the background and keeps what the
  server refused in a local buffer that it sends later. Stored means its queue, its batch in
  flight and that buffer are all empty; ``force_flush`` waits for that, at most its timeout.

Annotations (``tracer.annotate``) are logged as one more ``Trace`` at the trajectory's step,
key ``rollout_trace/annotation``, metadata ``op``/``kind`` ``annotation``, the trajectory's
``trace_id`` and identity, the annotation's ``span_id``, its encoded ``values`` and the
aggregates of the values it holds. trackio is append-only and cannot be searched by trace id
from here, so every annotation counts as applied; annotating again appends a row with the
same ``span_id`` (the latest wins).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from typing import Any

from tracer.annotations import AnnotationRecord, annotation_span
from tracer.backends.base import Exporter, ExportResult, RecentIds
from tracer.config import TraceConfig
from tracer.record import STYLE_KEY, SpanRecord, TrajectoryRecord

POLL_S = 0.05  # how often force_flush looks at a remote run's sender
# What force_flush reads of a trackio Run (trackio 0.43.0; see the module docstring).
_RUN_MEMBERS = ("_is_local", "_client_lock", "_queue_lock", "_flush_queues_inline",
                "_queued_logs", "_sending_batch", "_has_local_buffer", "id")  # fmt: skip


def trace_key(op_name: str) -> str:
    """The trackio log key of an op: ``rollout_trace/`` + the name with unsafe characters
    replaced by ``_`` (as verl names it)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in op_name)
    return "rollout_trace/" + safe


def _content(value: Any) -> str:
    return json.dumps(value, default=str, ensure_ascii=False)


def trace_payload(
    record: TrajectoryRecord, span: SpanRecord
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``(messages, metadata)`` of the Trace for one span, in verl's shape."""
    inputs = (
        span.inputs
        if isinstance(span.inputs, dict)
        else ({} if span.inputs is None else {"inputs": span.inputs})
    )
    metadata: dict[str, Any] = {
        "op": span.name,
        "backend": "trackio",
        "experiment_name": record.experiment_name,
        "inputs": {k: v for k, v in inputs.items() if k != "messages"},
        "kind": span.kind,
        "attempt": record.attempt,
        "trace_id": record.trace_id,
    }
    if record.attributes.get(STYLE_KEY) != "verl-op":  # verl: the rollout_trace_attr values
        for key in ("sample_index", "step", "rollout_n"):
            value = getattr(record, key)
            if value is not None:
                metadata[key] = value
        metadata["validate"] = record.validate
    output = span.outputs
    if span.status == "ERROR":
        error = span.error or {}
        metadata["status"] = "error"
        metadata["exception_type"] = error.get("type", "Exception")
    else:
        metadata["status"] = "success"
        metadata["output"] = output

    given = inputs.get("messages")
    messages = [
        dict(m)
        for m in (given if isinstance(given, list) else [])
        if isinstance(m, dict) and isinstance(m.get("role"), str)
    ]
    if not messages:
        messages = [
            {"role": "system", "content": f"verl rollout trace operation: {span.name}"},
            {"role": "user", "content": _content({"inputs": inputs})},
        ]
    if span.status == "ERROR":
        error = span.error or {}
        reply = _content({"exception_type": error.get("type"), "exception": error.get("message")})
    elif isinstance(output, dict) and output.get("response_text"):
        reply = str(output["response_text"])
    elif isinstance(output, dict) and output.get("answer"):
        reply = str(output["answer"])
    else:
        reply = _content({"output": output})
    messages.append({"role": "assistant", "content": reply})
    return messages, metadata


def _step(record: TrajectoryRecord) -> int | None:
    try:
        return None if record.step is None else int(record.step)
    except (TypeError, ValueError):
        return None


def trackio_version() -> str:
    import trackio

    return str(getattr(trackio, "__version__", "?"))


def _own_run(config: TraceConfig, resume: str = "never") -> Any:
    """A new run, started in a copy of the caller's context: the caller's current trackio run
    (another project's, say the training metrics') is neither finished by ``trackio.init``
    nor replaced as the current run."""
    import contextvars

    import trackio
    from trackio import context_vars

    def start() -> Any:
        context_vars.current_run.set(None)
        return trackio.init(
            project=config.project_name,
            name=config.experiment_name,
            config={"framework": "verl"},
            resume=resume,
        )

    return contextvars.copy_context().run(start)


class TrackioExporter(Exporter):
    name = "trackio"

    def __init__(self, config: TraceConfig) -> None:
        import trackio  # ImportError -> "pip install rollout-tracer[trackio]"
        from trackio import context_vars

        self.config = config
        self._trace = trackio.Trace
        current: Any = context_vars.current_run.get()
        self._owns_run = current is None or current.project != config.project_name
        # the annotator's exporter (annotations only) resumes the traces' run on first use
        # instead of starting a second run of the same name (see annotate)
        self._run: Any = None
        run_name = config.experiment_name if self._owns_run else current.name
        self.destination = f"trackio:{config.project_name}/{run_name}"  # names the spool
        self._lock = threading.Lock()
        # trace ids trackio has stored, and those logged but not known to be stored yet (with
        # the number of rows each added)
        self._logged: RecentIds[None] = RecentIds()
        self._unconfirmed: dict[str, int] = {}
        self._rows_before = 0  # the run's rows before our first batch (a local store)
        self._rows_confirmed = 0
        if not self._owns_run:
            self._adopt(current)

    def _adopt(self, run: Any) -> None:
        """Use ``run`` from now on, once it has every member ``force_flush`` reads."""
        missing = [m for m in _RUN_MEMBERS if not hasattr(run, m)]
        if missing:
            if self._owns_run:
                run.finish()
            raise RuntimeError(
                f"the trackio backend cannot tell when trackio {trackio_version()} has "
                f"stored a batch (its Run lacks {', '.join(missing)}); it was tested with "
                "trackio 0.43.0: pip install trackio==0.43.0"
            )
        self._run = run
        self._rows_before = self._stored_rows() if run._is_local else 0

    @property
    def run(self) -> Any:
        """The run traces go to, started on first use (``export``)."""
        if self._run is None:
            self._adopt(_own_run(self.config))
        return self._run

    def export(
        self, batch: Sequence[TrajectoryRecord], *, replay: bool = False
    ) -> ExportResult:
        with self._lock:
            todo = [r for r in batch if r.trace_id not in self._logged
                    and r.trace_id not in self._unconfirmed]  # fmt: skip
        for record in todo:
            own_root = record.attributes.get(STYLE_KEY) == "verl-op"
            step = _step(record)
            spans = record.spans if own_root else record.spans[1:]
            for span in spans:
                messages, metadata = trace_payload(record, span)
                self.run.log(
                    {trace_key(span.name): self._trace(messages=messages, metadata=metadata)},
                    step=step,
                )
            with self._lock:
                self._unconfirmed[record.trace_id] = len(spans)
        # stored when export returns, like every other backend; else pending (spooled, retried)
        stored = self.force_flush(self.config.export_timeout_s)
        return ExportResult.SUCCESS if stored else ExportResult.FAILURE

    supports_annotations = True

    def annotate(self, batch: Sequence[AnnotationRecord]) -> list[bool]:
        if self._run is None:  # the traces' run, written by this process's export exporter
            self._adopt(_own_run(self.config, resume="allow"))
        for ann in batch:
            span, _tags = annotation_span(ann, ann.root_span_id, ann.created_ns, None)
            metadata = {
                "op": "annotation", "backend": "trackio", "kind": "annotation",
                "experiment_name": self.config.experiment_name, "trace_id": ann.trace_id,
                "span_id": span.span_id, "step": ann.step, "sample_index": ann.sample_index,
                "rollout_n": ann.rollout_n, "validate": ann.validate,
                "values": dict(ann.values), "summary": span.outputs,
            }  # fmt: skip
            messages = [
                {"role": "system", "content": "rollout-tracer annotation (tracer.annotate)"},
                {"role": "assistant", "content": _content(span.outputs)},
            ]
            step = None if ann.step is None else int(ann.step)
            trace = self._trace(messages=messages, metadata=metadata)
            self.run.log({trace_key("annotation"): trace}, step=step)
        self.force_flush()
        return [True] * len(batch)

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """True once trackio has stored everything logged so far (see the module docstring);
        False when it has not within ``timeout_s`` (a remote run) or lost rows (local)."""
        if self._run is None:
            return True  # no run started: nothing was logged
        with self._lock:
            pending = dict(self._unconfirmed)
        run = self._run
        if run._is_local:
            with run._client_lock:
                run._flush_queues_inline()
            expected = self._rows_confirmed + sum(pending.values())
            if self._stored_rows() - self._rows_before < expected:
                with self._lock:  # trackio dropped rows: log these trajectories again
                    for trace_id in pending:
                        self._unconfirmed.pop(trace_id, None)
                return False
            self._rows_confirmed = expected
        elif not self._wait_sent(timeout_s):
            return False
        with self._lock:
            for trace_id in pending:
                self._unconfirmed.pop(trace_id, None)
                self._logged.add(trace_id, None)
        return True

    def _wait_sent(self, timeout_s: float) -> bool:
        """Wait until a remote run's sender has nothing left: queue, batch in flight, and the
        local buffer of what the server refused."""
        run = self.run
        deadline = time.monotonic() + timeout_s
        while True:
            with run._queue_lock:
                if not run._queued_logs and run._sending_batch is None and not (
                    run._has_local_buffer
                ):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)

    def _stored_rows(self) -> int:
        from trackio.sqlite_storage import SQLiteStorage

        return int(SQLiteStorage.get_log_count(self.run.project, run_id=self.run.id))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        if self._run is None:
            return
        if self._owns_run:
            self.run.finish()
        else:
            self.force_flush(timeout_s)
