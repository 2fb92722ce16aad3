"""One record, one serialization: the JSON line the spool stores and byte-oriented backends
(JSONL) write as they are. orjson is the encoder: one C call per record (the standard
library's encoder was half of the background's time per trajectory). The JSON that rendering
made of span inputs and outputs to prove them plain (``tracer.jsonable.render_encoded``) goes
into the line as it is (``orjson.Fragment``), so the big payloads are encoded once.

Records are already JSON-able when they get here (``tracer.jsonable`` rendered them within
their limits); ``default=str`` is a backstop for a value a user's attribute slipped past it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
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


def encode_record(
    record: TrajectoryRecord, encoded: Mapping[int, tuple[Any, bytes]] | None = None
) -> bytes:
    """The record's JSON line, without the newline. ``encoded``: JSON already made of span
    inputs and outputs (``tracer.record_builder.build_record``), written as it is where the
    span still holds that very value."""
    if not encoded:
        return encode(record.to_dict())
    out = vars(record).copy()
    spans = []
    for span in record.spans:
        fields = vars(span).copy()
        for key in ("inputs", "outputs"):
            # the map holds each value it has JSON of, so an id found is that very value's
            made = encoded.get(id(fields[key]))
            if made is not None:
                fields[key] = orjson.Fragment(made[1])
        spans.append(fields)
    out["spans"] = spans
    try:
        return memoryview(orjson.dumps(out, default=str, option=_OPTIONS)).tobytes()
    except TypeError:  # an int past 64 bits: the standard library writes it (no fragments)
        return encode(record.to_dict())
