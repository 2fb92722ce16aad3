"""Where stored trajectories come back from, one page of :class:`TrajectoryRecord` at a time.

Every source yields pages (lists of records) so exports run in bounded memory. MLflow traces
are turned back into records by undoing what ``tracer.backends.mlflow_backend`` wrote (span
kind from ``rollout_tracer.kind``, trajectory attributes from trace tags, reward from the
``reward`` assessment); Weave calls by undoing ``tracer.backends.weave_backend`` (root call =
trajectory, children by parent id, kind and trajectory fields from call attributes).
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from tracer.record import KINDS, SpanRecord, TrajectoryRecord, read_jsonl
from tracer.token_lists import FULL_LISTS_ATTRIBUTE, restore_lists

PAGE_SIZE = 500  # an MLflow server caps max_results at 500
SOURCES = ("mlflow", "jsonl", "weave")

_KIND_BY_TYPE = {span_type: kind for kind, span_type in reversed(list(KINDS.items()))}
_KNOWN_TAGS = frozenset(
    {"step", "sample_index", "rollout_n", "validate", "experiment_name", "worker_id",
     "policy_version", "reward"}
)  # fmt: skip


@dataclass
class Selection:
    """Which trajectories to read: ``steps`` (None = all), ``validate`` (None = both)."""

    steps: Sequence[int] | None = None
    validate: bool | None = None

    def keeps(self, record: TrajectoryRecord) -> bool:
        if self.steps is not None and record.step not in self.steps:
            return False
        return self.validate is None or bool(record.validate) == self.validate


def parse_steps(step: int | None = None, steps: str | None = None) -> list[int] | None:
    """``step=3`` -> [3]; ``steps="1:10"`` -> [1..10] (inclusive); ``"1,4,7"`` -> [1, 4, 7]."""
    if step is not None:
        return [int(step)]
    if not steps:
        return None
    if ":" in steps:
        lo, hi = steps.split(":", 1)
        return list(range(int(lo), int(hi) + 1))
    return [int(s) for s in steps.split(",") if s.strip()]


# ------------------------------------------------------------------------------------ JSONL
def iter_jsonl(
    path: str,
    selection: Selection | None = None,
    experiment: str | None = None,
    page_size: int = PAGE_SIZE,
) -> Iterator[list[TrajectoryRecord]]:
    """Pages of records from a JSONL backend file. A partial (crashed) last line is skipped.
    ``experiment`` keeps records whose project_name or experiment_name equals it."""
    selection = selection or Selection()
    page: list[TrajectoryRecord] = []
    for record in read_jsonl(path):
        if experiment and experiment not in (record.project_name, record.experiment_name):
            continue
        if not selection.keeps(record):
            continue
        page.append(record)
        if len(page) >= page_size:
            yield page
            page = []
    if page:
        yield page


# ----------------------------------------------------------------------------------- MLflow
def _filters(selection: Selection) -> list[str | None]:
    """One MLflow filter string per query (tags are strings: a step range is one query per
    step)."""
    clauses = []
    if selection.validate is not None:
        clauses.append(f"tags.validate = '{str(selection.validate).lower()}'")
    if selection.steps is None:
        return [" AND ".join(clauses) or None]
    return [" AND ".join([f"tags.step = '{s}'", *clauses]) for s in selection.steps]


def iter_mlflow(
    tracking_uri: str,
    experiment: str,
    selection: Selection | None = None,
    page_size: int = PAGE_SIZE,
) -> Iterator[list[TrajectoryRecord]]:
    """Pages of records from an MLflow tracking store, ``page_size`` traces per request."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise ValueError(f"no MLflow experiment named {experiment!r} at {tracking_uri}")
    for filter_string in _filters(selection or Selection()):
        token = None
        while True:
            page = client.search_traces(
                locations=[exp.experiment_id],
                filter_string=filter_string,
                max_results=page_size,
                page_token=token,
            )
            records = [mlflow_to_record(t, experiment) for t in page]
            if records:
                yield records
            token = page.token
            if not token:
                break


def _parse_tag(value: str | None) -> Any:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        return value


def _span_error(span: Any) -> dict[str, Any] | None:
    for event in span.events or []:
        if event.name == "exception":
            attrs = event.attributes or {}
            return {
                "type": attrs.get("exception.type", ""),
                "message": attrs.get("exception.message", ""),
                "traceback": attrs.get("exception.stacktrace", ""),
            }
    return None


