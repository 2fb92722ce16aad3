"""The hot-path snapshot's size estimate: what ``max_buffer_bytes`` is enforced against."""

from __future__ import annotations

import time
from typing import Any

from tracer.record import plain
from tracer.snapshot import Json, json_bytes, snapshot

MB = 2**20


def big_strings(n: int) -> list[str]:
    return [f"{i:04d}" + "x" * (MB - 4) for i in range(n)]  # n distinct 1 MB strings


def test_a_list_of_big_strings_counts_their_length():
    payload = big_strings(64)
    copy, nbytes = snapshot(payload)
    assert copy == payload and copy is not payload  # shared strings: not encoded
    assert nbytes >= 64 * MB
    _, nbytes = snapshot(tuple(payload))
    assert nbytes >= 64 * MB


def test_a_big_string_between_numbers_is_counted():
    # numbers at both ends, as in a token-id list, must not hide what is in between
    payload: list[Any] = [*range(100), "y" * (8 * MB), *range(100)]
    copy, nbytes = snapshot(payload)
    assert plain(copy) == payload
    assert nbytes >= 8 * MB
    _, nbytes = snapshot({"ids": [0, b"z" * (4 * MB), *range(100), 1]})
    assert nbytes >= 4 * MB


def test_a_set_of_big_strings_counts_their_length():
    _, nbytes = snapshot(set(big_strings(8)))
    assert nbytes >= 8 * MB


class Opaque:
    """Kept by reference: no fields the snapshot knows how to copy."""

    def __init__(self) -> None:
        self.blob = bytearray(1024)

    def __sizeof__(self) -> int:
        return 10_000


class BadSize:
    def __sizeof__(self) -> int:
        raise RuntimeError("no size")


def test_objects_kept_by_reference_are_charged():
    opaque = Opaque()
    copy, nbytes = snapshot([opaque] * 10)
    assert copy[0] is opaque
    assert nbytes >= 10 * 10_000
    bad = BadSize()
    copy, nbytes = snapshot(bad)
    assert copy is bad and nbytes > 0


def _best_of(n: int, fn: Any) -> float:
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def test_token_id_lists_stay_on_the_fast_path():
    ids = list(range(200_000, 300_000))
    copy, nbytes = snapshot(ids, max_items=200_000)
    assert type(copy) is Json and plain(copy) == ids  # taken as JSON: one orjson call
    assert len(json_bytes(copy)) <= nbytes <= len(json_bytes(copy)) + 1024  # what it holds
    logprobs = [-0.5 * i for i in range(len(ids))]
    assert plain(snapshot(logprobs, max_items=200_000)[0]) == logprobs
    # the same list with one None inside takes the per-item copy (~25x slower here)
    mixed = [*ids[:50_000], None, *ids[50_000:]]
    fast = _best_of(5, lambda: snapshot(ids, max_items=200_000))
    slow = _best_of(5, lambda: snapshot(mixed, max_items=200_000))
    assert fast * 4 < slow, (fast, slow)
