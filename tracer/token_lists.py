"""Long per-token lists (token ids, masks, log-probs) shown compactly in a trace UI.

A generate span's ``prompt_ids`` run to hundreds of numbers, which MLflow's UI prints one per
line above the decoded text. :func:`compact_lists` replaces each such list in a span's inputs
or outputs with a short string (count, first and last few values) and returns the full lists
apart, keyed by their path, so the writer can store them in one attribute
(:data:`FULL_LISTS_ATTRIBUTE`) and a reader can put them back with :func:`restore_lists`:
what the export reads is whole.

Neutral on purpose: the MLflow writer and the readers both use it, neither imports the other.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

FULL_LISTS_ATTRIBUTE = "rollout_tracer.full_lists"
MIN_ITEMS = 16  # shorter lists are shown as they are
EDGE = 5  # values shown at each end
_SUFFIXES = ("_ids", "token_ids", "_mask", "logprobs", "log_probs")

Path = list[Any]  # keys and list indices from the top of the inputs / outputs


def _is_token_key(key: Any) -> bool:
    return isinstance(key, str) and (key in ("ids", "mask") or key.endswith(_SUFFIXES))


_PATH_TYPES = frozenset({str, int})
_NUMBER_TYPES = frozenset({int, float})  # not bool: a list of flags is not per-token numbers
_LEAVES = frozenset({str, int, float, bool, type(None)})  # nothing inside to summarize


def _number_types(value: Any) -> set[type] | None:
    """The item types of a list of per-token numbers (ints and floats, at least
    :data:`MIN_ITEMS` of them), else None."""
    if not isinstance(value, list) or len(value) < MIN_ITEMS:
        return None
    # the item types collected at C speed (a generator over a 1,000-id list was ~15% of an
    # MLflow export), once: the summary and the full lists' encoder use them too
    types = set(map(type, value))
    return types if types <= _NUMBER_TYPES else None


def summary(values: list[Any]) -> str:
    """``"412 items: [1, 2, 3, 4, 5, …, 8, 9, 10, 11, 12]"``."""
    return _summary(values, ints=False)


def _summary(values: list[Any], *, ints: bool) -> str:
    if ints:  # known to be plain ints: a list's own str is their str()s joined by ", "
        return f"{len(values)} items: [{str(values[:EDGE])[1:-1]}, …, {str(values[-EDGE:])[1:-1]}]"

    def fmt(xs: list[Any]) -> str:
        return ", ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in xs)

    return f"{len(values)} items: [{fmt(values[:EDGE])}, …, {fmt(values[-EDGE:])}]"


def compact_lists(value: Any) -> tuple[Any, list[tuple[Path, list[Any]]]]:
    """``value`` with long per-token lists summarized (new containers on the way to each one,
    the rest shared), and the ``(path, list)`` pairs that were taken out. ``value`` itself is
    not changed."""
    compacted, taken, _ = _compact(value)
    return compacted, taken


def compact_view(inputs: Any, outputs: Any) -> tuple[Any, Any, str | None]:
    """:func:`compact_lists` of a span's inputs and outputs, and :func:`encode_full_lists` of
    the lists taken out of them (None when none was), each list's item types looked at once."""
    inputs, taken_in, ints_in = _compact(inputs)
    outputs, taken_out, ints_out = _compact(outputs)
    if not taken_in and not taken_out:
        return inputs, outputs, None
    return inputs, outputs, _encode(taken_in, taken_out, ints_only=ints_in and ints_out)


def _compact(value: Any) -> tuple[Any, list[tuple[Path, list[Any]]], bool]:
    """:func:`compact_lists`, and whether every list taken holds ints only, at a path of str
    and int keys (:func:`_ints_only`). A container with nothing taken inside is returned as it
    is (copy on write): most spans hold no token list, and their copies were thrown away."""
    taken: list[tuple[Path, list[Any]]] = []
    plain_ints: list[bool] = []  # per list taken: ints only, at a plain path
    return _walk(value, [], taken, plain_ints), taken, all(plain_ints)


