"""Token ids -> text inside a span (``token2text``): the ids a generate call was given and
returned are found in its snapshot (verl's fields, ours, vLLM's, one object deeper), decoded with
the trajectory's tokenizer (the Rust fast path when it can, :mod:`tracer.fast_decode`), and the
text and counts written into the span's attributes and outputs. Split from
:mod:`tracer.record_builder` where the data changes shape: ids in, text out.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import orjson

from tracer.fast_decode import fast_decoder
from tracer.jsonable import Limits, to_jsonable, truncation_marker
from tracer.snapshot import Json, ObjectSnapshot, Truncated, json_bytes, json_value

if TYPE_CHECKING:
    from tracer.trajectory import Span

_PROMPT_FIELDS = ("prompt_ids", "input_ids")
_RESPONSE_FIELDS = ("response_ids", "output_ids", "token_ids")


def find_field(value: Any, name: str) -> Any:
    """The field ``name`` of a snapshot (an object's or a dict's), as Python values; None
    when it has none."""
    if isinstance(value, ObjectSnapshot):
        value = value.fields
    if isinstance(value, dict):
        found = value.get(name)
        return json_value(found) if type(found) is Json else found
    return None


def _collect_ids(value: Any, names: tuple[str, ...]) -> tuple[str, Any] | None:
    """Find the first token-id field in a snapshot: top level or one object/dict deeper."""
    containers = [value]
    if isinstance(value, ObjectSnapshot):
        containers = [value.fields]
    elif isinstance(value, dict):
        containers = [value]
        for v in value.values():
            if isinstance(v, ObjectSnapshot):
                containers.append(v.fields)
            elif isinstance(v, dict):
                containers.append(v)
            elif type(v) is Json:
                data = json_bytes(v)
                if any(f'"{name}":'.encode() in data for name in names):
                    containers.append(orjson.loads(data))  # decoded only when a name shows
    for container in containers:
        if isinstance(container, dict):
            for name in names:
                ids = container.get(name)
                if ids is not None:
                    return name, ids
    return None


def response_count(outputs: Any, attrs: dict[str, Any]) -> int | None:
    """How many tokens a generate call returned: token2text's count (``response_tokens`` in
    its attributes), else the length of the ids in its outputs (None when it returned none)."""
    n = attrs.get("response_tokens")
    if isinstance(n, int):
        return n
    hit = _collect_ids(outputs, _RESPONSE_FIELDS)
    if hit is None:
        return None
    try:
        return as_id_list(hit[1])[1]
    except (TypeError, ValueError):
        return None


def as_id_list(ids: Any) -> tuple[list[Any], int]:
    original = None
    if type(ids) is Json:
        ids = json_value(ids)
    if isinstance(ids, Truncated):
        original, ids = ids.original_len, ids.items
    if type(ids).__module__ in ("numpy", "torch") and hasattr(ids, "tolist"):
        if hasattr(ids, "detach"):
            ids = ids.detach().to("cpu")
        ids = ids.tolist()
    ids = list(ids)
    if ids and isinstance(ids[0], list):  # a batch of one
        ids = [i for row in ids for i in row]
    return ids, original if original is not None else len(ids)


_INT_ONLY = frozenset({int})  # not bool: True is not a token id


def decode_ids(tokenizer: Any, raw_ids: Any) -> tuple[str, int]:
    """Decode token ids; ids outside the vocabulary become visible markers, never an error."""
    ids, original = as_id_list(raw_ids)
    try:
        vocab = len(tokenizer)
    except Exception:
        vocab = None
    if ids and set(map(type, ids)) == _INT_ONLY and min(ids) >= 0 and (
        vocab is None or max(ids) < vocab
    ):  # every id valid, checked at C speed (the loop below costs ~0.1 µs per id)
        text = _decode(tokenizer, ids)
        if original > len(ids):
            text += truncation_marker(original, len(ids), "token ids")
        return text, original
    parts: list[str] = []
    run: list[int] = []
    for i in ids:
        valid = (
            isinstance(i, int)
            and not isinstance(i, bool)
            and i >= 0
            and (vocab is None or i < vocab)
        )
        if valid:
            run.append(i)
            continue
        if run:
            parts.append(_decode(tokenizer, run))
            run = []
        parts.append(f"<invalid token id {i!r}>")
    if run:
        parts.append(_decode(tokenizer, run))
    text = "".join(parts)
    if original > len(ids):
        text += truncation_marker(original, len(ids), "token ids")
    return text, original


def _decode(tokenizer: Any, ids: list[int]) -> str:
    """``decode(ids, skip_special_tokens=False)`` (special tokens are part of what the model
    saw), or ``decode(ids)`` for a tokenizer whose ``decode`` has no such argument."""
    fast = fast_decoder(tokenizer, ids)  # the same text, without transformers' per-id Python
    if fast is not None:
        return fast(ids)
    try:
        return str(tokenizer.decode(ids, skip_special_tokens=False))
    except TypeError:
        if _takes_skip_special_tokens(tokenizer.decode):
            raise  # a TypeError from inside decode itself
        return str(tokenizer.decode(ids))


def _takes_skip_special_tokens(decode: Any) -> bool:
    try:
        params = inspect.signature(decode).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == "skip_special_tokens" or p.kind is p.VAR_KEYWORD for p in params)


def verl_token2text(
    span: Span, outputs: Any, attrs: dict[str, Any], tokenizer: Any, limits: Limits
) -> None:
    """As verl's tracer: the prompt (the output's ``prompt_ids``, else the input's) and the
    response (the output's ``response_ids``, else ``token_ids``) decoded into the span's
    outputs as ``prompt_text`` / ``response_text``; also kept as attributes (turns table)."""
    if tokenizer is None or not callable(getattr(tokenizer, "decode", None)):
        return  # verl skips ops whose object has no tokenizer
    inputs = span.inputs if isinstance(span.inputs, dict) else {}
    prompt = find_field(span.outputs, "prompt_ids")
    if prompt is None:
        prompt = inputs.get("prompt_ids")
    response = find_field(span.outputs, "response_ids")
    if response is None:
        response = find_field(span.outputs, "token_ids")
    for label, ids in (("prompt", prompt), ("response", response)):
        if ids is not None:
            _decode_into(label, ids, tokenizer, attrs, outputs, limits)


def token2text(
    span: Span, inputs: Any, outputs: Any, attrs: dict[str, Any], tokenizer: Any, limits: Limits
) -> None:
    found = [
        ("prompt", _collect_ids(span.inputs, (*_PROMPT_FIELDS, "token_ids")), inputs),
        ("response", _collect_ids(span.outputs, _RESPONSE_FIELDS), outputs),
    ]
    for label, hit, target in found:
        if hit is None:
            continue
        if tokenizer is None:
            attrs["token2text_error"] = "no tokenizer: call tracer.register_tokenizer(tok)"
            return
        _decode_into(label, hit[1], tokenizer, attrs, target, limits)
        name = getattr(tokenizer, "name_or_path", None)
        if isinstance(name, str) and name:
            # which tokenizer made the text: an export decodes the tokens table with it
            attrs["tokenizer"] = name


def _decode_into(label: str, ids: Any, tokenizer: Any, attrs: dict[str, Any], target: Any,
                 limits: Limits) -> None:  # fmt: skip
    """Decode ``ids`` into ``<label>_text`` / ``<label>_tokens`` attributes (and ``target``'s
    ``<label>_text`` when it is a dict); a tokenizer that raises leaves ``token2text_error``."""
    try:
        text, count = decode_ids(tokenizer, ids)
    except Exception as exc:
        attrs["token2text_error"] = f"{label}: tokenizer raised {type(exc).__name__}: {exc}"
        return
    text = to_jsonable(text, limits)
    attrs[f"{label}_text"] = text
    attrs[f"{label}_tokens"] = count
    if isinstance(target, dict):
        target[f"{label}_text"] = text
