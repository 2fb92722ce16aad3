"""What MLflow stores of a span's attributes, without running its translators on every span.

MLflow 3.18's ``translate_span_when_storing`` runs, per span, a dozen OpenTelemetry-convention
translators (OpenInference, GenAI, Traceloop, ...) over the attributes: each looks for keys of
its own convention (span kind, token counts, model, message format, tool definitions) and adds
MLflow's attribute when it finds one. On the attributes this tracer writes it finds nothing to
add, but it costs ~50 us a span, about half of the bulk writer's CPU.

So a span whose attribute keys are all in :data:`INERT_KEYS` (or start with one of
:data:`INERT_PREFIXES`), keys no translator of the tested MLflow reads, stores each value as
written (its JSON, ``encode_all_json``); any other span (a user's ``gen_ai.*`` or
``mlflow.chat.tokenUsage`` attribute, a ``"model"`` in its inputs or outputs, which MLflow
turns into the span's model) goes through MLflow's own translation. The bulk writer runs only
on MLflow versions it was tested with; tests/test_mlflow_bulk_attrs.py checks, on that
version, every inert key against MLflow's translation, with values of every shape. (MLflow
3.17 also stripped one layer of JSON from a string value that was itself JSON, so a reply
that looked like JSON came back as an object; 3.18 stores it as the string it was.)
"""

from __future__ import annotations

from json.encoder import encode_basestring
from typing import Any

import orjson

from tracer.backends.mlflow_bulk_span import SPAN_KIND, span_dict
from tracer.chat import dumps

# Keys this tracer writes (tracer/backends/otel_spans.py, tracer/record_builder.py,
# tracer/token_text.py, tracer/keep.py, mlflow_view) that none of MLflow's translators reads.
INERT_KEYS = frozenset(
    {
        "mlflow.traceRequestId",
        "mlflow.spanType",
        "mlflow.spanInputs",
        "mlflow.spanOutputs",
        "mlflow.chat.messages",
        "session.id",
        "reward",
        "finish_reason",
        "tool_name",
        "end_reason",
        "response_tokens",
        "prompt_tokens",
        "prompt_text",
        "response_text",
        "tokenizer",
        "token2text_error",
        "logprob_min",
        "logprob_mean",
        "unfinished",
        "cut",
        "kept_by",
    }
)
INERT_PREFIXES = ("rollout_tracer.", "mlflow.traceTag.")
_IO_KEYS = ("mlflow.spanInputs", "mlflow.spanOutputs")


def stored_attributes(
    plain: dict[str, Any], pieces: list[str] | None = None
) -> dict[str, str] | None:
    """What ``translate_span_when_storing`` stores of the span attributes ``plain`` (Python
    values, each to be written as ``encode_all_json`` writes it), or None when MLflow's
    translation must run. ``pieces``, when given, gets each attribute's ``"key": "value"`` in
    the span's content JSON (:class:`ContentText`), made in the same pass."""
    if not plain.keys() <= _INERT_SEEN:  # one comparison of sets, in C
        others = plain.keys() - _INERT_SEEN
        for key in others:
            if key not in INERT_KEYS and not key.startswith(INERT_PREFIXES):
                return None
        if len(_INERT_SEEN) > PIECE_MEMO:
            _INERT_SEEN.clear()
            _INERT_SEEN.update(INERT_KEYS)
        _INERT_SEEN.update(others)
    out = {}
    for key, value in plain.items():
        if type(value) is str and len(value) <= _SHORT:  # kinds, types, names: they repeat
            try:
                stored, piece = _STORED[key, value]
            except KeyError:
                stored = stored_value(value)
                piece = content_piece(key, stored)
                _STORED[key, value] = stored, piece
                if len(_STORED) > PIECE_MEMO:
                    _STORED.clear()
        else:
            stored = stored_value(value)
            piece = None
        out[key] = stored
        if pieces is not None:
            pieces.append(piece or content_piece(key, stored))
    for key in _IO_KEYS:
        value = out.get(key)
        # MLflow fills the span's model from a "model" in its inputs or outputs (and looks
        # for inputs and outputs elsewhere when either is missing): its translation decides
        if value is None or '"model"' in value:
            return None
    return out


# INERT_KEYS and the keys found inert by their prefix (``rollout_tracer.kind``)
_INERT_SEEN: set[str] = set(INERT_KEYS)
# short strings' stored forms and content pieces, by key and string (pure functions of them:
# threads may share this; a race costs one more call)
_STORED: dict[tuple[str, str], tuple[str, str]] = {}


def stored_value(value: Any) -> str:
    """One attribute as MLflow stores it: its JSON, as ``encode_all_json`` writes it."""
    if isinstance(value, str):
        # encode_all_json's encoder writes a str with this one C function (ensure_ascii off);
        # a long one (a span's full token lists) by orjson, the same text faster
        return _long_string(value) if len(value) > _SHORT else encode_basestring(value)
    return dumps(value)  # what encode_all_json returns, without its call


