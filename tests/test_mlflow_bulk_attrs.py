"""The bulk writer's shortcut past MLflow's attribute translation stores what MLflow's own
``translate_span_when_storing`` stores: every key it calls inert, with values of every shape,
checked against the installed MLflow (a version the bulk writer was tested with)."""

from __future__ import annotations

import datetime as dt
import itertools
import json
from typing import Any

import pytest

pytest.importorskip("mlflow")

from mlflow.tracing.otel.translation import translate_span_when_storing

from tracer.backends.mlflow_bulk_attrs import INERT_KEYS, INERT_PREFIXES, stored_attributes
from tracer.backends.mlflow_bulk_span import SpanDict
from tracer.backends.otel_spans import encode_all_json
from tracer.token_lists import encode_full_lists


class Shown:
    """An object JSON cannot hold: written as its str()."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


class Text(str):
    """A str of its own kind, whose str() says something else."""

    def __str__(self) -> str:
        return "not the text"


# strings that are JSON of every kind, almost JSON, or not JSON at all; and other values
STRINGS = ["", "stop", "5", "-1.5", "true", "null", "NaN", '"quoted"', '""', '"5"', "[1, 2]",
           " [1]", "\n{\"a\": 1}", '{"a": [1, NaN]}', "[1, Infinity]", "{bad", "[1,", '"\\ud800"',
           '"{\\"a\\": 1}"', "ünïcode \t tab\nline \\ end", "\x00\x1f\x7f\u2028",
           "[1e400]", "[12345678901234567890123]", "[-0.0, 1E2]"]  # fmt: skip
VALUES: list[Any] = [*STRINGS, 0, 7, -2.5, 1e-05, float("nan"), True, False, None, [], {},
                     [1, "a"], {"messages": [{"role": "user", "content": "hi"}]},
                     {"content": '{"a": 1}'}, Shown("plain"), Shown('{"a": 1}'), Shown('"x"'),
                     dt.date(2026, 12, 6), Text('a ünïcode "text"'), Text('{"a": 1}'),
                     # the full lists mlflow_view writes: JSON the writer does not read again
                     encode_full_lists([(["prompt_ids"], list(range(20)))], []),
                     encode_full_lists([(["logprobs"], [float("nan"), -0.5] * 8)],
                                       [([0, "token_ids"], [2**70] * 16)])]  # fmt: skip
KEYS = sorted(INERT_KEYS) + [f"{p}something" for p in INERT_PREFIXES]


def mlflow_stores(plain: dict[str, Any]) -> dict[str, Any]:
    """What MLflow's translation stores of these attributes (a span dict as the writer makes
    it; only the attributes matter)."""
    encoded = {k: encode_all_json(k, v) for k, v in plain.items()}
    span = {"name": "s", "events": [], "attributes": encoded}
    return dict(translate_span_when_storing(SpanDict(span))["attributes"])


def io(inputs: Any = None, outputs: Any = None) -> dict[str, Any]:
    return {"mlflow.spanInputs": inputs, "mlflow.spanOutputs": outputs}


@pytest.mark.parametrize("key", KEYS)
def test_an_inert_key_is_stored_as_mlflow_stores_it(key: str) -> None:
    checked = 0
    for value in VALUES:
        plain = {**io({"prompt": "p"}, "a reply"), key: value}
        ours = stored_attributes(plain)
        assert ours is not None, (key, value)  # the shortcut is taken...
        assert ours == mlflow_stores(plain), (key, value)  # ...and stores the same
        checked += 1
    assert checked == len(VALUES)


def test_inputs_and_outputs_of_every_shape() -> None:
    for inputs, outputs in itertools.product(VALUES, repeat=2):
        plain = {"mlflow.traceRequestId": "tr-1", "mlflow.spanType": "TOOL", **io(inputs, outputs)}
        ours = stored_attributes(plain)
        if ours is not None:
            assert ours == mlflow_stores(plain), (inputs, outputs)


@pytest.mark.parametrize(
    "plain",
    [
        io({"model": "qwen", "prompt": "p"}, "a"),  # MLflow adds the span's model
        io("p", {"model": "qwen"}),
        {"mlflow.spanOutputs": "a"},  # no inputs: MLflow looks for them in other conventions
        {**io("p", "a"), "mlflow.chat.tokenUsage": {"input_tokens": 3}},
        {**io("p", "a"), "gen_ai.usage.input_tokens": 3, "gen_ai.request.model": "qwen"},
        {**io("p", "a"), "openinference.span.kind": "LLM"},
        {**io("p", "a"), "user.id": "u"},
    ],
)
def test_attributes_mlflow_translates_go_through_its_translation(plain: dict[str, Any]) -> None:
    assert stored_attributes(plain) is None
    # and MLflow's translation indeed changes or may change them (the reason for the detour)
    assert set(plain) <= set(mlflow_stores(plain))


def test_a_string_holding_json_is_stored_as_the_string_it_is() -> None:
    """MLflow 3.17 stripped one layer of JSON from such a string (a reply that looked like
    JSON came back as an object, with the model it named); 3.18 keeps the string and reads no
    model out of it, and so does the shortcut."""
    for text in ('{"model": "qwen"}', '["a"]', '"quoted"', '{"a": 1}'):
        plain = io("p", text)
        ours = stored_attributes(plain)
        assert ours is not None and ours == mlflow_stores(plain), text
        assert ours["mlflow.spanOutputs"] == json.dumps(text)
    assert "mlflow.llm.model" not in mlflow_stores(io("p", '{"model": "qwen"}'))
    assert "mlflow.llm.model" in mlflow_stores(io("p", {"model": "qwen"}))


def test_a_spans_content_is_what_mlflows_encoder_writes() -> None:
    """ContentText puts the content JSON together from its fields: the same text as MLflow's
    TraceJSONEncoder on the span dict, for every attribute value above, odd names, times and
    ids, and (through the encoder itself) spans with events or values of other types."""
    from mlflow.tracing.utils import TraceJSONEncoder

    from tracer.backends.mlflow_bulk_attrs import PIECE_MEMO, ContentText

    encoder = TraceJSONEncoder(ensure_ascii=False)
    content = ContentText(encoder.encode)

    def span(attrs: Any, **fields: Any) -> dict[str, Any]:
        d = {"trace_id": "q83vEjRWeJA=", "span_id": "AAAAAAAAAAE=", "parent_span_id": None,
             "name": "generate", "kind": "SPAN_KIND_INTERNAL", "start_time_unix_nano": 1,
             "end_time_unix_nano": 2,
             "events": [], "status": {"code": "STATUS_CODE_OK", "message": ""},
             "attributes": attrs, "links": []}  # fmt: skip
        d.update(fields)
        return d

    spans = []
    for value in VALUES:
        attrs = stored_attributes({**io({"prompt": "p"}, value), "mlflow.spanType": "LLM"})
        assert attrs is not None
        spans.append(span(attrs))
    odd = "ü \"q\" \\ \x00\t\n\u2028 😀"
    spans += [
        span({}, name=odd, parent_span_id="AAAAAAAAAAI=", end_time_unix_nano=None),
        span({odd: odd}, status={"code": "STATUS_CODE_ERROR", "message": odd}),
        span({"k": "v"}, start_time_unix_nano=-(2**70), end_time_unix_nano=2**70),
        span({"k": "v"}, events=[{"name": "exception", "time_unix_nano": 3, "attributes": {}}]),
        span({"k": 5, "n": None}),  # not strings: the encoder writes them
        span({"k": "v"}, start_time_unix_nano=True),  # a flag: true, not 1
        span({"k": "v"}, end_time_unix_nano=2.5),
        span({"k": "v"}, name=5),
        span({"k": "v"}, kind=None),  # not the shape: the encoder writes it
        span({"k": "v"}, kind=odd),
        span({"k": Text("shown")}),  # a str subclass is written as the str it is
        span({"k": "x" * 65, "j": "y" * 64}),  # past the memo's length, and at it
    ]
    for d in spans:
        assert content(d) == encoder.encode(d), d
        assert content(d) == encoder.encode(d), d  # the pairs kept are the same text
    for i in range(PIECE_MEMO + 10):
        content(span({"i": str(i)}))
    assert 0 < len(content._pieces) <= PIECE_MEMO


def test_a_long_string_is_escaped_as_json_escapes_it() -> None:
    """orjson escapes every code point as json's encode_basestring does (a lone surrogate,
    which orjson refuses, goes to encode_basestring itself)."""
    from json.encoder import encode_basestring

    from tracer.backends.mlflow_bulk_attrs import _long_string

    points = [*range(0xD800), *range(0xE000, 0x10000), 0x1F600, 0x10FFFF]
    for start in range(0, len(points), 512):
        text = "".join(map(chr, points[start : start + 512]))
        assert _long_string(text) == encode_basestring(text)
    for odd in ("\ud800", "a\udfff" * 40, '{"a": "\\u00e9"}' * 9):
        assert _long_string(odd) == encode_basestring(odd)
