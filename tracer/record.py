"""The finished, serializable form of a trajectory, as every backend receives it.

The hot path builds cheap, raw snapshots (see ``tracer.ops``); the background pipeline turns
each finished trajectory into one :class:`TrajectoryRecord` (token2text decoded, payloads
truncated with a marker, secrets redacted, every value JSON-able). Backends only ever see these.

Schema version 2 (2 added ``attempt``); changes to these fields bump :data:`SCHEMA_VERSION`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tracer.snapshot import Json, json_value

SCHEMA_VERSION = 2

# kind -> MLflow span type; also the set of kinds the tracer knows about.
KINDS: dict[str, str] = {
    "trajectory": "AGENT",
    "generate": "CHAT_MODEL",
    "parse": "PARSER",
    "tool": "TOOL",
    "reward": "EVALUATOR",
    "interaction": "EVALUATOR",  # an environment judging a turn (verl's multi-turn interaction)
    "retrieve": "RETRIEVER",
    "other": "UNKNOWN",
}

# Trajectory attribute naming the API that opened a trajectory when it is not the native one:
# "verl" (tracer.verl_compat.rollout_trace_attr) or "verl-op" (a verl op called outside any
# trajectory: the op is the root span). Verl-style trajectories are written as verl writes
# them: the ``validate`` tag is 'True'/'False', token2text text goes into the outputs.
STYLE_KEY = "rollout_tracer.style"


# Why a trajectory ended (the ``end_reason`` tag and column): ``completed``, or how it was cut.
END_REASONS = ("completed", "cancelled", "timeout", "error")
_TIMEOUTS = ("TimeoutError", "ReadTimeout", "ConnectTimeout", "TimeoutExpired")
_ABORTED = ("abort", "aborted")  # vLLM's finish reason and verl's stop reason of an aborted request


def end_reason_of(error_type: str | None, error: BaseException | None = None) -> str:
    """``completed`` (no error), ``cancelled`` (asyncio's ``CancelledError``, ``KeyboardInterrupt``
    and other ``BaseException``s that are not errors), ``timeout`` (``TimeoutError``, which
    ``asyncio.wait_for`` and ``concurrent.futures`` raise, and the like) or ``error``. By the
    exception itself where there is one, else by its type's name (a stored record's error)."""
    if error is not None:
        if isinstance(error, TimeoutError) or type(error).__name__ in _TIMEOUTS:
            return "timeout"
        if not isinstance(error, Exception):  # CancelledError is a BaseException since 3.8
            return "cancelled"
        return "cancelled" if type(error).__name__ == "CancelledError" else "error"
    if error_type is None:
        return "completed"
    if error_type in _TIMEOUTS:
        return "timeout"
    if error_type in ("CancelledError", "KeyboardInterrupt", "GeneratorExit", "SystemExit"):
        return "cancelled"
    return "error"


def is_aborted(finish_reason: Any) -> bool:
    """Whether an engine's finish (vLLM) or stop (verl) reason says the request was aborted."""
    return isinstance(finish_reason, str) and finish_reason.lower() in _ABORTED


def is_verl_style(attributes: dict[str, Any]) -> bool:
    return str(attributes.get(STYLE_KEY, "")).startswith("verl")


def plain(x: Any) -> Any:
    """``x`` with every :data:`~tracer.snapshot.Json` in it decoded (they sit as a span's
    whole inputs or outputs or as values of its dicts, never inside a list): ``x`` itself
    when it holds none, else a copy of each dict on the way to one."""
    t = type(x)
    if t is Json:
        return json_value(x)
    if t is not dict:
        return x
    out = None
    for k, v in x.items():
        tv = type(v)
        if tv is Json or tv is dict:
            done = plain(v)
            if done is not v:
                if out is None:
                    out = dict(x)
                out[k] = done
    return x if out is None else out