def _mlflow_span(span: Any) -> SpanRecord:
    attrs = dict(span.attributes or {})
    kind = attrs.pop("rollout_tracer.kind", None) or _KIND_BY_TYPE.get(span.span_type, "other")
    status = getattr(span.status.status_code, "value", str(span.status.status_code))
    error = _span_error(span)
    if status == "ERROR" and error is None:
        error = {"type": "", "message": span.status.description or "error", "traceback": ""}
    inputs, outputs = span.inputs, span.outputs
    full_lists = attrs.pop(FULL_LISTS_ATTRIBUTE, None)
    if full_lists is not None:  # the writer showed them compactly: the export gets them whole
        inputs, outputs = restore_lists(inputs, outputs, full_lists)
    return SpanRecord(
        span_id=span.span_id,
        parent_id=span.parent_id,
        name=span.name,
        kind=str(kind),
        start_ns=int(span.start_time_ns),
        end_ns=int(span.end_time_ns or span.start_time_ns),
        status="ERROR" if status == "ERROR" else "OK",
        error=error,
        inputs=inputs,
        outputs=outputs,
        attributes={k: v for k, v in attrs.items() if not k.startswith("mlflow.")},
    )


def _reward(trace: Any, root: SpanRecord | None) -> float | None:
    for assessment in trace.info.assessments or []:
        if assessment.name == "reward" and getattr(assessment, "feedback", None) is not None:
            value = assessment.feedback.value
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    tag = trace.info.tags.get("reward")
    if tag:
        try:
            return float(tag)
        except ValueError:
            pass
    value = root.attributes.get("reward") if root is not None else None
    return float(value) if isinstance(value, (int, float)) else None


def mlflow_to_record(trace: Any, experiment: str) -> TrajectoryRecord:
    """An ``mlflow.entities.Trace`` written by the MLflow backend -> a TrajectoryRecord."""
    spans = [_mlflow_span(s) for s in trace.data.spans]
    roots = [s for s in spans if s.parent_id is None]
    root = roots[0] if roots else None
    if root is not None:
        spans.remove(root)
        spans.insert(0, root)
    tags = dict(trace.info.tags or {})
    trace_id = str(trace.info.trace_id)
    start_ns = root.start_ns if root else int(trace.info.request_time) * 1_000_000
    return TrajectoryRecord(
        trace_id=trace_id[3:] if trace_id.startswith("tr-") else trace_id,
        name=root.name if root else str(tags.get("mlflow.traceName", "")),
        project_name=experiment,
        experiment_name=tags.get("experiment_name", ""),
        step=_parse_tag(tags.get("step")),
        sample_index=_parse_tag(tags.get("sample_index")),
        rollout_n=_parse_tag(tags.get("rollout_n")),
        validate=tags.get("validate") == "true",
        worker_id=tags.get("worker_id", ""),
        start_ns=start_ns,
        end_ns=root.end_ns if root else start_ns,
        status=root.status if root else "OK",
        reward=_reward(trace, root),
        policy_version=_parse_tag(tags.get("policy_version")),
        attributes={
            k: v for k, v in tags.items() if k not in _KNOWN_TAGS and not k.startswith("mlflow.")
        },
        spans=spans,
    )


# ------------------------------------------------------------------------------------ Weave
WEAVE_CALLS_PER_REQUEST = 2000  # children of a page of trajectories, fetched in chunks
_ROOT_COLUMNS = ["id", "trace_id", "started_at", "attributes"]
_SORT = [{"field": "started_at", "direction": "asc"}, {"field": "id", "direction": "asc"}]
_ROOT_KEYS = frozenset(
    {"kind", "step", "sample_index", "rollout_n", "validate", "worker_id", "experiment_name",
     "trace_id", "policy_version", "reward", "weave"}
)  # fmt: skip
_CHILD_KEYS = frozenset({"kind", "step", "sample_index", "rollout_n", "weave"})
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def _get(call: Any, name: str) -> Any:
    return call.get(name) if isinstance(call, dict) else getattr(call, name, None)


