"""Trajectories back from Weave: undo what the weave backend wrote (root call = trajectory,
children by parent id, kind and trajectory fields from call attributes), one page of records
at a time. Reaches the server through ``tracer.weave_access``, never through the writer."""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from tracer import weave_access
from tracer.readers.selection import PAGE_SIZE, Selection
from tracer.record import SpanRecord, TrajectoryRecord

WEAVE_CALLS_PER_REQUEST = 2000  # children of a page of trajectories, fetched in chunks
_ROOT_COLUMNS = ["id", "trace_id", "started_at", "attributes"]
_SORT = [{"field": "started_at", "direction": "asc"}, {"field": "id", "direction": "asc"}]
_ROOT_KEYS = frozenset(
    {"kind", "step", "sample_index", "rollout_n", "validate", "worker_id", "experiment_name",
     "trace_id", "policy_version", "reward", "weave", "attempt"}
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
        attempt=_int_attr(attrs.get("attempt")) or 0,
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
    server, entity, project = weave_access.reading_server(project, entity)
    project_id = f"{entity}/{project}"
    offset = 0
    kept: list[str] = []
    done = False
    while not done:
        roots = _query(server, project_id, {"trace_roots_only": True}, page_size, offset,
                       _ROOT_COLUMNS)  # fmt: skip
        if not roots and offset == 0:
            raise ValueError(f"no calls in Weave project {project_id} (--experiment "
                             "[entity/]name: the tracer's project_name; the entity: --entity "
                             "or $WANDB_ENTITY)")  # fmt: skip
        offset += len(roots)
        done = not roots  # not "fewer than asked": a server may cap the page size
        for root in roots:
            if _selected(_get(root, "attributes") or {}, selection):
                kept.append(str(_get(root, "trace_id")))
        while len(kept) >= page_size or (done and kept):
            trace_ids, kept = kept[:page_size], kept[page_size:]
            yield _weave_page(server, project_id, trace_ids, project)
