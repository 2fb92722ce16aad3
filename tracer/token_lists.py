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


_NUMBER_TYPES = frozenset({int, float})  # not bool: a list of flags is not per-token numbers
_LEAVES = frozenset({str, int, float, bool, type(None)})  # nothing inside to summarize


def _is_number_list(value: Any) -> bool:
    # the item types collected at C speed (a generator over a 1,000-id list was ~15% of an
    # MLflow export)
    return (
        isinstance(value, list)
        and len(value) >= MIN_ITEMS
        and set(map(type, value)) <= _NUMBER_TYPES
    )


def summary(values: list[Any]) -> str:
    """``"412 items: [1, 2, 3, 4, 5, …, 8, 9, 10, 11, 12]"``."""

    def fmt(xs: list[Any]) -> str:
        return ", ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in xs)

    return f"{len(values)} items: [{fmt(values[:EDGE])}, …, {fmt(values[-EDGE:])}]"


def compact_lists(value: Any) -> tuple[Any, list[tuple[Path, list[Any]]]]:
    """A copy of ``value`` with long per-token lists summarized, and the ``(path, list)``
    pairs that were taken out. ``value`` itself is not changed."""
    taken: list[tuple[Path, list[Any]]] = []

    def walk(node: Any, path: Path) -> Any:
        if isinstance(node, dict):
            out = {}
            for key, child in node.items():
                if type(child) in _LEAVES:  # most values: no path to build, nothing to walk
                    out[key] = child
                elif _is_token_key(key) and _is_number_list(child):
                    taken.append(([*path, key], child))
                    out[key] = summary(child)
                else:
                    out[key] = walk(child, [*path, key])
            return out
        if isinstance(node, list):
            if set(map(type, node)) <= _LEAVES:  # no dict inside: nothing to take (C speed)
                return list(node)
            return [walk(child, [*path, i]) for i, child in enumerate(node)]
        return node

    return walk(value, []), taken


def encode_full_lists(inputs: list[tuple[Path, list[Any]]],
                      outputs: list[tuple[Path, list[Any]]]) -> str:  # fmt: skip
    """One JSON string (a single line in a UI's attribute view) holding both sides:
    ``json.dumps(..., separators=(",", ":"))``. Token ids (ints, ASCII keys) go through orjson,
    which writes them byte for byte the same at about twice the speed (the MLflow export
    writes ~2,000 ids a trajectory); floats, where the two spell numbers differently, and
    anything else through json."""
    value = {"inputs": inputs, "outputs": outputs}
    if _ints_only(inputs) and _ints_only(outputs):
        try:
            text = orjson.dumps(value)
        except orjson.JSONEncodeError:  # an int past 64 bits
            pass
        else:
            if text.isascii() and b"\\" not in text:  # no string json would escape otherwise
                return text.decode()
    return json.dumps(value, separators=(",", ":"))


def _ints_only(taken: list[tuple[Path, list[Any]]]) -> bool:
    return all(
        set(map(type, values)) == {int} and all(type(p) in (str, int) for p in path)
        for path, values in taken
    )


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