@dataclass
class SpanRecord:
    """One operation inside a trajectory. ``inputs``/``outputs``/``attributes`` are JSON-able;
    inputs and outputs may hold :data:`~tracer.snapshot.Json` (the hot path's encoding of
    plain data) until the record is materialized. The record builder passes the fields by
    position (keywords cost 3.5x more): reordering them means changing it too."""

    span_id: str  # 16 hex chars, unique within the trace
    parent_id: str | None  # None only for the root span
    name: str
    kind: str  # one of KINDS
    start_ns: int  # wall clock, ns since the epoch
    end_ns: int
    status: str = "OK"  # "OK" | "ERROR"
    error: dict[str, Any] | None = None  # {"type", "message", "traceback"}
    inputs: Any = None
    outputs: Any = None
    # Derived values: prompt_text / response_text (token2text), prompt_tokens,
    # response_tokens, reward, tool name, finish_reason, truncation markers, ...
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrajectoryRecord:
    """One rollout of one sample: the root span plus all its descendants. The record builder
    passes the fields by position: reordering them means changing it too."""

    trace_id: str  # 32 hex chars, unique; backends use it to stay idempotent
    name: str
    project_name: str
    experiment_name: str
    step: int | None
    sample_index: Any
    rollout_n: Any
    validate: bool
    worker_id: str
    start_ns: int
    end_ns: int
    status: str = "OK"
    reward: float | None = None  # the last numeric reward recorded in the trajectory
    policy_version: Any = None
    # 0, 1, ...: the how-many-th run of this identity (a retried sample is a new trajectory)
    attempt: int = 0
    attributes: dict[str, Any] = field(default_factory=dict)  # extra user attributes
    spans: list[SpanRecord] = field(default_factory=list)  # spans[0] is the root
    schema_version: int = SCHEMA_VERSION

    @property
    def root(self) -> SpanRecord:
        return self.spans[0]

    def tags(self) -> dict[str, str]:
        """String tags every backend attaches to the trace (filterable in MLflow)."""
        tags = {
            "step": "" if self.step is None else str(self.step),
            "sample_index": "" if self.sample_index is None else str(self.sample_index),
            "rollout_n": "" if self.rollout_n is None else str(self.rollout_n),
            "validate": (
                str(bool(self.validate))  # verl: str(validate)
                if is_verl_style(self.attributes)
                else str(bool(self.validate)).lower()
            ),
            "experiment_name": self.experiment_name,
            "worker_id": self.worker_id,
            "attempt": str(self.attempt),
        }
        if self.policy_version is not None:
            tags["policy_version"] = str(self.policy_version)
        for key, value in self.attributes.items():
            tags.setdefault(str(key), str(value))
        return tags

    def materialize(self) -> TrajectoryRecord:
        """Decode, in place, the JSON the hot path took of span inputs and outputs, for
        backends and rules that read them as Python values; returns the record. Idempotent
        (a decoded record is left as it is), and safe from two threads at once (each assigns
        the same values)."""
        for span in self.spans:
            span.inputs = plain(span.inputs)
            span.outputs = plain(span.outputs)
        return self

    def to_dict(self) -> dict[str, Any]:
        """A shallow, JSON-able dict (the values already are JSON-able: no deep copy, which
        made ``dataclasses.asdict`` three quarters of the background processing time)."""
        out = dict(vars(self))
        out["spans"] = [dict(vars(span)) for span in self.spans]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrajectoryRecord:
        data = dict(data)
        # a version-1 line (no attempt) reads as attempt 0 and is written back as this version
        data.pop("schema_version", None)
        spans = [
            SpanRecord(*s.values()) if tuple(s) == _SPAN_FIELDS else SpanRecord(**s)
            for s in data.pop("spans", [])
        ]
        return cls(**data, spans=spans)


# A span's fields in order: a line's span has its keys in this order (the encoder writes the
# dataclass's fields as they come), so it is built by position, ~40 % cheaper than by keyword
_SPAN_FIELDS = tuple(f.name for f in dataclasses.fields(SpanRecord))

