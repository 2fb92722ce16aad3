"""Where stored trajectories come back from, one page of :class:`TrajectoryRecord` at a time.

Every source yields pages (lists of records) so exports run in bounded memory: ``jsonl`` here,
``mlflow`` in ``mlflow_source``, ``weave`` in ``weave_source`` (each imports its client
library only when used). Readers depend on stored data only, never on a backend's writer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

from tracer.annotations import RECORD_TYPE, AnnotationRecord, apply_to_record
from tracer.readers.mlflow_source import check_store, iter_mlflow, mlflow_to_record
from tracer.readers.selection import (
    PAGE_SIZE,
    Selection,
    StoreNotFound,
    no_match,
    paged,
    parse_steps,
)
from tracer.readers.verl_dump import iter_verl_dump
from tracer.readers.weave_source import iter_weave, weave_to_record
from tracer.record import TrajectoryRecord, read_jsonl

SOURCES = ("mlflow", "jsonl", "weave", "verl-dump")
__all__ = ["SOURCES", "Selection", "iter_records", "mlflow_to_record", "parse_steps",
           "weave_to_record"]  # fmt: skip


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
    annotations = _annotation_offsets(path)
    found = False
    steps: set[object] = set()
    experiments: set[str] = set()

    def kept() -> Iterator[TrajectoryRecord]:
        nonlocal found
        for record in read_jsonl(path):
            steps.add(record.step)
            experiments.update((record.project_name, record.experiment_name))
            if experiment and experiment not in (record.project_name, record.experiment_name):
                continue
            if not selection.keeps(record):
                continue
            found = True
            if record.trace_id in annotations:
                _merge_annotations(path, record, annotations[record.trace_id])
            yield record

    yield from paged(kept(), page_size)
    if not found:
        raise no_match(path, selection, experiment, steps, experiments)


_ANNOTATION_MARK = f'"record_type": "{RECORD_TYPE}"'.encode()


def _annotation_offsets(path: str) -> dict[str, list[int]]:
    """Pass one over a JSONL file: where each trace's annotation lines start (offsets only, so
    memory stays bounded whatever the arrays weigh)."""
    found: dict[str, list[int]] = {}
    offset = 0
    with open(path, "rb") as f:
        for raw in f:
            if raw.startswith(b'{"schema_version": 1, ' + _ANNOTATION_MARK) and raw.endswith(
                b"\n"
            ):
                start = raw.find(b'"trace_id": "')
                if start >= 0:
                    trace_id = raw[start + 13 : start + 45].decode("ascii", "replace")
                    found.setdefault(trace_id, []).append(offset)
            offset += len(raw)
    return found


def _merge_annotations(path: str, record: TrajectoryRecord, offsets: list[int]) -> None:
    with open(path, "rb") as f:
        for offset in offsets:
            f.seek(offset)
            try:
                ann = AnnotationRecord.from_dict(json.loads(f.readline()))
            except (ValueError, TypeError):
                continue
            if ann.trace_id == record.trace_id:
                apply_to_record(record, ann)


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
        check_store(uri)  # now, not at the first page: before any output is opened
        return iter_mlflow(uri, experiment, selection, page_size)
    if source == "jsonl":
        if not path:
            raise ValueError("--path FILE is required with --from jsonl (the tracer's "
                             "jsonl_path, e.g. --path traces/rollout-tracer/default.jsonl)")
        if not os.path.isfile(path):
            what = "is a folder" if os.path.isdir(path) else "does not exist"
            raise StoreNotFound(f"--path {path} {what}: --from jsonl reads the JSONL file the "
                                "tracer wrote (its jsonl_path; default "
                                "./traces/<project_name>/<experiment_name>.jsonl)")
        return iter_jsonl(path, selection, experiment, page_size)
    if source == "weave":
        if not experiment:
            raise ValueError("--experiment (the Weave project, the tracer's project_name) is "
                             "required with --from weave")  # fmt: skip
        return iter_weave(experiment, entity, selection, page_size)
    if source == "verl-dump":
        if not path:
            raise ValueError("--path DIR (verl's trainer.rollout_data_dir) is required with "
                             "--from verl-dump")  # fmt: skip
        if not os.path.isdir(path):
            raise StoreNotFound(f"--path {path} is not a folder: --from verl-dump reads the "
                                "folder verl's trainer.rollout_data_dir names (<step>.jsonl "
                                "files)")  # fmt: skip
        return iter_verl_dump(path, selection, experiment, page_size)
    raise ValueError(f"unknown source {source!r}; valid: {', '.join(SOURCES)}")


def _default_tracking_uri() -> str:
    env = os.environ.get("MLFLOW_TRACKING_URI")
    return env or f"sqlite:///{os.path.abspath('mlflow.db')}"
