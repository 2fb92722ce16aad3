"""Trajectories back from MLflow: undo what the mlflow backend wrote (span kind from
``rollout_tracer.kind``, trajectory attributes from trace tags, reward from the ``reward``
assessment), one page of records at a time. Depends on stored data only, never on the
writer."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from tracer.readers.selection import PAGE_SIZE, Selection, StoreNotFound, no_match
from tracer.record import KINDS, SpanRecord, TrajectoryRecord
from tracer.token_lists import FULL_LISTS_ATTRIBUTE, restore_lists

_KIND_BY_TYPE = {span_type: kind for kind, span_type in reversed(list(KINDS.items()))}
_KNOWN_TAGS = frozenset(
    {"step", "sample_index", "rollout_n", "validate", "experiment_name", "worker_id",
     "policy_version", "reward", "attempt"}
)  # fmt: skip


def _filters(selection: Selection) -> list[str | None]:
    """One MLflow filter string per query (tags are strings: a step range is one query per
    step)."""
    clauses = []
    if selection.validate is not None:
        # 'false' (native) or 'False' (verl's spelling, written by the verl shim)
        clauses.append(f"tags.validate ILIKE '{str(selection.validate).lower()}'")
    if selection.steps is None:
        return [" AND ".join(clauses) or None]
    return [" AND ".join([f"tags.step = '{s}'", *clauses]) for s in selection.steps]


HOW_TO_POINT = ("point at the store the run wrote with --tracking-uri (e.g. --tracking-uri "
                "sqlite:////abs/path/mlflow.db; `rollout-tracer run` prints it) or "
                "$MLFLOW_TRACKING_URI")


def local_store_path(tracking_uri: str) -> str | None:
    """The file (sqlite) or folder (file store) a local tracking URI names; None for servers
    and databases elsewhere."""
    if tracking_uri.startswith("sqlite:///"):
        path = tracking_uri[len("sqlite:///"):].split("?", 1)[0]
        return path or None
    if tracking_uri.startswith("file:"):
        return tracking_uri[len("file://"):] if tracking_uri.startswith("file://") else \
            tracking_uri[len("file:"):]
    if "://" not in tracking_uri and not tracking_uri.startswith(("databricks", "postgresql")):
        return tracking_uri  # a bare path: MLflow's file store folder
    return None


def check_store(tracking_uri: str) -> None:
    """Raise :class:`StoreNotFound` when a local store is missing, before MLflow is imported:
    MLflow's client would create an empty database (and its folder) where it looks."""
    path = local_store_path(tracking_uri)
    if path is None or path == ":memory:":
        return
    if tracking_uri.startswith("sqlite:") and not os.path.isfile(path):
        what = "is a folder, not a database file" if os.path.isdir(path) else "does not exist"
        raise StoreNotFound(f"no MLflow store at {tracking_uri} ({path} {what}); {HOW_TO_POINT}")
    if not tracking_uri.startswith("sqlite:") and not os.path.isdir(path):
        raise StoreNotFound(f"no MLflow store at {tracking_uri} (no folder {path}); "
                            f"{HOW_TO_POINT}")  # fmt: skip


def iter_mlflow(
    tracking_uri: str,
    experiment: str,
    selection: Selection | None = None,
    page_size: int = PAGE_SIZE,
) -> Iterator[list[TrajectoryRecord]]:
    """Pages of records from an MLflow tracking store, ``page_size`` traces per request.
    Raises :class:`StoreNotFound` (no store there), ``ValueError`` (no such experiment: the
    message lists those in the store) or :class:`NoTrajectories` (nothing matched)."""
    check_store(tracking_uri)
    selection = selection or Selection()
    fast = _sqlite_pages(tracking_uri, experiment, selection, page_size)
    if fast is not None:
        yield from fast
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = [e.name for e in client.search_experiments(max_results=50)]
        raise ValueError(unknown_experiment(experiment, tracking_uri, names))
    found = False
    for filter_string in _filters(selection):
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
                found = True
                yield records
            token = page.token
            if not token:
                break
    if not found:
        raise no_match(f"MLflow experiment {experiment!r} at {tracking_uri}", selection, None)


def _sqlite_pages(tracking_uri: str, experiment: str, selection: Selection, page_size: int
                  ) -> Iterator[list[TrajectoryRecord]] | None:  # fmt: skip
    """Pages read from a sqlite store's tables (no MLflow import), or None: use the client."""
    if not tracking_uri.startswith("sqlite:"):
        return None
    from tracer.readers.mlflow_sqlite import open_store

    store = open_store(str(local_store_path(tracking_uri)))
    if store is None:
        return None
    names = store.experiments()
    if experiment not in names:
        raise ValueError(unknown_experiment(experiment, tracking_uri, list(names)))
    ids, steps = store.selected(names[experiment], selection)
    if not ids:
        raise no_match(f"MLflow experiment {experiment!r} at {tracking_uri}", selection, None,
                       steps)  # fmt: skip
    if not store.all_spans_here(ids):
        return None
    return ([mlflow_to_record(t, experiment) for t in page]
            for page in store.pages(ids, page_size))


def unknown_experiment(experiment: str, tracking_uri: str, names: list[str]) -> str:
    listed = ", ".join(repr(n) for n in names) or "none"
    return (f"no MLflow experiment named {experiment!r} at {tracking_uri}; experiments there: "
            f"{listed} (--experiment is the tracer's project_name)")  # fmt: skip


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


def _attempt(tag: Any) -> int:
    """The ``attempt`` tag (absent on traces written before attempts were counted: 0)."""
    value = _parse_tag(tag)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


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
        validate=str(tags.get("validate")).lower() == "true",
        worker_id=tags.get("worker_id", ""),
        start_ns=start_ns,
        end_ns=root.end_ns if root else start_ns,
        status=root.status if root else "OK",
        reward=_reward(trace, root),
        policy_version=_parse_tag(tags.get("policy_version")),
        attempt=_attempt(tags.get("attempt")),
        attributes={
            k: v for k, v in tags.items() if k not in _KNOWN_TAGS and not k.startswith("mlflow.")
        },
        spans=spans,
    )
