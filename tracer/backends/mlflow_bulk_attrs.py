"""What MLflow stores of a span's attributes, without running its translators on every span.

MLflow 3.17's ``translate_span_when_storing`` runs, per span, a dozen OpenTelemetry-convention
translators (OpenInference, GenAI, Traceloop, ...) over the attributes: each looks for keys of
its own convention (span kind, token counts, model, message format, tool definitions) and adds
MLflow's attribute when it finds one; before that, ``sanitize_attributes`` strips one layer of
JSON from a value encoded twice. On the attributes this tracer writes it finds nothing to add,
but it costs ~50 us a span, about half of the bulk writer's CPU.

So a span whose attribute keys are all in :data:`INERT_KEYS` (or start with one of
:data:`INERT_PREFIXES`), keys no translator of the tested MLflow reads, gets only the
sanitizing, done here with the same rule; any other span (a user's ``gen_ai.*`` or
``mlflow.chat.tokenUsage`` attribute, a ``"model"`` in its inputs or outputs, which MLflow
turns into the span's model) goes through MLflow's own translation. The bulk writer runs only
on MLflow versions it was tested with; tests/test_mlflow_bulk_attrs.py checks, on that
version, every inert key against MLflow's translation, with values of every shape.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any

import orjson

from tracer.backends.otel_spans import encode_all_json
from tracer.json_text import JsonText

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
_JSON_SPACE = " \t\n\r"  # what json.loads skips before a value
_OPENERS = ('"', "[", "{")


def stored_attributes(plain: dict[str, Any]) -> dict[str, str] | None:
    """What ``translate_span_when_storing`` stores of the span attributes ``plain`` (Python
    values, each to be written as ``encode_all_json`` writes it), or None when MLflow's
    translation must run."""
    for key in plain:
        if key not in INERT_KEYS and not key.startswith(INERT_PREFIXES):
            return None
    out = {key: stored_value(value) for key, value in plain.items()}
    for key in _IO_KEYS:
        value = out.get(key)
        # MLflow fills the span's model from a "model" in its inputs or outputs (and looks
        # for inputs and outputs elsewhere when either is missing): its translation decides
        if value is None or '"model"' in value:
            return None
    return out


def stored_value(value: Any) -> str:
    """One attribute as MLflow stores it: its JSON (``encode_all_json``), after
    ``sanitize_attributes``, which keeps a string that is itself JSON of a string, a list or
    an object as that JSON (one layer of encoding, not two)."""
    if isinstance(value, str):
        # JSON of a number, true, false or null cannot start with these: MLflow keeps its
        # encoding, and most strings are decided without parsing them (and JSON the tracer
        # wrote, a span's full token lists, without parsing it again)
        if value.lstrip(_JSON_SPACE)[:1] in _OPENERS and (
            type(value) is JsonText or _is_json(value)
        ):
            return value
        # encode_all_json's encoder writes a str with this one C function (ensure_ascii off)
        return encode_basestring(value)
    encoded = encode_all_json("", value)
    # an object JSON cannot hold is written as its str() (``default=str``): a JSON string
    return _sanitized(encoded) if encoded[:1] == '"' else encoded


def _is_json(text: str) -> bool:
    """Whether ``json.loads`` (the parser MLflow uses) reads ``text``. orjson first: it reads
    strict JSON only, a subset of what ``json.loads`` reads, ~4x faster (a generate span's
    full token lists are kilobytes); what it refuses (NaN, a lone surrogate) goes to
    ``json.loads``."""
    try:
        orjson.loads(text)
    except orjson.JSONDecodeError:
        try:
            json.loads(text)
        except ValueError:  # json.JSONDecodeError: not JSON
            return False
    return True


def _sanitized(encoded: str) -> str:
    """``sanitize_attributes`` on one JSON text that starts with a quote."""
    try:
        inner = json.loads(encoded)
        if isinstance(inner, str) and isinstance(json.loads(inner), (str, dict, list)):
            return inner
    except ValueError:  # json.JSONDecodeError
        pass
    return encoded
