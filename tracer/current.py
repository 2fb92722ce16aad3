"""The current (default) tracer, in a leaf module: the hot path reads ``current.tracer`` with
one attribute lookup and imports nothing per call; ``tracer.core`` sets it on ``init`` and
``reset``. Nothing here imports the rest of the package."""

from __future__ import annotations

from typing import Any

tracer: Any = None  # a tracer.core.Tracer; a disabled one until init()
