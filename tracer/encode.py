"""One record, one serialization: the JSON line the spool stores and byte-oriented backends
(JSONL) write as they are. orjson is the encoder: one C call per record (the standard
library's encoder was half of the background's time per trajectory).

Records are already JSON-able when they get here (``tracer.jsonable`` rendered them within
their limits); ``default=str`` is a backstop for a value a user's attribute slipped past it.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

from tracer.record import TrajectoryRecord

_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY


def encode(value: Any) -> bytes:
    """``value`` as compact UTF-8 JSON (non-finite floats become null, as JSON requires)."""
    try:
        # orjson's bytes keep the buffer it grew (about 8x the length, measured with
        # tracemalloc): lines that wait in memory are copied to their exact size
        return memoryview(orjson.dumps(value, default=str, option=_OPTIONS)).tobytes()
    except TypeError:  # what orjson refuses and the standard library writes: ints past 64 bits
        return json.dumps(value, default=str, ensure_ascii=False, separators=(",", ":")).encode()


def encode_record(record: TrajectoryRecord) -> bytes:
    """The record's JSON line, without the newline."""
    return encode(record.to_dict())