def _long_string(value: str) -> str:
    """``encode_basestring(value)`` for a long string (a span's inputs, outputs or full lists as
    JSON: kilobytes of quotes to escape) by orjson, ~9x faster on them: it escapes the same
    characters the same way (tests/test_mlflow_bulk_attrs.py checks every code point); a lone
    surrogate, which orjson refuses, goes to ``encode_basestring``."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # orjson.JSONEncodeError
        return encode_basestring(value)


def content_piece(key: str, stored: str) -> str:
    """One attribute's ``"key": "value"`` in the content JSON, as the encoder writes it."""
    text = _long_string(stored) if len(stored) > _SHORT else encode_basestring(stored)
    return f"{encode_basestring(key)}: {text}"


def _text(trace_b64: str, span_b64: str, parent: str | None, name: str, kind: str, start: int,
          end: int | None, code: str, message: str, pieces: list[str]) -> str:  # fmt: skip
    q = encode_basestring
    return "".join((
        '{"trace_id": ', q(trace_b64), ', "span_id": ', q(span_b64),
        ', "parent_span_id": ', "null" if parent is None else q(parent),
        ', "name": ', q(name), ', "kind": ', q(kind), ', "start_time_unix_nano": ', str(start),
        ', "end_time_unix_nano": ', "null" if end is None else str(end),
        ', "events": [], "status": {"code": ', q(code), ', "message": ', q(message),
        '}, "attributes": {', ", ".join(pieces), '}, "links": []}',
    ))  # fmt: skip


PIECE_MEMO = 4096  # short attribute pairs whose JSON is kept (content_text)
_SHORT = 64  # an attribute value this long or shorter is worth keeping (kinds, types, names)


class ContentText:
    """A span's content JSON as MLflow's encoder writes it (``TraceJSONEncoder``,
    ``ensure_ascii=False``, its ``", "`` and ``": "`` separators), put together from its
    fields for a span dict of the plain shape ``span_dict`` makes (no events, string
    attributes, integer times): each string is escaped by the very C function the encoder
    escapes strings with, and the short attribute pairs that repeat from span to span (the
    span's type and kind, a finish reason, a tool's name) are escaped once and kept. Anything
    else goes to ``encode``, the encoder itself. The bulk writer hands it the pairs
    :func:`stored_attributes` made and the span record itself (:meth:`of_span`)."""

    def __init__(self, encode: Any) -> None:
        self.encode = encode
        self._pieces: dict[tuple[str, str], str] = {}

    def __call__(self, d: dict[str, Any], pieces: list[str] | None = None) -> str:
        """``pieces``: the attributes' pairs (``stored_attributes`` makes them), else made here."""
        name, start, end, parent = (d["name"], d["start_time_unix_nano"],
                                    d["end_time_unix_nano"], d["parent_span_id"])  # fmt: skip
        kind = d.get("kind")
        if (d["events"] or type(name) is not str or type(kind) is not str
                or type(start) is not int
                or (end is not None and type(end) is not int)
                or (parent is not None and type(parent) is not str)):  # fmt: skip
            return self.encode(d)  # type: ignore[no-any-return]
        if pieces is None:
            pieces = self._attributes(d["attributes"])
        if pieces is None:
            return self.encode(d)  # type: ignore[no-any-return]
        status = d["status"]
        return _text(d["trace_id"], d["span_id"], parent, name, kind, start, end,
                     status["code"], status["message"], pieces)  # fmt: skip

    def of_span(self, span: Any, trace_b64: str, span_b64: str, parent_b64: str | None,
                status: str, attrs: dict[str, str], pieces: list[str]) -> str:  # fmt: skip
        """The content of ``span_dict(span, trace_b64, ...)`` (``pieces``: its attributes'
        pairs), the fields put in the text without making the dict first where they are of
        the plain shape (no error event: its status message is empty too)."""
        name, start, end = span.name, span.start_ns, span.end_ns
        if (span.error is not None or type(name) is not str or type(start) is not int
                or (end is not None and type(end) is not int)):  # fmt: skip
            return self(span_dict(span, trace_b64, span_b64, parent_b64, status, attrs), pieces)
        return _text(trace_b64, span_b64, parent_b64, name, SPAN_KIND, start, end,
                     f"STATUS_CODE_{status}", "", pieces)  # fmt: skip

    def _attributes(self, attrs: dict[str, Any]) -> list[str] | None:
        memo = self._pieces
        out = []
        for key, value in attrs.items():
            if type(key) is not str or not isinstance(value, str):
                return None
            if len(value) > _SHORT:
                out.append(f"{encode_basestring(key)}: {_long_string(value)}")
                continue
            try:
                out.append(memo[key, value])
            except KeyError:
                piece = memo[key, value] = f"{encode_basestring(key)}: {encode_basestring(value)}"
                out.append(piece)
                if len(memo) > PIECE_MEMO:
                    memo.clear()
        return out
