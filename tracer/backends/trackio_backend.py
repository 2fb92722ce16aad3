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
``rollout_n``, ``validate``, plus ``kind`` and ``trace_id`` (ours).

The run: the caller's current run when it is in ``project_name`` (``trackio.init`` called by
the user, as verl checks), else a run of its own, ``trackio.init(project=project_name,
name=experiment_name, config={"framework": "verl"})`` started in a copy of the caller's
context (a current run of another project is left running and current), finished at
shutdown. Within a process a trajectory is logged once (a retried batch is not logged twice);
trackio has no upsert, so a batch replayed by another process after a crash can appear twice.

Annotations (``tracer.annotate``) are logged as one more ``Trace`` at the trajectory's step,
key ``rollout_trace/annotation``, metadata ``op``/``kind`` ``annotation``, the trajectory's
``trace_id`` and identity, the annotation's ``span_id``, its encoded ``values`` and the
aggregates of the values it holds. trackio is append-only and cannot be searched by trace id
from here, so every annotation counts as applied; annotating again appends a row with the
same ``span_id`` (the latest wins).

A batch is in trackio's store when ``export`` returns: it writes the run's queue with
``Run._flush_queues_inline`` (private; trackio is pinned, 0.43.0) instead of waiting for
trackio's own sender thread.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Sequence
from typing import Any

from tracer.annotations import AnnotationRecord, annotation_span
from tracer.backends.base import Exporter, ExportResult
from tracer.config import TraceConfig
from tracer.record import STYLE_KEY, SpanRecord, TrajectoryRecord

MAX_REMEMBERED = 100_000  # trace ids remembered to skip re-logging a retried batch


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
        self._run: Any = None if self._owns_run else current
        run_name = config.experiment_name if self._owns_run else current.name
        self.destination = f"trackio:{config.project_name}/{run_name}"  # names the spool
        self._lock = threading.Lock()
        self._logged: collections.OrderedDict[str, None] = collections.OrderedDict()

    @property
    def run(self) -> Any:
        """The run traces go to, started on first use (``export``)."""
        if self._run is None:
            self._run = _own_run(self.config)
        return self._run

    def export(
        self, batch: Sequence[TrajectoryRecord], *, replay: bool = False
    ) -> ExportResult:
        with self._lock:
            todo = [r for r in batch if r.trace_id not in self._logged]
        for record in todo:
            own_root = record.attributes.get(STYLE_KEY) == "verl-op"
            step = _step(record)
            for span in record.spans if own_root else record.spans[1:]:
                messages, metadata = trace_payload(record, span)
                self.run.log(
                    {trace_key(span.name): self._trace(messages=messages, metadata=metadata)},
                    step=step,
                )
            with self._lock:
                self._logged[record.trace_id] = None
                while len(self._logged) > MAX_REMEMBERED:
                    self._logged.popitem(last=False)
        self.force_flush()  # written when export returns, like every other backend
        return ExportResult.SUCCESS

    supports_annotations = True

    def annotate(self, batch: Sequence[AnnotationRecord]) -> list[bool]:
        if self._run is None:  # the traces' run, written by this process's export exporter
            self._run = _own_run(self.config, resume="allow")
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
        flush = getattr(self.run, "_flush_queues_inline", None)
        lock = getattr(self.run, "_client_lock", None)
        if flush is None or lock is None or not getattr(self.run, "_is_local", False):
            return True  # a remote run sends in its own background thread
        with lock:
            flush()
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        if self._run is None:
            return
        if self._owns_run:
            self.run.finish()
        else:
            self.force_flush(timeout_s)
