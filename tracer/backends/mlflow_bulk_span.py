"""One span in the shapes MLflow's SQL store gives it: its ids (16 hex digits in the column,
base64 in the content), its dict (``mlflow.entities.Span.to_dict()``), its ``type`` column.
Pure functions of the span record; :mod:`tracer.backends.mlflow_bulk_rows` puts them in rows.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from tracer.backends.otel_spans import encode_all_json

# the OpenTelemetry kind of every span this tracer writes (its spans are made with the SDK's
# default), as MLflow 3.18's ``Span.to_dict()`` names it
SPAN_KIND = "SPAN_KIND_INTERNAL"


class SpanDict:
    """What ``translate_span_when_storing`` reads of a span: ``to_dict()``."""

    __slots__ = ("d",)

    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d

    def to_dict(self) -> dict[str, Any]:
        return self.d


def span_dict(
    span: Any,
    trace_b64: str,
    span_b64: str,
    parent_b64: str | None,
    status: str,
    attrs: dict[str, Any],
) -> dict[str, Any]:
    """``mlflow.entities.Span(to_readable_spans(record)[i]).to_dict()``, built directly."""
    events = []
    if span.error is not None:
        events.append(
            {
                "name": "exception",
                "time_unix_nano": span.end_ns,
                "attributes": {
                    "exception.type": span.error.get("type", ""),
                    "exception.message": span.error.get("message", ""),
                    "exception.stacktrace": span.error.get("traceback", ""),
                },
            }
        )
    message = (span.error or {}).get("message", "") if status == "ERROR" else ""
    return {
        "trace_id": trace_b64,
        "span_id": span_b64,
        "parent_span_id": parent_b64,
        "name": span.name,
        "kind": SPAN_KIND,
        "start_time_unix_nano": span.start_ns,
        "end_time_unix_nano": span.end_ns,
        "events": events,
        "status": {"code": f"STATUS_CODE_{status}", "message": message or ""},
        "attributes": attrs,
        "links": [],
    }


def id_forms(hex_id: str) -> tuple[str, str]:
    """A span id as MLflow's column has it (16 lowercase hex digits) and as its content has
    it (base64 of the 8 bytes): by ``bytes.fromhex`` for 16 hex digits, the usual id (half
    the time of reading it as a number), else read as a number (a shorter id zero-padded)."""
    try:
        raw = bytes.fromhex(hex_id)
    except ValueError:  # not plain hex digits: int() decides (it reads "0x..." too)
        raw = b""
    if len(raw) == 8 and len(hex_id) == 16:
        return hex_id.lower(), base64.b64encode(raw).decode()
    value = int(hex_id, 16)
    return f"{value:016x}", b64(value, 8)


def b64(value: int, length: int) -> str:
    return base64.b64encode(value.to_bytes(length, "big")).decode()


def span_type(value: Any) -> Any:
    """The ``type`` column: the span type attribute's value read back from its JSON (a
    string, the usual case, is itself)."""
    if value is None or isinstance(value, str):
        return value
    return json_value(encode_all_json("", value))


def json_value(raw: Any) -> Any:
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return raw
