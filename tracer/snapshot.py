"""Hot-path snapshots of arguments and results.

Agent loops mutate their message lists and token lists in place after a call returns, so a
span must hold a copy of what it saw. Plain JSON data (messages, token ids, tool arguments) is
taken as JSON: one orjson call encodes it (:class:`Json`), several times faster than a
Python-level copy, into one buffer that the garbage collector never walks and that holds its
exact size; the record's line is later made of these very bytes (``tracer.encode``). A dict's
top level stays a dict, so the background reads ``finish_reason`` or a reward without
decoding. Everything else is copied structurally and bounded: containers are copied (lists,
dicts, tuples, sets, numpy arrays, CPU tensors), immutable scalars are shared, other objects
are kept by reference and rendered later by the background worker. Nothing here decodes or
does I/O.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from itertools import accumulate
from typing import Any

import orjson

# Names the token2text stage looks for; read off arbitrary objects as plain attributes too.
TOKEN_FIELDS = ("prompt_ids", "response_ids", "token_ids", "input_ids", "output_ids")

_SCALARS = frozenset({int, float, str, bool, type(None), bytes, complex})
_MAX_DEPTH = 12
# how deeply a snapshot's containers can nest: the arguments' dict, then _MAX_DEPTH levels
MAX_NESTING = _MAX_DEPTH + 1
_FLAT_LIST_MIN = 2  # lists of numbers (token ids) are copied at C speed, items not visited
_NUMBERS = frozenset({int, float, bool})
_BY_REFERENCE_BYTES = 64  # charged for an object kept by reference that cannot say its size


# A snapshot taken as JSON: orjson's own ``Fragment``, which orjson writes into a line as the
# bytes it holds, and which the garbage collector does not track (so neither is a dict of
# strings and fragments: a span's arguments cost the collector nothing while they wait).
# ``json_bytes``/``json_value`` read it back.
Json = orjson.Fragment

# orjson hands these to ``default`` instead of encoding them itself; with no ``default`` given it
# then raises, and the value takes the structural copy (a dataclass gets its type key there)
_PLAIN_ONLY = (orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
               | orjson.OPT_PASSTHROUGH_SUBCLASS)  # fmt: skip
# Strings longer than this in all, in a list or in a list's dicts (a long context), are copied
# (shared) rather than encoded: orjson encodes ~2 GB/s here, so a JSON snapshot costs the hot
# path at most ~0.1 ms of encoding; longer contexts take the structural copy as before
_MAX_ENCODED_CHARS = 1 << 18
_JSON_OVERHEAD = 64  # a Fragment and its bytes object, besides the data
_find_null = re.compile(rb"null").search
_OPENS = b"[{"
# +1 for an opening bracket, -1 for a closing one (by byte value); the rest are removed first
_STEP = [1 if b in _OPENS else -1 for b in range(256)]
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_bytes(x: Json) -> bytes:
    """The JSON a :data:`Json` holds."""
    return orjson.dumps(x)


def json_value(x: Json) -> Any:
    """The data a :data:`Json` holds, as Python values (a fresh copy on every call)."""
    return orjson.loads(orjson.dumps(x))


def plain(value: Any) -> Any:
    """A snapshot's value as plain data: its JSON fragments decoded, dicts walked."""
    if isinstance(value, Json):
        return json_value(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def json_depth(data: bytes) -> int:
    """How deeply the containers of compact JSON ``data`` nest, strings skipped; at C speed."""
    if b'"' in data:  # drop escaped backslashes and quotes, then every string's contents
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
        data = b"".join(data.split(b'"')[0::2])
    brackets = data.translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def as_json(
    x: list[Any] | tuple[Any, ...] | dict[Any, Any], max_items: int, max_chars: int
) -> tuple[Json, int] | None:
    """``x`` encoded as :data:`Json`, with the bytes it holds; or None where the structural
    copy must take it: not plain JSON data (an object, a set, bytes, a key that is not a
    string, an int past 64 bits, invalid UTF-8, a cycle), holding a None or a float that is
    not finite (both would read as ``null``, and a NaN must stay visible), a list of long
    strings or of messages holding long strings (the copy shares them), or data that
    rendering would cut: a string past ``max_chars``, a list or dict past ``max_items`` (both
    proven absent from the bytes: the background then takes them as they are). Nesting is
    bounded by orjson (254 levels; the structural copy stops at 12, rendering's walk at 24).
    Encoding runs at C speed under the GIL, so no other thread changes ``x`` meanwhile."""
    if len(x) > max_items:
        return None
    checked = True  # whether the lengths of the top two levels are known to be in bounds
    if type(x) is dict:
        for v in x.values():
            tv = type(v)
            if (tv is list or tv is dict or tv is tuple) and len(v) > max_items:
                return None
    elif x:
        t0 = type(x[0])
        if t0 is dict or t0 is list or t0 is tuple:  # messages: each one bounded
            chars = 0  # in the messages' own strings: a long context is copied, not encoded
            for v in x:
                tv = type(v)
                if tv is dict:
                    if len(v) > max_items:
                        return None
                    for s in v.values():
                        if type(s) is str:
                            chars += len(s)
                elif (tv is list or tv is tuple) and len(v) > max_items:
                    return None
            if chars > _MAX_ENCODED_CHARS:
                return None
        else:
            checked = False
            if t0 is str:
                try:
                    if sum(map(len, x)) > _MAX_ENCODED_CHARS:
                        return None
                except TypeError:  # not all sized: orjson decides
                    pass
    try:
        data = orjson.dumps(x, option=_PLAIN_ONLY)
    except TypeError:  # orjson.JSONEncodeError
        return None
    # a null shows as one after ":", "," or "["; an "l" first, found at memchr speed, spares
    # the search in a list of numbers (``re`` finds a literal twice as fast as ``in`` here)
    if b"l" in data and _find_null(data) is not None and (
        b":null" in data or b",null" in data or b"[null" in data
    ):
        return None
    n = len(data)
    if n > max_chars and b'"' in data:  # no string in it is longer than the whole
        return None
    if n > 2 * max_items:  # each item takes two bytes at least: shorter, none is too long
        brackets = data.count(b"[") + data.count(b"{")  # strings' brackets count too: a bound
        # only the top level, or the top two levels checked above
        if not (brackets == 1 or (checked and (brackets == 2 or json_depth(data) <= 2))):
            return None
    # orjson's bytes keep the buffer they grew (4 KiB at least): the snapshot waits in
    # memory, so it holds an exact-size copy
    return Json(memoryview(data).tobytes()), n + _JSON_OVERHEAD


class ObjectSnapshot:
    """A copied view of an object that is not a plain container (dataclass, pydantic, ...)."""

    __slots__ = ("fields", "obj", "type_name")

    def __init__(self, type_name: str, fields: dict[str, Any], obj: Any = None) -> None:
        self.type_name = type_name
        self.fields = fields
        self.obj = obj  # the live object, only for a repr when ``fields`` is empty

    def __repr__(self) -> str:
        return f"ObjectSnapshot({self.type_name}, {self.fields!r})"


class Truncated:
    """Marks a container cut at snapshot time (a million-element list on the hot path)."""

    __slots__ = ("items", "original_len")

    def __init__(self, items: Any, original_len: int) -> None:
        self.items = items
        self.original_len = original_len


class _Budget:
    __slots__ = ("max_items", "nbytes", "nodes")

    def __init__(self, max_items: int) -> None:
        self.nodes = 50_000
        self.nbytes = 0
        self.max_items = max_items


def snapshot(value: Any, max_items: int = 20_000, max_chars: int = 200_000) -> tuple[Any, int]:
    """Return ``(copy, approximate_bytes)`` of ``value``; never raises. ``max_items`` and
    ``max_chars``: the limits rendering will apply (``TraceConfig.max_list_items`` and
    ``max_field_chars``)."""
    t = type(value)
    if t is str:  # the most common result (a tool's): shared, only counted
        return value, len(value)
    if t is dict:
        split = _split_dict(value, max_items, max_chars)
        if split is not None:
            return split
    elif t is list or t is tuple:
        encoded = as_json(value, max_items, max_chars)
        if encoded is not None:
            return encoded
    budget = _Budget(max_items)
    try:
        return _snap(value, budget, 0), budget.nbytes
    except Exception as exc:  # a hostile __getattr__, a dict changing size, ...
        return _unsnappable(value, exc), budget.nbytes


def snapshot_args(names: tuple[str, ...], values: tuple[Any, ...], kwargs: dict[str, Any],
                  max_items: int, max_chars: int = 200_000) -> tuple[dict[str, Any], int]:
    """Snapshot positional ``values`` under ``names``, then ``kwargs``; never raises.

    Strings and scalars are taken inline; lists and dicts of plain data as :data:`Json`;
    anything else takes the structural copy."""
    out: dict[str, Any] = {}
    nbytes = 0
    budget: _Budget | None = None
    for i, value in enumerate(values):  # names is at least as long (checked by the caller)
        name = names[i]
        t = type(value)
        if t is str:  # the most common argument: shared, only counted
            nbytes += len(value)
            out[name] = value
            continue
        if t is int or t is float or t is bool or value is None:
            nbytes += 8
            out[name] = value
            continue
        if t is dict and len(value) <= _FLAT_DICT_MAX:
            flat = _split_dict(value, max_items, max_chars, False)  # positional: cheaper
            if flat is not None:  # tool arguments: a shallow copy is cheaper than encoding
                out[name], size = flat
                nbytes += size
                continue
        if t is list or t is dict or t is tuple:
            encoded = as_json(value, max_items, max_chars)
            if encoded is not None:
                out[name], size = encoded
                nbytes += size
                continue
        if budget is None:
            budget = _Budget(max_items)
        out[name] = _snap_safe(value, budget)
    if kwargs:
        if budget is None:
            budget = _Budget(max_items)
        for name, value in kwargs.items():
            out[name] = _snap_safe(value, budget)
    return out, nbytes + (budget.nbytes if budget is not None else 0)


_FLAT_DICT_MAX = 32  # a dict this small of strings and numbers is copied, not encoded


def _split_dict(
    d: dict[Any, Any], max_items: int, max_chars: int, encode: bool = True
) -> tuple[dict[Any, Any], int] | None:
    """``(copy, bytes)`` of a dict whose values are strings, numbers or plain JSON data (the
    last as :data:`Json`; with ``encode`` False, a flat dict of strings and numbers only),
    else None. The top level is copied first (one C call, atomic under the GIL), then its
    values are checked, so another thread cannot slip a mutable value in between the check
    and the copy. Such a copy holds nothing the garbage collector tracks, and is not tracked
    itself."""
    if len(d) > max_items:
        return None
    try:
        copy = d.copy()
    except Exception:  # a dict subclass would not get here; belt and braces
        return None
    nbytes = 16 * len(copy) + 64
    replaced = False
    for k, v in copy.items():
        tv = type(v)
        if tv is str:
            nbytes += len(v)
        elif tv is int or tv is float or tv is bool or v is None:
            nbytes += 8
        elif encode and (tv is list or tv is dict or tv is tuple):
            encoded = as_json(v, max_items, max_chars)
            if encoded is None:
                return None
            copy[k] = encoded[0]  # the key exists: the dict does not change size
            nbytes += encoded[1]
            replaced = True
        else:
            return None
    if replaced:
        # a copy of a dict that held a list stays tracked by the garbage collector after the
        # list is replaced (CPython untracks dicts only in full collections): made again from
        # its final values it is not, and it no longer counts towards the next full collection
        copy = {k: v for k, v in copy.items()}
    return copy, nbytes


def _snap_safe(value: Any, budget: _Budget) -> Any:
    t = type(value)
    if t is str:  # the most common argument: shared, only counted
        budget.nbytes += len(value)
        return value
    try:
        return _snap(value, budget, 0)
    except Exception as exc:
        return _unsnappable(value, exc)


def _unsnappable(value: Any, exc: Exception) -> ObjectSnapshot:
    return ObjectSnapshot(
        f"{type(value).__module__}.{type(value).__qualname__}",
        {"__snapshot_error__": f"{type(exc).__name__}: {exc}"},
    )


def _snap(x: Any, b: _Budget, depth: int) -> Any:
    t = type(x)
    if t in _SCALARS:
        if t is str or t is bytes:
            b.nbytes += len(x)
        else:
            b.nbytes += 8
        return x
    b.nodes -= 1
    if depth >= _MAX_DEPTH:  # cycles and very deep nesting stop here, visibly
        return f"<{t.__qualname__} at depth {_MAX_DEPTH}: cyclic or too deeply nested, not copied>"
    if b.nodes <= 0:
        return f"<{t.__qualname__}: not copied, snapshot limit of 50000 objects per call reached>"
    if t is list or t is tuple:
        n = len(x)
        if n > b.max_items:
            return Truncated(_snap(x[: b.max_items], b, depth), n)
        b.nbytes += 8 * n + 56
        if n >= _FLAT_LIST_MIN and type(x[0]) in _NUMBERS and type(x[-1]) in _NUMBERS:
            # sum() proves at C speed that every item is a number: a str or bytes inside raises
            # (and is then counted by its length below); anything else that adds up to a
            # non-number (an array in the middle) also takes the per-item path
            try:
                total = sum(x)
            except Exception:
                total = None
            if type(total) in _NUMBERS:
                b.nbytes += 8 * n  # the numbers themselves, as the per-item path counts them
                return list(x)  # token ids: C-speed copy
        d = depth + 1
        # a tuple's copy is a list: JSON has no tuples, and rendering can then take a snapshot
        # of plain JSON data as it is (tracer.jsonable.render)
        return [_snap(v, b, d) for v in x]
    if t is dict:
        n = len(x)
        b.nbytes += 16 * n + 64
        d = depth + 1
        if n > b.max_items:
            keys = list(x)[: b.max_items]
            return Truncated({k: _snap(x[k], b, d) for k in keys}, n)
        out = {}
        for k, v in x.items():  # scalar values (tool arguments, messages) without a call
            tv = type(v)
            if tv is str:
                b.nbytes += len(v)
                out[k] = v
            elif tv in _SCALARS and tv is not bytes:
                b.nbytes += 8
                out[k] = v
            else:
                out[k] = _snap(v, b, d)
        return out
    if t is set or t is frozenset:  # items are hashable, so shared; strings still count
        b.nbytes += 16 * len(x) + sum(len(v) for v in x if type(v) is str or type(v) is bytes)
        return frozenset(x) if len(x) <= b.max_items else Truncated(list(x)[: b.max_items], len(x))
    return _snap_object(x, t, b, depth)


_ENVIRON_TYPE = type(os.environ)
ENVIRON_MARKER = "<environment variables: never captured by rollout-tracer>"


def _snap_object(x: Any, t: type, b: _Budget, depth: int) -> Any:
    if t is _ENVIRON_TYPE:
        return ENVIRON_MARKER
    module = t.__module__
    if module == "numpy":
        if hasattr(x, "copy") and hasattr(x, "shape"):
            b.nbytes += int(getattr(x, "nbytes", 0))
            return (
                x.copy()
                if x.ndim == 0 or x.size <= b.max_items
                else Truncated(x.ravel()[: b.max_items].copy(), int(x.size))
            )
        return x  # numpy scalar: immutable
    if module == "torch" and hasattr(x, "detach"):
        t_ = x.detach()
        b.nbytes += t_.numel() * t_.element_size()
        if t_.device.type == "cpu":
            return (
                t_.clone()
                if t_.numel() <= b.max_items
                else Truncated(t_.flatten()[: b.max_items].clone(), t_.numel())
            )
        return t_  # CUDA: no copy and no sync here; the worker moves it to the CPU
    d = depth + 1
    names = _DATACLASS_FIELDS.get(t)
    if names is None and dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = _dataclass_fields(t)
    if names is not None:
        fields = {name: _snap(getattr(x, name, None), b, d) for name in names}
        return ObjectSnapshot(t.__qualname__, fields)
    if hasattr(t, "model_fields") and hasattr(x, "__dict__"):  # pydantic v2 model
        return ObjectSnapshot(t.__qualname__, {k: _snap(v, b, d) for k, v in vars(x).items()})
    token_fields = {
        name: _snap(getattr(x, name), b, d) for name in TOKEN_FIELDS if hasattr(x, name)
    }
    if token_fields:
        b.nbytes += _shallow_size(x)
        return ObjectSnapshot(t.__qualname__, token_fields, x)
    if isinstance(x, tuple) and hasattr(x, "_asdict"):  # namedtuple
        return ObjectSnapshot(t.__qualname__, {k: _snap(v, b, d) for k, v in x._asdict().items()})
    if isinstance(x, dict):  # subclasses of containers
        return _snap(dict(x), b, depth)
    if isinstance(x, (list, tuple)):
        return _snap(list(x), b, depth)
    if isinstance(x, (set, frozenset)):
        return _snap(frozenset(x), b, depth)
    b.nbytes += _shallow_size(x)
    return x  # kept by reference, rendered by the worker


# A dataclass type's field names, found once: ``dataclasses.fields`` builds a new tuple on
# every call, and an agent loop's output holds one dataclass per turn.
_DATACLASS_FIELDS: dict[type, tuple[str, ...]] = {}
_MAX_DATACLASS_TYPES = 1024  # types made on the fly (make_dataclass in a loop) stay bounded


def _dataclass_fields(t: type) -> tuple[str, ...]:
    names = tuple(f.name for f in dataclasses.fields(t))
    if len(_DATACLASS_FIELDS) >= _MAX_DATACLASS_TYPES:
        _DATACLASS_FIELDS.clear()
    _DATACLASS_FIELDS[t] = names
    return names


def _shallow_size(x: Any) -> int:
    """What an object kept by reference holds by itself; its contents are not walked here."""
    try:
        return max(int(sys.getsizeof(x)), _BY_REFERENCE_BYTES)
    except Exception:  # a __sizeof__ that raises or returns nonsense
        return _BY_REFERENCE_BYTES
