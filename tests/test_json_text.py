"""encode_function gives what the encoder's own ``encode`` gives: the same text, the same
errors."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest

from tracer.chat import dumps
from tracer.json_text import encode_function


@dataclasses.dataclass
class Point:
    x: int


class Odd:
    def __str__(self) -> str:
        return "odd \u2028 \"quoted\""


VALUES: list[Any] = [
    None, True, False, 0, -7, 2**64 + 1, -(2**80), 1.5, -0.0, 1e16, 1e-7, math.nan, math.inf,
    -math.inf, "", "plain", "ünïcödé 中文 😀", "\x00\x01\x1f\x7f \t\n\r\b\f \\ \" / \u2028",
    "\ud800 lone surrogate", [], {}, [1, [2, [3, {"a": None}]]], (1, 2),
    {"prompt_ids": list(range(300)), "turn": 0, "nested": {"k": [1.0, "x", None]}},
    {7: "int key", 2.5: "float key", True: "bool key", None: "none key"},
    {"set": {1}, "object": Odd(), "point": Point(3), "bytes": b"\xff"},
]  # fmt: skip


@pytest.mark.parametrize("options", [
    {"ensure_ascii": False, "default": str},
    {"ensure_ascii": True, "default": str},
    {"ensure_ascii": False, "default": str, "sort_keys": True, "separators": (",", ":")},
    {"skipkeys": True, "allow_nan": True},
])  # fmt: skip
def test_the_same_text_as_encode(options: dict[str, Any]) -> None:
    encoder = json.JSONEncoder(**options)
    encode = encode_function(encoder)
    for value in VALUES:
        try:
            want: Any = encoder.encode(value)
        except (TypeError, ValueError) as exc:
            want = (type(exc), str(exc))
        try:
            got: Any = encode(value)
        except (TypeError, ValueError) as exc:
            got = (type(exc), str(exc))
        assert got == want, value


def test_mlflows_encoder_and_dumps() -> None:
    from mlflow.tracing.utils import TraceJSONEncoder

    encoder = TraceJSONEncoder(ensure_ascii=False)
    encode = encode_function(encoder)
    for value in VALUES:
        assert encode(value) == encoder.encode(value)
        assert dumps(value) == json.dumps(value, ensure_ascii=False, default=str)


def test_a_cycle_and_a_refused_value_raise_what_encode_raises() -> None:
    encoder = json.JSONEncoder()
    encode = encode_function(encoder)
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(ValueError, match="Circular reference detected"):
        encode(loop)
    with pytest.raises(TypeError, match="not JSON serializable"):
        encode({"x": object()})
    with pytest.raises(ValueError, match="Out of range float"):
        encode_function(json.JSONEncoder(allow_nan=False))([math.nan])
    assert encode([loop[:0], {"after": "the errors"}]) == '[[], {"after": "the errors"}]'


def test_an_indenting_encoder_is_its_own_encode() -> None:
    encoder = json.JSONEncoder(indent=2)
    assert encode_function(encoder) == encoder.encode
