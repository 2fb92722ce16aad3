"""verl's rollout dumps as trajectory records: ``--from verl-dump --path DIR``.

With ``trainer.rollout_data_dir=DIR`` (or ``trainer.validation_data_dir``) verl's trainer
writes ``DIR/<global_step>.jsonl`` (``RayPPOTrainer._write_generations``), one JSON object per
sample: ``input`` and ``output`` (text decoded with ``skip_special_tokens``), ``gts`` (the
ground truth), ``score`` (the summed token-level score), ``step``, and every reward extra info
that has one value per sample (``acc``, ``request_id``, ...).

Each line becomes one trajectory (so runs made without any tracer get the same tables and
report): a root span with the input and the ground truth, one ``generate`` span with the
prompt and response text, and one ``reward`` span with the score and the extra infos. What a
dump does not hold stays empty: token ids and counts, timings (every span starts and ends at
the file's modification time), tool calls, ``rollout_n``. ``sample_index`` is the line's
position in its file. ``validate`` is False unless the caller says otherwise: verl writes
validation dumps in the same format, to their own folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tracer.readers.selection import PAGE_SIZE, Selection, paged
from tracer.record import SpanRecord, TrajectoryRecord

# verl's own keys of a dump line; every other key is a reward extra info
_BASE_KEYS = ("input", "output", "gts", "score", "step")
WORKER_ID = "verl-dump"

log = logging.getLogger("tracer")


def dump_files(path: str | os.PathLike[str]) -> list[Path]:
    """The dump's ``<step>.jsonl`` files in step order (``path`` may also be one file)."""
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise FileNotFoundError(f"no verl dump at {path}: neither a folder nor a file")
    files = sorted(p.glob("*.jsonl"), key=lambda f: (not f.stem.isdigit(), _step_key(f), f.name))
    if not files:
        raise FileNotFoundError(f"no <step>.jsonl files in {path} (verl's rollout_data_dir)")
    return files


def _step_key(f: Path) -> int:
    return int(f.stem) if f.stem.isdigit() else 0


def iter_verl_dump(
    path: str | os.PathLike[str],
    selection: Selection | None = None,
    experiment: str | None = None,
    page_size: int = PAGE_SIZE,
    validate: bool = False,
) -> Iterator[list[TrajectoryRecord]]:
    """Pages of records from verl's dump folder ``path``. ``experiment`` names the records'
    project (default: the folder's name). A partial last line (verl stopped mid-write) is
    skipped with a warning; any other line that is not a JSON object raises ``ValueError``."""
    keep = (selection or Selection()).keeps
    project = experiment or Path(path).resolve().name
    yield from paged((r for r in _records(path, project, validate) if keep(r)), page_size)


def _records(path: str | os.PathLike[str], project: str, validate: bool
             ) -> Iterator[TrajectoryRecord]:  # fmt: skip
    for file in dump_files(path):
        mtime_ns = file.stat().st_mtime_ns
        for index, data in _lines(file):
            if data.get("step") is None and file.stem.isdigit():
                data = {**data, "step": int(file.stem)}
            yield dump_record(data, index, project, mtime_ns, validate, file.name)


def _lines(file: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    index = 0
    with open(file, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                data = json.loads(raw)
            except ValueError as exc:
                if not raw.endswith(b"\n"):
                    log.warning("rollout-tracer: %s ends with a partial line; skipped", file)
                    return
                raise ValueError(f"{file}:{lineno}: not a verl dump line ({exc})") from exc
            if not isinstance(data, dict):
                raise ValueError(f"{file}:{lineno}: not a verl dump line (not a JSON object)")
            yield index, data
            index += 1


def dump_record(
    data: dict[str, Any],
    index: int,
    project: str,
    time_ns: int,
    validate: bool = False,
    file_name: str = "",
) -> TrajectoryRecord:
    """One dump line as a trajectory record (its trace id is a hash of the line's content and
    position, so reading the same dump twice gives the same ids)."""
    step = _int(data.get("step"))
    score = _number(data.get("score"))
    extra = {k: v for k, v in data.items() if k not in _BASE_KEYS}
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps([file_name, index, data], sort_keys=True, default=str).encode())
    trace_id = digest.hexdigest()
    root = SpanRecord(
        span_id=trace_id[:16], parent_id=None, name="verl_dump", kind="trajectory",
        start_ns=time_ns, end_ns=time_ns,
        inputs={"input": data.get("input"), "gts": data.get("gts")},
        outputs={"output": data.get("output"), "score": score},
    )  # fmt: skip
    generate = SpanRecord(
        span_id=trace_id[16:], parent_id=root.span_id, name="generate", kind="generate",
        start_ns=time_ns, end_ns=time_ns,
        attributes={"prompt_text": data.get("input"), "response_text": data.get("output")},
    )  # fmt: skip
    reward = SpanRecord(
        span_id=_span_id(trace_id, "reward"), parent_id=root.span_id, name="reward",
        kind="reward", start_ns=time_ns, end_ns=time_ns,
        inputs={"gts": data.get("gts")}, outputs={"score": score, **extra},
        attributes={} if score is None else {"reward": score},
    )  # fmt: skip
    return TrajectoryRecord(
        trace_id=trace_id, name="verl_dump", project_name=project, experiment_name=project,
        step=step, sample_index=index, rollout_n=None, validate=validate, worker_id=WORKER_ID,
        start_ns=time_ns, end_ns=time_ns, reward=score,
        attributes={"source": "verl-dump", "dump_file": file_name},
        spans=[root, generate, reward],
    )  # fmt: skip


def _span_id(trace_id: str, label: str) -> str:
    return hashlib.blake2b(f"{trace_id}:{label}".encode(), digest_size=8).hexdigest()


def _int(value: Any) -> int | None:
    try:
        return None if value is None or isinstance(value, bool) else int(value)
    except (TypeError, ValueError):
        return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)