_IOV_LINES = 512  # lines per writev call: each is two buffers, and Linux takes 1024 at most


def write_lines(fd: int, lines: Sequence[bytes], prefix: bytes = b"") -> int:
    """Write ``prefix``, then each line and a newline, to the file descriptor ``fd``; returns
    the bytes written. ``os.writev`` hands the lines to the kernel as they are: a batch is
    megabytes, and a joined copy of it would cost a fresh memory mapping and a page fault per
    4 KiB, twice per batch (spool and JSONL)."""
    buffers = [prefix] if prefix else []
    for line in lines:
        buffers += (line, b"\n")
    if not hasattr(os, "writev"):  # not POSIX: one joined copy
        buffers = [b"".join(buffers)]
    total = 0
    step = 2 * _IOV_LINES
    for i in range(0, len(buffers), step):
        chunk = buffers[i : i + step]
        want = sum(map(len, chunk))
        done = os.writev(fd, chunk) if len(chunk) > 1 else os.write(fd, chunk[0])
        if done < want:  # a short write (a signal, a full pipe): the rest the plain way
            view = memoryview(b"".join(chunk))[done:]
            while view:
                view = view[os.write(fd, view) :]
        total += want
    return total


def read_jsonl(
    path: str | os.PathLike[str],
    *,
    strict: bool = False,
    skipped: collections.Counter[str] | None = None,
) -> Iterator[TrajectoryRecord]:
    """Yield every trajectory of a JSON-lines file (the ``jsonl`` backend's files and the spool's
    batch files), in file order, streaming, each once.

    A partial last line (a writer interrupted mid-line) is skipped with a warning, and so is a
    fragment a crashed writer left before later appends (``strict=True`` raises
    ``ValueError`` naming the line instead). A line that repeats a trajectory already read
    (same ``trace_id`` and ``start_ns``: an append that was retried after a failure) is
    skipped, with one warning per file that gives the count. ``skipped`` (a Counter), when
    given, counts what was skipped by reason: ``partial_last_line``, ``not_a_record``,
    ``duplicate``. A line from a newer schema version than this tracer knows always raises
    rather than being misread.

    Example::

        for record in read_jsonl("traces/gsm8k/grpo.jsonl"):
            print(record.step, record.sample_index, record.reward)
    """
    log = logging.getLogger("tracer")
    counts = skipped if skipped is not None else collections.Counter()
    # one entry per trajectory: what a reader keeps per row anyway, far less than the row
    seen: set[tuple[str, int | str]] = set()
    duplicates = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):  # the text after the last newline
                if raw.strip():
                    counts["partial_last_line"] += 1
                    log.warning("rollout-tracer: %s ends with a partial line; skipped", path)
                break
            if not raw.strip():
                continue
            try:
                data = json.loads(raw)
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
            except ValueError as exc:
                if strict:
                    raise ValueError(
                        f"{path}:{lineno}: not a JSON trajectory record: {exc}"
                    ) from exc
                counts["not_a_record"] += 1
                log.warning(
                    "rollout-tracer: %s:%d is not a whole record (%s); skipped", path, lineno, exc
                )
                continue
            if data.get("record_type") == "annotation":  # merged by tracer.readers.sources
                continue
            version = data.get("schema_version", 1)
            if not isinstance(version, int) or version > SCHEMA_VERSION:
                raise ValueError(
                    f"{path}:{lineno}: schema_version {version!r} is newer than this tracer's "
                    f"({SCHEMA_VERSION}); upgrade rollout-tracer to read it"
                )
            start = data.get("start_ns")
            key = (str(data.get("trace_id")), start if isinstance(start, int) else repr(start))
            if key in seen:
                duplicates += 1
                continue
            seen.add(key)
            yield TrajectoryRecord.from_dict(data)
    if duplicates:
        counts["duplicate"] += duplicates
        log.warning("rollout-tracer: %s repeats %d trajectories (an append retried after a "
                    "failed write); each is read once", path, duplicates)  # fmt: skip