def _ns(value: Any) -> int | None:
    """A call timestamp (datetime or ISO string) -> ns since the epoch, exact to the µs."""
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.timezone.utc)
    return int((value - _EPOCH) // dt.timedelta(microseconds=1)) * 1000


def _hex(call_id: Any) -> str:
    try:
        return uuid.UUID(str(call_id)).hex
    except ValueError:
        return str(call_id)


def _weave_error(call: Any) -> dict[str, Any] | None:
    raw = _get(call, "exception")
    if raw is None:
        return None
    try:
        parsed = json.loads(raw)
    except (TypeError, ValueError):
        parsed = None
    if not isinstance(parsed, dict):
        return {"type": "", "message": str(raw), "traceback": ""}
    return {
        "type": str(parsed.get("type") or ""),
        "message": str(parsed.get("message") or ""),
        "traceback": "",  # Weave keeps the export thread's stack, not the op's traceback
    }


def _call_name(call: Any) -> str:
    name = _get(call, "display_name")
    if name:
        return str(name)
    op = str(_get(call, "op_name") or "")  # weave:///entity/project/op/<name>:<digest>
    return op.rsplit("/", 1)[-1].split(":", 1)[0]


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def weave_to_record(root: Any, children: Sequence[Any], project: str) -> TrajectoryRecord:
    """A root Weave call and its descendants, as written by the Weave backend -> a
    TrajectoryRecord (span ids are the low 64 bits of the call ids, which is what the backend
    derived them from; the root's span id is not stored and becomes the trace id's low half)."""
    trace_id = _hex(_get(root, "trace_id") or _get(root, "id"))
    root_span_id = trace_id[16:]
    attrs = dict(_get(root, "attributes") or {})
    summary = _get(root, "summary") or {}
    start_ns = _ns(_get(root, "started_at")) or 0
    end_ns = _ns(_get(root, "ended_at")) or start_ns
    error = _weave_error(root)
    reward = _number(summary.get("reward"))
    if reward is None:
        reward = _number(attrs.get("reward"))
    extra = {k: v for k, v in attrs.items() if k not in _ROOT_KEYS}
    root_attrs = {**extra, **({"reward": reward} if reward is not None else {})}
    spans = [
        SpanRecord(
            span_id=root_span_id,
            parent_id=None,
            name=_call_name(root),
            kind=str(attrs.get("kind") or "trajectory"),
            start_ns=start_ns,
            end_ns=end_ns,
            status="ERROR" if error else "OK",
            error=error,
            inputs=_get(root, "inputs"),
            outputs=_get(root, "output"),
            attributes=root_attrs,
        )
    ]
    root_id = _get(root, "id")
    for call in children:
        span_attrs = dict(_get(call, "attributes") or {})
        parent = _get(call, "parent_id")
        call_error = _weave_error(call)
        call_start = _ns(_get(call, "started_at")) or start_ns
        spans.append(
            SpanRecord(
                span_id=_hex(_get(call, "id"))[16:],
                parent_id=root_span_id if parent in (None, root_id) else _hex(parent)[16:],
                name=_call_name(call),
                kind=str(span_attrs.get("kind") or "other"),
                start_ns=call_start,
                end_ns=_ns(_get(call, "ended_at")) or call_start,
                status="ERROR" if call_error else "OK",
                error=call_error,
                inputs=_get(call, "inputs"),
                outputs=_get(call, "output"),
                attributes={k: v for k, v in span_attrs.items() if k not in _CHILD_KEYS},
            )
        )
    validate = attrs.get("validate")
    return TrajectoryRecord(
        trace_id=trace_id,
        name=spans[0].name,
        project_name=project,
        experiment_name=str(attrs.get("experiment_name") or ""),
        step=_int_attr(attrs.get("step")),
        sample_index=attrs.get("sample_index"),
        rollout_n=attrs.get("rollout_n"),
        validate=validate is True or str(validate).lower() == "true",
        worker_id=str(attrs.get("worker_id") or ""),
        start_ns=start_ns,
        end_ns=end_ns,
        status=spans[0].status,
        reward=reward,
        policy_version=attrs.get("policy_version"),
        attributes=extra,
        spans=spans,
    )


def _int_attr(value: Any) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _selected(attrs: dict[str, Any], selection: Selection) -> bool:
    if selection.steps is not None and _int_attr(attrs.get("step")) not in selection.steps:
        return False
    if selection.validate is None:
        return True
    validate = attrs.get("validate")
    return (validate is True or str(validate).lower() == "true") == selection.validate


def weave_server(project: str, entity: str | None = None) -> tuple[Any, str, str]:
    """(trace server, entity, project) for reading ``[entity/]project``: the server injected
    with ``weave_backend.set_server_factory`` (tests), else the process's Weave client for
    that project, else the W&B cloud (or ``WF_TRACE_SERVER_URL``) with ``WANDB_API_KEY``.
    Raises ValueError with what to set; never creates a project."""
    from tracer.backends import weave_backend
    from tracer.config import TraceConfig

    if "/" in project:
        entity, project = project.split("/", 1)
    config = TraceConfig(project_name=project, weave_entity=entity)
    factory = weave_backend._server_factory
    if factory is not None:
        return factory(config), weave_backend._entity(config, "rollout-tracer") or "", project
    from weave.trace import env as weave_env
    from weave.trace.context.weave_client_context import get_weave_client
    from weave.trace.weave_init import get_entity_project_from_project_name, init_weave_get_server
    from weave.wandb_interface.context import get_wandb_auth_context

    entity = weave_backend._entity(config, None)
    current = get_weave_client()
    if current is not None and current.project == project and entity in (None, current.entity):
        return current.server, str(current.entity), project
    url = weave_env.weave_trace_server_url()
    credentials = get_wandb_auth_context()
    if credentials is None:
        raise ValueError(
            "reading from Weave needs W&B credentials: set WANDB_API_KEY (or run `wandb "
            f"login`); trace server {url} (WF_TRACE_SERVER_URL for a self-hosted server)"
        )
    server = init_weave_get_server(credentials)
    try:
        server.server_info()
    except Exception as exc:
        raise ValueError(
            f"Weave trace server {url} is not reachable ({type(exc).__name__}: {exc})"
        ) from exc
    if entity is None:
        entity, _ = get_entity_project_from_project_name(project)
    return server, str(entity), project


def _query(server: Any, project_id: str, filter: dict[str, Any], limit: int, offset: int,
           columns: list[str] | None = None) -> list[Any]:  # fmt: skip
    return list(
        server.calls_query_stream(
            {
                "project_id": project_id,
                "filter": filter,
                "limit": limit,
                "offset": offset,
                "sort_by": _SORT,
                "columns": columns,
            }
        )
    )


def _weave_page(
    server: Any, project_id: str, trace_ids: list[str], project: str
) -> list[TrajectoryRecord]:
    """The records of these traces: every call of each (``trace_ids`` filter), in chunks."""
    roots: dict[str, Any] = {}
    children: dict[str, list[Any]] = {t: [] for t in trace_ids}
    offset = 0
    while True:
        calls = _query(server, project_id, {"trace_ids": trace_ids}, WEAVE_CALLS_PER_REQUEST,
                       offset)  # fmt: skip
        for call in calls:
            trace_id = str(_get(call, "trace_id"))
            if trace_id not in children:
                continue
            if _get(call, "parent_id") is None:
                roots[trace_id] = call
            else:
                children[trace_id].append(call)
        if not calls:  # not "fewer than asked": a server may cap the page size
            break
        offset += len(calls)
    return [weave_to_record(roots[t], children[t], project) for t in trace_ids if t in roots]


def iter_weave(
    project: str,
    entity: str | None = None,
    selection: Selection | None = None,
    page_size: int = PAGE_SIZE,
) -> Iterator[list[TrajectoryRecord]]:
    """Pages of records from a Weave project, through the trace server's ``calls_query_stream``
    (what ``WeaveClient.get_calls`` pages with, ``limit``/``offset``, oldest first). Root calls
    are listed ``page_size`` at a time (ids and attributes only) and filtered by step and
    validate here; then each page of kept traces is fetched whole (``trace_ids`` filter).
    ``project`` may be ``entity/project``."""
    selection = selection or Selection()
    server, entity, project = weave_server(project, entity)
    project_id = f"{entity}/{project}"
    offset = 0
    kept: list[str] = []
    done = False
    while not done:
        roots = _query(server, project_id, {"trace_roots_only": True}, page_size, offset,
                       _ROOT_COLUMNS)  # fmt: skip
        if not roots and offset == 0:
            raise ValueError(f"no calls in Weave project {project_id}")
        offset += len(roots)
        done = not roots  # not "fewer than asked": a server may cap the page size
        for root in roots:
            if _selected(_get(root, "attributes") or {}, selection):
                kept.append(str(_get(root, "trace_id")))
        while len(kept) >= page_size or (done and kept):
            trace_ids, kept = kept[:page_size], kept[page_size:]
            yield _weave_page(server, project_id, trace_ids, project)


def iter_records(
    source: str,
    *,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    path: str | None = None,
    entity: str | None = None,
    selection: Selection | None = None,
    page_size: int = PAGE_SIZE,
) -> Iterator[list[TrajectoryRecord]]:
    """Pages of trajectory records from ``source`` (one of :data:`SOURCES`)."""
    if source == "mlflow":
        if not experiment:
            raise ValueError("--experiment is required with --from mlflow")
        uri = tracking_uri or _default_tracking_uri()
        return iter_mlflow(uri, experiment, selection, page_size)
    if source == "jsonl":
        if not path:
            raise ValueError("--path FILE is required with --from jsonl")
        return iter_jsonl(path, selection, experiment, page_size)
    if source == "weave":
        if not experiment:
            raise ValueError("--experiment (the Weave project, the tracer's project_name) is "
                             "required with --from weave")  # fmt: skip
        return iter_weave(experiment, entity, selection, page_size)
    raise ValueError(f"unknown source {source!r}; valid: {', '.join(SOURCES)}")


def _default_tracking_uri() -> str:
    import os

    env = os.environ.get("MLFLOW_TRACKING_URI")
    return env or f"sqlite:///{os.path.abspath('mlflow.db')}"
