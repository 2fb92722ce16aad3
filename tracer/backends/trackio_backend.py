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
name=experiment_name, config={"framework": "verl"})`` (verl's call) started in a copy of the
caller's context (a current run of another project is left running and current), shared by
this process's exporters of that project and experiment (traces and annotations), finished
with ``trackio.finish()`` when the last of them shuts down. Rows are logged with
``trackio.log(..., step=)`` run in that context. Within a process a trajectory is logged once
(a retried batch is not logged twice); trackio has no upsert, so a batch replayed by another
process after a crash can appear twice.

Only trackio's public API is used: ``init``, ``log``, ``finish``, ``Trace`` and
``context_vars.current_run`` (what verl reads too). trackio 0.43 has no public flush and no
public way to read back what it stored, so a batch counts as exported once ``trackio.log`` has
taken it: from there on it is trackio's. trackio writes its queue in the background (to its
local store about every 0.5 s), and ``finish()`` at shutdown waits for that queue; to a Space
or server, what ``finish()`` could not send trackio keeps in a local store of its own and
sends at the next ``trackio.init`` of the project (its warning says so). A write trackio
drops (it warns) is not seen here; neither is a crash before trackio's sender ran.
``force_flush`` has nothing public to wait on and returns True.

Annotations (``tracer.annotate``) are logged as one more ``Trace`` at the trajectory's step,
key ``rollout_trace/annotation``, metadata ``op``/``kind`` ``annotation``, the trajectory's
``trace_id`` and identity, the annotation's ``span_id``, its encoded ``values`` and the
aggregates of the values it holds. trackio is append-only and cannot be searched by trace id
from here, so every annotation counts as applied; annotating again appends a row with the
same ``span_id`` (the latest wins).
"""

from __future__ import annotations

import contextvars
import json
import threading
from collections.abc import Sequence
from typing import Any

from tracer.annotations import AnnotationRecord, annotation_span
from tracer.backends.base import Exporter, ExportResult, RecentIds
from tracer.config import TraceConfig
from tracer.record import STYLE_KEY, SpanRecord, TrajectoryRecord


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


def _run_in_context(
    trackio: Any, context_vars: Any, config: TraceConfig, resume: str
) -> tuple[Any, Any]:
    """A new run of ``config``'s project and experiment, and the context it is current in: a
    copy of the caller's, so the caller's current trackio run (another project's, say the
    training metrics') is neither finished by ``trackio.init`` nor replaced as the current
    run. ``resume`` is passed only when it is not trackio's default (verl's exact call)."""
    context = contextvars.copy_context()

    def start() -> Any:
        context_vars.current_run.set(None)
        options = {} if resume == "never" else {"resume": resume}
        return trackio.init(project=config.project_name, name=config.experiment_name,
                            config={"framework": "verl"}, **options)  # fmt: skip

    return context.run(start), context


class _SharedRun:
    """A run this process started, the context it is current in, and how many exporters use
    it (the traces' and the annotator's): the last one to shut down finishes it."""

    def __init__(self, run: Any, context: Any) -> None:
        self.run = run
        self.context = context
        self.users = 0


# Runs this process started, by (trackio module, project, experiment). The annotator's exporter
# must log into the traces' run, and trackio finds a run by name (resume) only once its sender
# has written the run to the store, which nothing public waits for.
_live_runs: dict[tuple[Any, str, str], _SharedRun] = {}
_live_lock = threading.Lock()


class TrackioExporter(Exporter):
    name = "trackio"
    supports_annotations = True

    def __init__(self, config: TraceConfig) -> None:
        import trackio  # ImportError -> "pip install rollout-tracer[trackio]"
        from trackio import context_vars  # as verl reads it

        self.config = config
        # kept, not imported again: shutdown reaches the trackio this exporter logged to
        self._trackio = trackio
        self._context_vars = context_vars
        current: Any = context_vars.current_run.get()
        self._owns_run = current is None or current.project != config.project_name
        # a run of our own starts on first use, shared with the other exporter of this process
        # (traces, annotations) that logs to the same project and experiment
        self._run: Any = None if self._owns_run else current
        self._shared: _SharedRun | None = None
        # where trackio.log finds the run: the caller's context for the caller's run; each
        # exporter enters its own copy (a context is entered by one thread at a time)
        self._context: Any = None if self._owns_run else contextvars.copy_context()
        run_name = config.experiment_name if self._owns_run else current.name
        self.destination = f"trackio:{config.project_name}/{run_name}"  # names the spool
        self._lock = threading.Lock()  # the context is entered by one thread at a time
        self._logged: RecentIds[None] = RecentIds()  # trace ids handed to trackio

    def _start(self, resume: str) -> None:
        if self._run is not None:
            return
        key = (self._trackio, self.config.project_name, self.config.experiment_name)
        with _live_lock:
            shared = _live_runs.get(key)
            if shared is None:
                run, context = _run_in_context(self._trackio, self._context_vars,
                                               self.config, resume)  # fmt: skip
                shared = _live_runs[key] = _SharedRun(run, context)
            shared.users += 1
        self._shared, self._run, self._context = shared, shared.run, shared.context.copy()

    def _log(self, key: str, trace: Any, step: int | None) -> None:
        with self._lock:
            self._context.run(self._trackio.log, {key: trace}, step=step)

    def export(
        self, batch: Sequence[TrajectoryRecord], *, replay: bool = False
    ) -> ExportResult:
        self._start("never")
        for record in batch:
            if record.trace_id in self._logged:
                continue
            own_root = record.attributes.get(STYLE_KEY) == "verl-op"
            step = _step(record)
            for span in record.spans if own_root else record.spans[1:]:
                messages, metadata = trace_payload(record, span)
                trace = self._trackio.Trace(messages=messages, metadata=metadata)
                self._log(trace_key(span.name), trace, step)
            self._logged.add(record.trace_id, None)
        return ExportResult.SUCCESS

    def annotate(self, batch: Sequence[AnnotationRecord]) -> list[bool]:
        self._start("allow")  # the traces' run: this process's, else one stored by name
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
            trace = self._trackio.Trace(messages=messages, metadata=metadata)
            self._log(trace_key("annotation"), trace, step)
        return [True] * len(batch)

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """True: trackio 0.43 has no public flush (see the module docstring); what was logged
        is trackio's, and ``shutdown`` waits for it with ``trackio.finish()``."""
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Finish the run this process started, when no other exporter uses it (trackio
        writes what it still holds); the caller's own run is the caller's to finish."""
        shared, self._shared = self._shared, None
        if shared is None:
            return
        key = (self._trackio, self.config.project_name, self.config.experiment_name)
        with _live_lock:
            shared.users -= 1
            if shared.users > 0:
                return
            if _live_runs.get(key) is shared:
                del _live_runs[key]
        with self._lock:
            self._context.run(self._trackio.finish)
