"""Turn snapshots into JSON-able values, bounded, with visible markers. Runs off the hot path.

Every value becomes something ``json.dumps`` accepts. Nothing raises: a value that cannot be
rendered becomes a marker string that says why, and anything cut says its original size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

from tracer.snapshot import Json, ObjectSnapshot, Truncated

MAX_DEPTH = 24

_JSON_INTS = frozenset({int, bool, type(None)})
_JSON_NUMBERS = frozenset({int, bool, float})


class Limits:
    __slots__ = ("max_chars", "max_items", "type_keys")

    def __init__(self, max_chars: int, max_items: int, type_keys: bool = True) -> None:
        self.max_chars = max_chars
        self.max_items = max_items
        # objects (dataclasses, pydantic models) rendered with a "__type__" key naming their
        # class; off for verl-style trajectories (verl writes a model as its model_dump())
        self.type_keys = type_keys


def truncation_marker(original: int, kept: int, unit: str) -> str:
    return f"...[truncated by rollout-tracer: original {original} {unit}, kept {kept}]"


def safe_repr(x: Any, limits: Limits) -> str:
    try:
        text = repr(x)
    except Exception as exc:
        return f"<unrepresentable {type(x).__qualname__}: repr raised {type(exc).__name__}>"
    return _cut_str(text, limits)


def _cut_str(s: str, limits: Limits) -> str:
    if len(s) > limits.max_chars:
        s = s[: limits.max_chars] + truncation_marker(len(s), limits.max_chars, "chars")
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates (bytes decoded with surrogateescape)
            s = s.encode("utf-8", "replace").decode("utf-8") + " [invalid UTF-8 replaced]"
    return s


def render_snapshot(x: Any, limits: Limits) -> Any:
    """``to_jsonable(x, limits)`` for a span's inputs or outputs, with the hot path's shapes
    taken as they are (a snapshot is the span's private copy): a :data:`Json` (the hot path
    made it only where no limit applies: ``tracer.snapshot.as_json``), and a dict of such, of
    strings within ``max_chars``, of ints, booleans, finite floats and None, and of flat dicts
    of those (tool arguments), under string keys."""
    t = type(x)
    if t is Json:
        return x
    if t is dict and _as_is(x, limits, True):
        return x
    return to_jsonable(x, limits)


def _as_is(x: dict[Any, Any], limits: Limits, top: bool) -> bool:
    """Whether rendering leaves the dict ``x`` as it is (see ``render_snapshot``)."""
    if len(x) > limits.max_items:
        return False
    max_chars = limits.max_chars
    for k, v in x.items():
        if type(k) is not str:
            return False
        tv = type(v)
        if tv is str:
            if len(v) > max_chars or (not v.isascii() and _cut_str(v, limits) is not v):
                return False
        elif tv is Json:
            if not top:
                return False
        elif tv is dict:
            if not (top and _as_is(v, limits, False)):
                return False
        elif not (tv is int or tv is bool or v is None or (tv is float and math.isfinite(v))):
            return False
    return True


def to_jsonable(x: Any, limits: Limits, _depth: int = 0, _path: set[int] | None = None) -> Any:
    """Render ``x`` (usually a snapshot) as JSON-able data within ``limits``."""
    t = type(x)
    if t is str:
        return _cut_str(x, limits)
    if t is bool or t is int or x is None:
        return x
    if t is float:
        return x if math.isfinite(x) else str(x)
    if t is Json:  # made only where no limit applies (tracer.snapshot.as_json)
        return x
    if _depth > MAX_DEPTH:
        return f"<max depth {MAX_DEPTH} reached: {type(x).__qualname__}>"
    if _path is None:
        _path = set()
    if id(x) in _path:
        return f"<cycle: {type(x).__qualname__}>"
    d = _depth + 1
    try:
        if t in (list, tuple, frozenset, set):
            items = list(x)
            if t in (set, frozenset):
                with contextlib.suppress(TypeError):
                    items = sorted(items)
            _path.add(id(x))
            try:
                return _render_list(items, len(items), limits, d, _path)
            finally:
                _path.discard(id(x))
        if t is dict:
            _path.add(id(x))
            try:
                return _render_dict(x, len(x), limits, d, _path)
            finally:
                _path.discard(id(x))
        if t is Truncated:
            inner = x.items
            if _is_array(inner):
                inner = inner.tolist()
            if isinstance(inner, dict):
                return _render_dict(inner, x.original_len, limits, d, _path)
            return _render_list(list(inner), x.original_len, limits, d, _path)
        if t is ObjectSnapshot:
            if not x.fields and x.obj is not None:
                return safe_repr(x.obj, limits)
            out = to_jsonable(x.fields, limits, _depth, _path)
            if isinstance(out, dict) and limits.type_keys and x.type_name not in ("dict",):
                out = {"__type__": x.type_name, **out}
            return out
        if t is bytes or t is bytearray:
            text = bytes(x[: limits.max_chars]).decode("utf-8", errors="replace")
            marker = f"<bytes: {len(x)} bytes" + (
                ", truncated>" if len(x) > limits.max_chars else ">"
            )
            return f"{marker} {text}"
        if t is complex:
            return str(x)
        return _render_object(x, limits, _depth, _path)
    except Exception as exc:  # never let one bad value break the record
        return f"<unserializable {t.__qualname__}: {type(exc).__name__}: {exc}>"


def _render_list(
    items: list[Any], original: int, limits: Limits, d: int, path: set[int]
) -> list[Any]:
    keep = items[: limits.max_items]
    types = set(map(type, keep))  # at C speed: token ids and log-probs skip the per-item walk
    if types <= _JSON_INTS:
        out = keep  # a slice: already a copy
    elif types <= _JSON_NUMBERS and math.isfinite(sum(keep)):  # a NaN or inf makes it non-finite
        out = keep
    else:
        out = [to_jsonable(v, limits, d, path) for v in keep]
    if original > len(keep):
        out.append(truncation_marker(original, len(keep), "items"))
    return out


def _render_dict(
    x: dict[Any, Any], original: int, limits: Limits, d: int, path: set[int]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    max_chars = limits.max_chars
    for i, (k, v) in enumerate(x.items()):
        if i >= limits.max_items:
            break
        key = k if isinstance(k, str) else safe_repr(k, limits)
        tv = type(v)
        # most values are taken as they are: short ASCII strings, ints, bools, None
        if (tv is str and len(v) <= max_chars and v.isascii()) or tv in _JSON_INTS:
            out[key] = v
        else:
            out[key] = to_jsonable(v, limits, d, path)
    if original > len(out):
        out["__truncated__"] = truncation_marker(original, len(out), "keys")
    return out


def _is_array(x: Any) -> bool:
    return type(x).__module__ in ("numpy", "torch") and hasattr(x, "tolist")


def _render_object(x: Any, limits: Limits, depth: int, path: set[int]) -> Any:
    module = type(x).__module__
    if module == "numpy":
        if getattr(x, "ndim", 0) == 0 or not hasattr(x, "shape"):
            return to_jsonable(x.item(), limits, depth, path)
        return to_jsonable(x.tolist(), limits, depth, path)
    if module == "torch" and hasattr(x, "detach"):
        t = x.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")  # the worker pays the device sync, never the rollout
        if t.ndim == 0:
            return to_jsonable(t.item(), limits, depth, path)
        return to_jsonable(t.tolist(), limits, depth, path)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        fields = {f.name: getattr(x, f.name, None) for f in dataclasses.fields(x)}
        rendered = to_jsonable(fields, limits, depth, path)
        return {"__type__": type(x).__qualname__, **rendered} if limits.type_keys else rendered
    dump = getattr(x, "model_dump", None)
    if callable(dump) and not isinstance(x, type):
        return to_jsonable(dump(), limits, depth, path)
    if hasattr(x, "item") and callable(x.item) and module.startswith(("numpy", "jax")):
        return to_jsonable(x.item(), limits, depth, path)
    return safe_repr(x, limits)
