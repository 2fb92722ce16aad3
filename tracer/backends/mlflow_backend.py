"""MLflow backend: one MLflow trace per trajectory, written in batches off the hot path.

On a sqlite or PostgreSQL store whose schema it was tested with, a batch (traces, spans,
tags, rewards) is written in one transaction by :mod:`tracer.backends.mlflow_bulk`. Otherwise
spans are built as finished OpenTelemetry spans and written with MLflow's TracingClient
``log_spans`` (one DB transaction per batch for a SQL store; OTLP/HTTP for a tracking
server). This bypasses MLflow's own async trace queue, which drops traces when it fills.
Trace tags come from ``mlflow.traceTag.<key>`` attributes on the root span (read by MLflow's
store), the reward is an MLflow feedback assessment named ``reward``.

Both paths store the same thing for a trace id sent again (a replayed or retried batch, or two
trajectories given one id): the first one stored wins. A trace already in the store gets no
spans, tags or duration from a later record with its id, only its reward if it has none yet (a
batch that failed between its spans and its rewards); within a batch the first record of an id
is the one written.

Uses ``TracingClient`` and ``Span(ReadableSpan)``, semi-internal MLflow APIs: pyproject.toml
bounds the version (3.14 up to 4) and CI exercises them at both ends of that range.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tracer.annotations import AnnotationRecord, annotation_span, rollout_logprobs
from tracer.backends.base import Exporter, ExportResult
from tracer.backends.mlflow_bulk import open_bulk_writer
from tracer.backends.mlflow_store_init import store_init_lock
from tracer.backends.mlflow_view import first_of_each_id, mlflow_view
from tracer.backends.otel_spans import dumps, encode_all_json, to_readable_spans
from tracer.config import TraceConfig
from tracer.credentials import store_address
from tracer.ids import attempt_trace_id
from tracer.record import SpanRecord, TrajectoryRecord
from tracer.tokens import LOGPROBS_ATTR

log = logging.getLogger("tracer")

REWARD_ASSESSMENT = "reward"
REWARD_REQUESTS_IN_FLIGHT = 8  # reward assessments sent side by side to a tracking server
_ATTEMPTS_PROBED = 4  # attempts looked up at once for an annotation that names none


def resolve_tracking_uri(config: TraceConfig) -> str:
    """config.tracking_uri, else MLFLOW_TRACKING_URI, else MLflow's default ./mlflow.db."""
    if config.tracking_uri:
        return config.tracking_uri
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{os.path.abspath('mlflow.db')}"


