"""Weave backend: each trajectory becomes a tree of Weave calls, created off the hot path.

The trajectory is the root call (its id is the record's trace id as a UUID, so Weave's trace
id equals it); every generate / parse / tool / reward span is a child call with its parent id,
created through the real ``WeaveClient`` (``create_call`` / ``finish_call`` with explicit ids
and timestamps) on the backend's own export thread. ``weave.op`` is never used and nothing is
patched. Call ids are deterministic (derived from trace id and span id), so a replayed batch
writes the same calls again; within a process a trajectory is sent once.

What a call carries:

- root: the root span's inputs and outputs (the first child's inputs; ``{reward, output}``),
  ``summary["reward"]``; attributes ``step``,
  ``sample_index``, ``rollout_n``, ``validate``, ``attempt``, ``worker_id``,
  ``experiment_name``, ``policy_version``, ``kind`` and the trajectory's extra attributes.
- children: the op's inputs (wrapped as ``{"inputs": x}`` when not a dict) and output;
  attributes ``kind``, ``step``, ``sample_index``, ``rollout_n`` and the span's derived
  attributes (``prompt_text``, ``response_tokens``, ``tool_name``, ``reward``, ...). A failed op
  finishes with its exception type and message.

Connection: project ``config.project_name``, entity ``config.weave_entity`` (else
``WANDB_ENTITY``, else the account's default entity). The W&B cloud (or the server at
``WF_TRACE_SERVER_URL``) needs ``WANDB_API_KEY``; a missing key or an unreachable server raises
at init. If the process already has a global Weave client for the same project (the user called
``weave.init``), it is reused. Tests inject a trace server with
``tracer.weave_access.set_server_factory``.

Weave's global client is the user's: the exporter never installs its client for the run, never
replaces or removes the user's. It calls its own client directly, which works whatever the global
is, with one exception: ``create_call`` / ``finish_call`` record nothing while *no* global client
exists (weave 0.54 checks only that one exists). So when the user has none, the exporter's
client is installed for the duration of an export call only, and removed afterwards if it is
still there (:func:`_weave_gate`). During that window a ``weave.op`` the user runs in another
thread without having called ``weave.init`` is recorded in the exporter's project.

Annotations (``tracer.annotate``) become Weave *feedback* on the trajectory's root call
(feedback type ``rollout_tracer.annotation``; payload: the annotation span's id, the encoded
values and the aggregates of the values it holds), created through the trace server's
``feedback_create`` with an id derived from the annotation's span id, so annotating again
writes the same feedback row. A trajectory whose root call is not in the project (not sampled)
is skipped after one lookup. Users read it with weave's own API (``call.feedback``).

Uses ``WeaveClient`` directly (``_call_id_override`` is private): pyproject holds weave to
0.54.x.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from tracer import weave_access
from tracer.annotations import AnnotationRecord, annotation_span
from tracer.backends.base import Exporter, ExportResult, RecentIds
from tracer.backends.otel_spans import root_inputs, root_outputs
from tracer.config import TraceConfig
from tracer.record import SpanRecord, TrajectoryRecord

log = logging.getLogger("tracer")

FEEDBACK_TYPE = "rollout_tracer.annotation"  # the feedback an annotation becomes

# config -> an object implementing weave's TraceServerClientInterface (tests: in-process)
def call_id(record: TrajectoryRecord, span: SpanRecord) -> str:
    """Deterministic Weave call id: the trace id for the root, trace prefix + span id below."""
    if span.parent_id is None:
        return str(uuid.UUID(hex=record.trace_id))
    return str(uuid.UUID(hex=record.trace_id[:16] + span.span_id))


def _time(ns: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.timezone.utc)


def connect(config: TraceConfig) -> Any:
    """A WeaveClient for ``config.project_name`` on the W&B cloud or ``WF_TRACE_SERVER_URL``;
    raises RuntimeError with what to set when credentials or the server are missing."""
    from weave.trace import env as weave_env
    from weave.trace.weave_client import WeaveClient
    from weave.trace.weave_init import get_entity_project_from_project_name, init_weave_get_server
    from weave.wandb_interface.context import get_wandb_auth_context

    url = weave_env.weave_trace_server_url()
    credentials = get_wandb_auth_context()
    if credentials is None:
        raise RuntimeError(
            "the weave backend needs W&B credentials: set WANDB_API_KEY (or run `wandb login`); "
            f"trace server {url} (set WF_TRACE_SERVER_URL for a self-hosted Weave server)"
        )
    server = init_weave_get_server(credentials)
    try:
        server.server_info()
    except Exception as exc:
        raise RuntimeError(
            f"Weave trace server {url} is not reachable ({type(exc).__name__}: {exc}); check "
            "WF_TRACE_SERVER_URL, the network and WANDB_API_KEY"
        ) from exc
    entity = weave_access.resolve_entity(config, None)
    if entity is None:
        entity, _ = get_entity_project_from_project_name(config.project_name)
    return WeaveClient(entity, config.project_name, server, ensure_project_exists=True)


def _make_client(config: TraceConfig) -> Any:
    from weave.trace.context.weave_client_context import get_weave_client
    from weave.trace.weave_client import WeaveClient

    factory = weave_access.server_factory()
    if factory is not None:
        server = factory(config)
        entity = weave_access.resolve_entity(config, "rollout-tracer") or "rollout-tracer"
        return WeaveClient(entity, config.project_name, server, ensure_project_exists=False)
    current = get_weave_client()
    if (
        current is not None
        and current.project == config.project_name
        and (config.weave_entity is None or current.entity == config.weave_entity)
    ):
        return current
    return connect(config)


_gate_lock = threading.Lock()
_gate_users = 0  # export calls in flight, across exporters
_gate_client: Any = None  # the client _weave_gate installed as weave's global, if any


@contextlib.contextmanager
def _weave_gate(client: Any) -> Iterator[None]:
    """Weave's global client exists while the block runs (see the module docstring): the user's
    if there is one, else ``client`` until the last overlapping export call ends."""
    from weave.trace.context import weave_client_context

    global _gate_users, _gate_client
    with _gate_lock:
        _gate_users += 1
        if _gate_client is None and weave_client_context.get_weave_client() is None:
            weave_client_context.set_weave_client_global(client)  # only if still none
            if weave_client_context.get_weave_client() is client:
                _gate_client = client
    try:
        yield
    finally:
        with _gate_lock:
            _gate_users -= 1
            if _gate_users == 0 and _gate_client is not None:
                # a client the user installed meanwhile (weave.init) stays
                if weave_client_context.get_weave_client() is _gate_client:
                    weave_client_context.set_weave_client_global(None)
                _gate_client = None


class _RecordedError(Exception):
    """Carries a recorded op failure (type name and message) into Weave's exception field."""


