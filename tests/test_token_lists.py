"""Long per-token lists are shown compactly and come back whole."""

from __future__ import annotations

import copy
from collections import OrderedDict, UserList
from typing import Any

from tracer.token_lists import (
    MIN_ITEMS,
    compact_lists,
    compact_view,
    encode_full_lists,
    restore_lists,
    summary,
)


def test_compact_and_restore_round_trip() -> None:
    inputs = {"prompt_ids": list(range(400)), "messages": [{"role": "user", "content": "x"}],
              "short_ids": [1, 2, 3], "flags": [True] * 40}  # fmt: skip
    outputs = {"response_ids": list(range(50)), "logprobs": [-0.5] * 30,
               "turns": [{"token_ids": list(range(20)), "text": "t"}], "count": 7}  # fmt: skip
    before = copy.deepcopy((inputs, outputs))
    shown_in, taken_in = compact_lists(inputs)
    shown_out, taken_out = compact_lists(outputs)
    assert (inputs, outputs) == before  # the originals are untouched
    assert shown_in["prompt_ids"] == "400 items: [0, 1, 2, 3, 4, …, 395, 396, 397, 398, 399]"
    assert shown_in["short_ids"] == [1, 2, 3] and shown_in["flags"] == [True] * 40
    assert shown_out["logprobs"] == "30 items: [-0.5, -0.5, -0.5, -0.5, -0.5, …, -0.5, -0.5, " \
                                    "-0.5, -0.5, -0.5]"
    assert shown_out["turns"][0]["token_ids"].startswith("20 items: [0, 1")
    encoded = encode_full_lists(taken_in, taken_out)
    assert "\n" not in encoded
    assert restore_lists(shown_in, shown_out, encoded) == before


def test_restore_ignores_a_malformed_attribute() -> None:
    assert restore_lists({"a": 1}, None, "not json") == ({"a": 1}, None)
    assert restore_lists({"a": 1}, None, '{"inputs": [[["x", "y"], [1]]]}') == ({"a": 1}, None)


def test_full_lists_are_written_as_json_writes_them() -> None:
    """Whichever encoder writes them (orjson for token ids), the text is json.dumps's."""
    import json

    cases = [
        [(["prompt_ids"], list(range(300)))],
        [(["turns", 0, "token_ids"], [0, -1, 2**63 - 1, -(2**63)])],
        [(["ids"], [2**64, 1])],  # past orjson's 64 bits
        [(["logprobs"], [-0.5, 1e-05, 1e16, 0.1])],  # floats: spelled differently by orjson
        [(["ids"], [1, 2.0])],
        [(["prömpt_ids"], [1, 2])],  # json escapes non-ASCII
        [(['a"b\\c\n'], [1, 2])],
        [((1, True), [1, 2])],
        [],
    ]
    for taken in cases:
        for inputs, outputs in ((taken, []), ([], taken), (taken, taken)):
            expected = json.dumps({"inputs": inputs, "outputs": outputs}, separators=(",", ":"))
            assert encode_full_lists(inputs, outputs) == expected


def test_the_view_of_a_span_is_compact_lists_and_its_full_lists() -> None:
    """compact_view looks at each list's item types once; it gives what compact_lists and
    encode_full_lists give, whatever the lists hold and wherever they are."""
    sides = [
        None,
        "text",
        {"prompt_ids": list(range(300)), "turn": 0},
        {"response_ids": list(range(64)), "logprobs": [-0.5, 1e-05, 1e16] * 6},
        {"ids": [2**64, *range(20)]},  # past orjson's 64 bits
        {"prömpt_ids": list(range(20)), "mask": [1, 0] * 10},  # json escapes non-ASCII
        {'a"b\\c\n': {"token_ids": list(range(16))}},
        {"turns": [{"token_ids": list(range(20))}, {"token_ids": [1.5] * 16}]},
        {1: {"ids": list(range(16))}, None: {"ids": list(range(16))}, 1.5: {"ids": [3] * 16}},
        {"flags_ids": [True] * 20, "short_ids": [1, 2]},  # not numbers, too short
        [{"ids": list(range(17))}, "x", 3],
    ]
    for inputs in sides:
        for outputs in sides:
            shown_in, taken_in = compact_lists(inputs)
            shown_out, taken_out = compact_lists(outputs)
            full = encode_full_lists(taken_in, taken_out) if taken_in or taken_out else None
            assert compact_view(inputs, outputs) == (shown_in, shown_out, full)


def _reference(value: Any) -> tuple[Any, list[tuple[list[Any], list[Any]]]]:
    """compact_lists as its docstring says it, written plainly: every container copied, each
    list's items looked at one by one."""
    taken: list[tuple[list[Any], list[Any]]] = []

    def numbers(node: Any) -> bool:
        return (isinstance(node, list) and len(node) >= MIN_ITEMS
                and all(type(x) in (int, float) for x in node))  # fmt: skip

    def walk(node: Any, path: list[Any]) -> Any:
        if isinstance(node, dict):
            out = {}
            for key, child in node.items():
                token_key = isinstance(key, str) and (
                    key in ("ids", "mask") or key.endswith(("_ids", "token_ids", "_mask",
                                                            "logprobs", "log_probs")))  # fmt: skip
                if token_key and numbers(child):
                    taken.append(([*path, key], child))
                    out[key] = summary(child)
                else:
                    out[key] = walk(child, [*path, key])
            return out
        if isinstance(node, list):
            return [walk(child, [*path, i]) for i, child in enumerate(node)]
        return node

    return walk(value, []), taken


class _Flag(int):
    pass


def test_compact_lists_is_the_plain_walk_whatever_the_lists_hold() -> None:
    """The fast paths (orjson's text telling a list of ints, containers shared where nothing
    was taken) give what the plain walk gives, and leave the value as it was."""
    values = [
        {"prompt_ids": list(range(300)), "turn": 0, "text": "hi"},
        {"ids": [-(2**63), *range(15), 2**63 - 1]},
        {"ids": [2**64, *range(20)]},  # past orjson's 64 bits
        {"ids": [_Flag(1)] * 20},  # an int subclass: not a plain int
        {"ids": [True] * 20, "mask": [1, 0] * 10},  # flags are not numbers; a mask is
        {"ids": [[1, 2]] * 20},  # nested lists: not per-token numbers
        {"ids": [1] * 15 + [None]},
        {"ids": [1] * 15 + [1.0], "logprobs": [float("nan")] * 16 + [1e16]},
        {"ids": list(range(15))},  # too short
        {"ids": tuple(range(20))},  # a tuple is not a list
        {"turns": [{"token_ids": list(range(20)), "text": "t"}, "x", [1, 2]], "n": [1, 2]},
        {"nested": {"deeper": {"mask": [0] * 16}, "plain": {"a": 1}}},
        [{"ids": list(range(17))}, {"a": [1] * 20}],
        OrderedDict(ids=list(range(20)), b=OrderedDict(c=1)),  # subclasses: plain copies
        {"x": UserList([1, 2])},
        "text",
        None,
    ]
    for value in values:
        before = copy.deepcopy(value)
        shown, taken = compact_lists(value)
        expected_shown, expected_taken = _reference(value)
        assert shown == expected_shown and type(shown) is type(expected_shown), value
        assert taken == expected_taken, value
        assert value == before, value