class MlflowExporter(Exporter):
    name = "mlflow"
    supports_annotations = True
    # ~2 ms of MLflow's Python per 8-span trace: exported from a child process by default
    heavy_export = True

    def __init__(self, config: TraceConfig) -> None:
        import mlflow  # noqa: F401  (ImportError -> "pip install rollout-tracer[mlflow]")
        from mlflow.tracing.client import TracingClient
        from mlflow.tracking import MlflowClient

        self.config = config
        self.tracking_uri = resolve_tracking_uri(config)
        # Opening an empty store runs MLflow's schema migrations: processes doing that at once
        # fail (sqlite and PostgreSQL alike). One at a time per database.
        with store_init_lock(self.tracking_uri):
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            self.experiment_id = self._experiment_id(config.project_name)
            self.tracing = TracingClient(self.tracking_uri)
        self.is_server = self.tracking_uri.startswith(("http://", "https://"))
        # sqlite/PostgreSQL stores: one transaction per batch (None: MLflow's own path).
        self.bulk = None if self.is_server else open_bulk_writer(
            self.tracing.store, self.tracking_uri, self.experiment_id,
            trace_id_of=mlflow_trace_id, reward_name=REWARD_ASSESSMENT)
        self._pool: ThreadPoolExecutor | None = None  # reward requests to a tracking server
        self._warned_locked = False
        self.destination = f"{self.tracking_uri}#{self.experiment_id}"  # names the spool

    def _experiment_id(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return str(exp.experiment_id)
        try:
            return str(self.client.create_experiment(name))
        except Exception:  # created concurrently by another worker
            exp = self.client.get_experiment_by_name(name)
            if exp is None:
                raise
            return str(exp.experiment_id)

    def export(
        self, batch: Sequence[TrajectoryRecord], *, replay: bool = False
    ) -> ExportResult:
        # what the UI shows: compact token lists, the GRPO group as the session; the same
        # for the bulk writer and MLflow's own log_spans path
        batch = [mlflow_view(record) for record in first_of_each_id(batch)]
        stored: dict[str, bool] = {}  # MLflow's path: traces already there -> has a reward
        spans: list[Any] = []
        if self.bulk is None:
            stored = self._stored([mlflow_trace_id(r.trace_id) for r in batch])
            new = [r for r in batch if mlflow_trace_id(r.trace_id) not in stored]
            spans = [s for record in new for s in to_mlflow_spans(record)]
        if self.is_server:
            if spans:
                self._post_spans(spans)
        else:
            try:
                if self.bulk is not None:
                    self.bulk.write(batch, replay=replay)
                elif spans:
                    self.tracing.log_spans(self.experiment_id, spans)
            except Exception as exc:
                if "locked" in str(exc).lower() and not self._warned_locked:
                    self._warned_locked = True
                    log.warning(
                        "rollout-tracer: the sqlite store %s is locked by another process; "
                        "batches are retried and spooled, so nothing is lost, but several "
                        "writers on one sqlite file are slow. For several processes or "
                        "nodes run a tracking server (mlflow server --backend-store-uri %s "
                        "--workers 1) and set tracking_uri=http://HOST:5000.",
                        *[store_address(self.tracking_uri)] * 2)
                raise
        if self.bulk is None:
            self._log_rewards(batch, stored)
        if self.config.mlflow_run_id:
            self._link_to_run([mlflow_trace_id(r.trace_id) for r in batch])
        return ExportResult.SUCCESS

    def annotate(self, batch: Sequence[AnnotationRecord]) -> list[bool]:
        """Each annotation as one more span of its stored trace (upserted by its derived span
        id), plus trace tags for its numbers; one that names no attempt goes to the latest
        attempt stored. A trace not in the store yet is not found (False): the annotator
        tries again later. One lookup for the whole batch, then one read per trace found."""
        probe = range(_ATTEMPTS_PROBED)
        candidates = [
            [ann.trace_id] if ann.attempt is not None
            else [attempt_trace_id(ann.trace_id, k) for k in probe]
            for ann in batch
        ]  # fmt: skip
        stored = self._stored([mlflow_trace_id(t) for ids in candidates for t in ids])
        found: list[bool] = []
        for ann, ids in zip(batch, candidates, strict=True):
            if ann.attempt is None:
                latest = self._latest_attempt(ann.trace_id, stored)
                if latest is None:
                    found.append(False)
                    continue
                ann = dataclasses.replace(
                    ann, trace_id=attempt_trace_id(ann.trace_id, latest), attempt=latest
                )
            elif mlflow_trace_id(ids[0]) not in stored:
                found.append(False)
                continue
            found.append(self._annotate_one(ann))
        return found

    def _latest_attempt(self, first: str, stored: dict[str, bool]) -> int | None:
        """The highest attempt stored of the trajectory whose attempt 0 is ``first``:
        ``stored`` holds the first ``_ATTEMPTS_PROBED``; more are looked up while all are."""
        latest, start = None, 0
        while True:
            ids = [mlflow_trace_id(attempt_trace_id(first, k))
                   for k in range(start, start + _ATTEMPTS_PROBED)]  # fmt: skip
            there = stored if start == 0 else self._stored(ids)
            held = [start + i for i, t in enumerate(ids) if t in there]
            if held:
                latest = held[-1]
            if not held or held[-1] < start + _ATTEMPTS_PROBED - 1:
                return latest
            start += _ATTEMPTS_PROBED

    def _annotate_one(self, ann: AnnotationRecord) -> bool:
        trace_id = mlflow_trace_id(ann.trace_id)
        trace = self.client.get_trace(trace_id)
        root, generates = _root_and_generates(trace) if trace is not None else (None, [])
        if root is None:
            return False
        span, tags = annotation_span(ann, root.span_id, root.start_ns,
                                     rollout_logprobs(generates))  # fmt: skip
        holder = TrajectoryRecord(
            trace_id=ann.trace_id, name="annotation", project_name="", experiment_name="",
            step=None, sample_index=None, rollout_n=None, validate=False, worker_id="",
            start_ns=root.start_ns, end_ns=root.end_ns, spans=[root, span],
        )  # fmt: skip
        self._log_annotation_span(holder)
        for key, value in tags.items():
            self.client.set_trace_tag(trace_id, key, value)
        return True

    def _log_annotation_span(self, holder: TrajectoryRecord) -> None:
        from mlflow.entities import Span

        request_id = dumps(mlflow_trace_id(holder.trace_id))
        otel = to_readable_spans(holder, encode=encode_all_json,
                                 extra_attributes={"mlflow.traceRequestId": request_id})
        spans = [Span(s) for s in otel[1:]]  # the annotation only; the root stays as stored
        if self.is_server:
            self._post_spans(spans)
        else:
            self.tracing.log_spans(self.experiment_id, spans)

    def _link_to_run(self, trace_ids: list[str]) -> None:
        """Link traces to ``config.mlflow_run_id`` (MLflow's trace-run entity associations,
        which ``search_traces(run_id=...)`` matches); idempotent, 100 ids per request."""
        run_id = self.config.mlflow_run_id
        for i in range(0, len(trace_ids), 100):
            chunk = trace_ids[i : i + 100]
            if self.is_server:
                body = {"trace_ids": chunk, "run_id": run_id}
                self._rest("POST", "/api/2.0/mlflow/traces/link-to-run", body)
            else:
                self.client.link_traces_to_run(chunk, str(run_id))

    def _post_spans(self, spans: list[Any]) -> None:
        """What ``RestStore.log_spans`` does (OTLP/HTTP to the server), but with our timeout
        and no retries of its own: MLflow's HTTP retries back off for minutes while the server
        is down, which would stall this worker instead of letting the spool take the batch."""
        from mlflow.tracing.utils.otlp import MLFLOW_EXPERIMENT_ID_HEADER, OTLP_TRACES_PATH
        from mlflow.utils.rest_utils import http_request, verify_rest_response
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        request = ExportTraceServiceRequest()
        scope = request.resource_spans.add().scope_spans.add()
        scope.spans.extend(span.to_otel_proto() for span in spans)
        response = http_request(
            host_creds=self.tracing.store.get_host_creds(),
            endpoint=OTLP_TRACES_PATH,
            method="POST",
            data=request.SerializeToString(),
            extra_headers={
                "Content-Type": "application/x-protobuf",
                MLFLOW_EXPERIMENT_ID_HEADER: self.experiment_id,
            },
            max_retries=0,
            timeout=self.config.export_timeout_s,
        )
        verify_rest_response(response, OTLP_TRACES_PATH)

    def _stored(self, trace_ids: list[str]) -> dict[str, bool]:
        """Which of these traces the store holds already, and whether each has a reward: one
        request (or query) per batch, so that a trace id sent again never merges its spans
        into the stored trace nor adds a second reward."""
        infos: list[Any] = []
        for i in range(0, len(trace_ids), 100):
            chunk = trace_ids[i : i + 100]
            if self.is_server:
                body = self._rest("POST", "/api/3.0/mlflow/traces/batchGetInfos",
                                  {"trace_ids": chunk})  # fmt: skip
                infos.extend(body.get("trace_infos") or [])
            else:
                infos.extend(self.tracing.store.batch_get_trace_infos(chunk))
        stored = {}
        for info in infos:
            if isinstance(info, dict):  # the REST API's JSON
                trace_id = info.get("trace_id") or info.get("request_id") or ""
                names = {a.get("assessment_name") for a in info.get("assessments") or []}
            else:
                trace_id = info.trace_id
                names = {a.name for a in info.assessments or []}
            stored[str(trace_id)] = REWARD_ASSESSMENT in names
        return stored

    def _log_rewards(self, batch: Sequence[TrajectoryRecord], stored: dict[str, bool]) -> None:
        """One ``reward`` feedback per trace that has none: a new trace's is logged without a
        lookup; a stored trace's only when ``stored`` says it has none yet.

        On a tracking server the calls go out side by side (MLflow's REST API takes one
        assessment per request; a batch of 256 one after another is 256 round trips)."""
        todo: list[TrajectoryRecord] = [
            record for record in batch
            if record.reward is not None and not stored.get(mlflow_trace_id(record.trace_id))
        ]  # fmt: skip
        if self.is_server and len(todo) > 1:
            pool = self._reward_pool()
            futures = [pool.submit(self._log_reward, record) for record in todo]
            failures = [exc for exc in (f.exception() for f in futures) if exc is not None]
            if failures:  # the batch is sent again: _stored then finds the rewards written
                raise failures[0]
        else:
            for record in todo:
                self._log_reward(record)

    def _log_reward(self, record: TrajectoryRecord) -> None:
        from mlflow.entities import AssessmentSource, Feedback

        trace_id = mlflow_trace_id(record.trace_id)
        feedback = Feedback(
            name=REWARD_ASSESSMENT,
            value=float(record.reward),  # type: ignore[arg-type]  # checked by the caller
            source=AssessmentSource(source_type="CODE", source_id="rollout-tracer"),
        )
        if self.is_server:
            self._rest(
                "POST",
                f"/api/3.0/mlflow/traces/{trace_id}/assessments",
                {"assessment": _assessment_json(feedback, trace_id)},
            )
        else:
            self.tracing.log_assessment(trace_id, feedback)

    def _reward_pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(REWARD_REQUESTS_IN_FLIGHT,
                                            thread_name_prefix="rollout-tracer-mlflow")  # fmt: skip
        return self._pool

    def _rest(self, method: str, endpoint: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """A REST call without MLflow's minutes-long retries (the spool retries instead)."""
        import json

        from mlflow.utils.rest_utils import http_request, verify_rest_response

        kwargs: dict[str, Any] = {"json": body} if body is not None else {}
        response = http_request(
            host_creds=self.tracing.store.get_host_creds(),
            endpoint=endpoint,
            method=method,
            max_retries=0,
            timeout=self.config.export_timeout_s,
            **kwargs,
        )
        verify_rest_response(response, endpoint)
        return dict(json.loads(response.text or "{}"))

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        if self._pool is not None:  # the pipeline never shuts down while an export is in flight
            self._pool.shutdown(wait=False, cancel_futures=True)


def _root_and_generates(trace: Any) -> tuple[SpanRecord | None, list[SpanRecord]]:
    """The stored root span and generate spans of a trace, as much as an annotation needs:
    ids, times, and the generate spans' encoded log-probs."""
    root = None
    generates = []
    for s in trace.data.spans:
        attrs = s.attributes or {}
        record = SpanRecord(span_id=s.span_id, parent_id=s.parent_id, name=s.name,
                            kind=str(attrs.get("rollout_tracer.kind", "")),
                            start_ns=int(s.start_time_ns),
                            end_ns=int(s.end_time_ns or s.start_time_ns))  # fmt: skip
        if s.parent_id is None:
            root = record
        elif record.kind == "generate" and LOGPROBS_ATTR in attrs:
            record.attributes = {LOGPROBS_ATTR: attrs[LOGPROBS_ATTR]}
            generates.append(record)
    return root, generates


def mlflow_trace_id(trace_id: str) -> str:
    return f"tr-{trace_id}"


def _assessment_json(feedback: Any, trace_id: str) -> dict[str, Any]:
    import json

    from google.protobuf.json_format import MessageToJson

    feedback.trace_id = trace_id
    return dict(json.loads(MessageToJson(feedback.to_proto())))


def to_mlflow_spans(record: TrajectoryRecord) -> list[Any]:
    """Finished MLflow ``Span`` objects for one trajectory (root first); pass it
    ``mlflow_view(record)`` for what the exporter stores.

    Built by :func:`tracer.backends.otel_spans.to_readable_spans` (shared with the OTLP
    backend), every attribute value JSON-encoded as MLflow's in-process spans expect. Long
    token-id / mask / log-prob lists show as a count and their first and last values; the
    whole lists are kept in the span's ``rollout_tracer.full_lists`` attribute, where the
    readers (``tracer/readers/sources.py``) put them back.
    """
    from mlflow.entities import Span

    request_id = dumps(mlflow_trace_id(record.trace_id))
    spans = to_readable_spans(
        record,
        encode=encode_all_json,
        extra_attributes={"mlflow.traceRequestId": request_id},
    )
    return [Span(otel) for otel in spans]
