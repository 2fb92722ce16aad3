"""``json.JSONEncoder.encode`` with its C encoder built once instead of on every call
(:func:`encode_function`).

``JSONEncoder.encode`` makes a new C encoder each time it is called (``iterencode``: a markers
dict, a closure, ``json.encoder.c_make_encoder``), about two thirds of the time a small value
takes. The MLflow writers encode ~55 values a trajectory with one encoder's options (span
attributes, then each span's content), so :func:`encode_function` makes the C encoder once, with
those options, and calls it.

It is the very function ``encode`` ends in, so the text is the same. It is made without the
markers dict (a dict shared by calls, or threads, would not be empty after a failed call):
what the markers catch, a container inside itself, raises RecursionError instead, and any
error is answered by calling ``encode`` itself, which raises its own error (or, for a value
only json's Python encoder can write, returns its text). Where the C encoder is missing or
does not write a probe as ``encode`` does, ``encode`` itself is the function.
"""

from __future__ import annotations

import json
import json.encoder
from collections.abc import Callable
from typing import Any

_PROBE = {"a": [1, 2.5, None, True, "é\n\"x\""], "b": {"c": -0.0}}


def encode_function(encoder: json.JSONEncoder) -> Callable[[Any], str]:
    """A function that returns ``encoder.encode(value)``: the same text, the same errors."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None or encoder.indent is not None:  # encode uses the Python encoder then
        return encoder.encode
    strings = (
        json.encoder.encode_basestring_ascii if encoder.ensure_ascii
        else json.encoder.encode_basestring
    )  # fmt: skip
    try:
        c_encode = make(None, encoder.default, strings, None, encoder.key_separator,
                        encoder.item_separator, encoder.sort_keys, encoder.skipkeys,
                        encoder.allow_nan)  # fmt: skip
        same = "".join(c_encode(_PROBE, 0)) == encoder.encode(_PROBE)
    except Exception:  # another Python's C encoder: not the one this was written for
        same = False
    if not same:
        return encoder.encode

    def encode(value: Any) -> str:
        try:
            return "".join(c_encode(value, 0))
        except Exception:
            return encoder.encode(value)

    return encode
