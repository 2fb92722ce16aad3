"""Waiting on a condition instead of sleeping a fixed time: a fixed sleep is too short on a loaded
machine (a flaky test) and too long on a quiet one (a slow suite)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T], what: str, timeout_s: float = 60.0, interval_s: float = 0.02
) -> T:
    """Call ``condition`` until it returns something truthy, and return that; past
    ``timeout_s``, fail the test saying ``what`` was awaited and what the last call gave."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout_s:.0f} s for {what}; last: {value!r}")
        time.sleep(interval_s)