def _walk(node: Any, path: Path, taken: list[tuple[Path, list[Any]]],
          plain_ints: list[bool]) -> Any:  # fmt: skip
    if isinstance(node, dict):
        out = None
        for key, child in node.items():
            if type(child) in _LEAVES:  # most values: no path to build, nothing to walk
                continue
            if _is_token_key(key) and (ints := _token_list(child)) is not None:
                taken.append((where := [*path, key], child))
                plain_ints.append(ints and _plain_path(where))
                new = _summary(child, ints=ints)
            else:
                new = _walk(child, [*path, key], taken, plain_ints)
                if new is child:
                    continue
            if out is None:
                out = dict(node)  # a plain dict, the keys in their order, as before
            out[key] = new
        if out is not None:
            return out
        return node if type(node) is dict else dict(node)
    if isinstance(node, list):
        if set(map(type, node)) <= _LEAVES:  # no dict inside: nothing to take (C speed)
            return node if type(node) is list else list(node)
        changed = None
        for i, child in enumerate(node):
            new = _walk(child, [*path, i], taken, plain_ints)
            if new is not child:
                if changed is None:
                    changed = list(node)
                changed[i] = new
        if changed is not None:
            return changed
        return node if type(node) is list else list(node)
    return node


_INT_LIST_BYTES = b"0123456789,-"  # orjson's text of a flat list of ints, less its brackets


def _token_list(value: Any) -> bool | None:
    """Whether ``value`` is a list of per-token numbers (:func:`_number_types`): True when
    they are all ints, False when some are floats, None when it is not one. A list of plain
    ints (the token ids, most of them) is told by orjson's text of it, ~4x faster than
    looking at each item's type: ints only write digits, commas and minus signs, while a
    float writes a point or an exponent, a flag or None letters, a nested list a bracket."""
    if not isinstance(value, list) or len(value) < MIN_ITEMS:
        return None
    if type(value) is list:
        try:
            text = orjson.dumps(value, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
        except TypeError:  # orjson.JSONEncodeError: past 64 bits, an int subclass, not JSON
            pass
        else:
            if not text[1:-1].translate(None, _INT_LIST_BYTES):
                return True
    types = _number_types(value)
    return None if types is None else types == {int}


def encode_full_lists(inputs: list[tuple[Path, list[Any]]],
                      outputs: list[tuple[Path, list[Any]]]) -> str:  # fmt: skip
    """One JSON string (a single line in a UI's attribute view) holding both sides:
    ``json.dumps(..., separators=(",", ":"))``. Token ids (ints, ASCII keys) go through orjson,
    which writes them byte for byte the same at about twice the speed (the MLflow export
    writes ~2,000 ids a trajectory); floats, where the two spell numbers differently, and
    anything else through json."""
    return _encode(inputs, outputs, ints_only=_ints_only(inputs) and _ints_only(outputs))


def _encode(inputs: list[tuple[Path, list[Any]]], outputs: list[tuple[Path, list[Any]]], *,
            ints_only: bool) -> str:  # fmt: skip
    value = {"inputs": inputs, "outputs": outputs}
    if ints_only:
        try:
            text = orjson.dumps(value)
        except orjson.JSONEncodeError:  # an int past 64 bits
            pass
        else:
            if text.isascii() and b"\\" not in text:  # no string json would escape otherwise
                return text.decode()
    return json.dumps(value, separators=(",", ":"))


def _ints_only(taken: list[tuple[Path, list[Any]]]) -> bool:
    return all(set(map(type, values)) == {int} and _plain_path(path) for path, values in taken)


def _plain_path(path: Path) -> bool:
    """Every key on ``path`` a plain str or int: orjson writes it as json does."""
    return set(map(type, path)) <= _PATH_TYPES  # in C, not all() over a generator


def restore_lists(inputs: Any, outputs: Any, encoded: Any) -> tuple[Any, Any]:
    """Put the lists of :func:`encode_full_lists` back into ``inputs`` / ``outputs``
    (in place where possible); a malformed value leaves them as they are."""
    try:
        saved = json.loads(encoded) if isinstance(encoded, str) else encoded
        sides = {"inputs": inputs, "outputs": outputs}
        for side in ("inputs", "outputs"):
            for path, values in saved.get(side) or []:
                node = sides[side]
                for key in path[:-1]:
                    node = node[key]
                node[path[-1]] = values
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        pass
    return inputs, outputs