def _exception(error: dict[str, Any] | None) -> BaseException:
    error = error or {}
    name = str(error.get("type") or "Exception").rsplit(".", 1)[-1] or "Exception"
    cls = type(name, (_RecordedError,), {"__module__": "rollout_tracer.recorded"})
    return cls(str(error.get("message", "")))


class WeaveExporter(Exporter):
    name = "weave"

    def __init__(self, config: TraceConfig, client: Any = None) -> None:
        import weave  # noqa: F401  (ImportError -> "pip install rollout-tracer[weave]")

        self.config = config
        self.client = client if client is not None else _make_client(config)
        self.destination = f"{self.client.entity}/{self.client.project}"  # names the spool
        self._lock = threading.Lock()
        self._exported: RecentIds[None] = RecentIds()

    def export(
        self, batch: Sequence[TrajectoryRecord], *, replay: bool = False
    ) -> ExportResult:
        from weave.trace.settings import override_settings

        with self._lock:
            todo = [r for r in batch if r.trace_id not in self._exported]
        if not todo:
            return ExportResult.SUCCESS
        with override_settings(print_call_link=False), _weave_gate(self.client):
            for record in todo:
                self._export_one(record)
        self.client.flush()
        with self._lock:
            for r in todo:
                self._exported.add(r.trace_id, None)
        return ExportResult.SUCCESS

    def _export_one(self, record: TrajectoryRecord) -> None:
        from weave.trace.op import is_placeholder_call

        client = self.client
        calls: dict[str, Any] = {}
        opened: list[tuple[SpanRecord, Any]] = []
        root_id = record.root.span_id
        for i, span in enumerate(record.spans):
            parent = None
            if i > 0:
                parent = calls.get(span.parent_id or root_id, calls[root_id])
            call = client.create_call(
                span.name,
                self._inputs(record, span, i == 0),
                parent=parent,
                attributes=self._attributes(record, span, i == 0),
                display_name=span.name,
                use_stack=False,
                _call_id_override=call_id(record, span),
                started_at=_time(span.start_ns),
            )
            if is_placeholder_call(call):  # weave is off here: fail the batch, never drop it
                raise RuntimeError(
                    "Weave recorded nothing: tracing is disabled in this process (WEAVE_DISABLED, "
                    "or weave.finish() was called during the export)"
                )
            calls[span.span_id] = call
            opened.append((span, call))
        # children first, so Weave's summary roll-up (status counts) sees them finished
        for span, call in reversed(opened):
            is_root = span is record.root
            if is_root and record.reward is not None:
                call.summary = {**(call.summary or {}), "reward": record.reward}
            client.finish_call(
                call,
                root_outputs(record) if is_root else span.outputs,
                exception=_exception(span.error) if span.status == "ERROR" else None,
                ended_at=_time(span.end_ns),
            )

    @staticmethod
    def _inputs(record: TrajectoryRecord, span: SpanRecord, is_root: bool) -> dict[str, Any]:
        inputs = root_inputs(record) if is_root else span.inputs
        if isinstance(inputs, dict):
            return dict(inputs)
        return {} if inputs is None else {"inputs": inputs}

    @staticmethod
    def _attributes(record: TrajectoryRecord, span: SpanRecord, is_root: bool) -> dict[str, Any]:
        attrs: dict[str, Any] = {
            "kind": span.kind,
            "step": record.step,
            "sample_index": record.sample_index,
            "rollout_n": record.rollout_n,
        }
        if is_root:
            attrs.update(
                validate=record.validate,
                attempt=record.attempt,
                worker_id=record.worker_id,
                experiment_name=record.experiment_name,
                trace_id=record.trace_id,
            )
            if record.policy_version is not None:
                attrs["policy_version"] = record.policy_version
            if record.reward is not None:
                attrs["reward"] = record.reward
            for key, value in record.attributes.items():
                attrs.setdefault(str(key), value)
        for key, value in span.attributes.items():
            attrs.setdefault(str(key), value)
        attrs.pop("weave", None)  # reserved by Weave for its own metadata
        return attrs

    supports_annotations = True

    def annotate(self, batch: Sequence[AnnotationRecord]) -> list[bool]:
        """Each annotation as feedback on its trajectory's root call (see the module doc)."""
        from weave.trace.feedback import feedback_create_params

        self.client.flush()  # the root calls this exporter sent are on the server first
        project_id = f"{self.client.entity}/{self.client.project}"
        found = []
        for ann in batch:
            root = str(uuid.UUID(hex=ann.trace_id))
            query = {"project_id": project_id, "filter": {"call_ids": [root]}, "limit": 1,
                     "columns": ["id"]}  # fmt: skip
            if not list(self.client.server.calls_query_stream(query)):
                found.append(False)
                continue
            span, _tags = annotation_span(ann, ann.root_span_id, ann.created_ns, None)
            params = feedback_create_params(
                project_id=project_id, weave_ref=f"weave:///{project_id}/call/{root}",
                feedback_type=FEEDBACK_TYPE,
                payload={"span_id": span.span_id, "values": dict(ann.values),
                         "summary": span.outputs},
            )  # fmt: skip
            params["id"] = str(uuid.UUID(hex=ann.trace_id[:16] + span.span_id))  # idempotent
            self.client.server.feedback_create(params)
            found.append(True)
        return found

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        self.client.flush()
        return True

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self.client.flush()
