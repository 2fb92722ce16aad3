"""One record, one serialization: the JSON line the spool stores and byte-oriented backends
(JSONL) write as they are. orjson is the encoder: one C call per record (the standard
library's encoder was half of the background's time per trajectory). Plain data the hot path
already took as JSON (``tracer.snapshot.Json``, an ``orjson.Fragment``) goes into the line as
those very bytes, so the big payloads are encoded once, on the hot path, at C speed.

Records are already JSON-able when they get here (``tracer.jsonable`` rendered them within
their limits); ``str`` is a backstop for a value a user's attribute slipped past it.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from tracer.record import TrajectoryRecord
from tracer.snapshot import Json, json_value

# Not OPT_SERIALIZE_NUMPY: rendering already turned arrays into lists, and with it orjson
# imports numpy (~80 ms) the first time ``default`` is asked about a type
_OPTIONS = orjson.OPT_NON_STR_KEYS


def _decoded(x: Any) -> Any:
    return json_value(x) if type(x) is Json else str(x)


def encode(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON (non-finite floats become null, as JSON requires)."""
    try:
        # orjson's bytes keep part of the buffer they grew: lines that wait in memory are
        # copied to their exact size
        return memoryview(orjson.dumps(value, default=str, option=_OPTIONS)).tobytes()
    except TypeError:  # what orjson refuses and the standard library writes: ints past 64 bits
        return json.dumps(value, default=_decoded, ensure_ascii=False,
                          separators=(",", ":")).encode()  # fmt: skip


# orjson reads a dataclass through its ``__dict__``, which CPython then makes for the instance
# and keeps: 21 more objects a 20-span record for the garbage collector, held while the record
# waits for export (each object a trace leaves alive adds ~2 us a trace of full collections
# here). The line is made of short-lived dicts instead, written out (8 us a record less than
# ``attrgetter`` and ``zip``); tests/test_lean.py checks they hold every field, in order.
def _fields(r: TrajectoryRecord) -> dict[str, Any]:
    return {"trace_id": r.trace_id, "name": r.name, "project_name": r.project_name,
            "experiment_name": r.experiment_name, "step": r.step, "sample_index": r.sample_index,
            "rollout_n": r.rollout_n, "validate": r.validate, "worker_id": r.worker_id,
            "start_ns": r.start_ns, "end_ns": r.end_ns, "status": r.status, "reward": r.reward,
            "policy_version": r.policy_version, "attempt": r.attempt,
            "attributes": r.attributes,
            "spans": [{"span_id": s.span_id, "parent_id": s.parent_id, "name": s.name,
                       "kind": s.kind, "start_ns": s.start_ns, "end_ns": s.end_ns,
                       "status": s.status, "error": s.error, "inputs": s.inputs,
                       "outputs": s.outputs, "attributes": s.attributes} for s in r.spans],
            "schema_version": r.schema_version}  # fmt: skip


def encode_record(record: TrajectoryRecord) -> bytes:
    """The record's JSON line, without the newline: its fields in order, as ``to_dict`` would
    give them."""
    try:
        return memoryview(orjson.dumps(_fields(record), default=str, option=_OPTIONS)).tobytes()
    except TypeError:
        return encode(record.to_dict())


# A line's digits and minus signs as zeros: an integer orjson cannot hold (past 64 bits) is 20
# of them in a row, or a sign and 19
_NUMBER_CHARS = bytes.maketrans(b"0123456789-", b"0" * 11)
_LONG_NUMBER = b"0" * 20


def decode(line: bytes) -> Any:
    """What ``json.loads`` reads of ``line``, read by orjson where orjson reads the same (2-3x
    faster on a record's line). orjson refuses some of what json reads (NaN and Infinity, which
    the standard library's fallback in :func:`encode` writes, 1e400, a lone surrogate's
    escape): json reads those. It would read an integer past 64 bits as a float: a line with a
    run of 20 digits (or a sign and 19) goes to json whole, a false alarm (a long digit string)
    costing only json's speed."""
    if _LONG_NUMBER in line.translate(_NUMBER_CHARS):
        return json.loads(line)
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)


def decode_record(line: bytes) -> TrajectoryRecord:
    """The record a line holds (:func:`encode_record`'s inverse)."""
    return TrajectoryRecord.from_dict(decode(line))
