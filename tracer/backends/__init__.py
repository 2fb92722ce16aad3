"""Backend registry: one dict of lazily imported factories, plus the ``rollout_tracer.backends``
entry-point group for third-party backends. ``import tracer`` imports no backend library."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# the names and their factories live in a leaf module, which TraceConfig asks when it is made
from tracer.backend_registry import (
    _BUILTIN,
    _SHIPPED,
    available_backends,
    builtin_target,
    register_backend,
)
from tracer.config import check_backends

if TYPE_CHECKING:
    from tracer.backends.base import Exporter
    from tracer.config import TraceConfig

def create_exporter(name: str, config: TraceConfig) -> Exporter:
    check_backends([name])
    target = available_backends()[name]
    if callable(target):
        return target(config)  # type: ignore[no-any-return]
    module_name, _, attr = str(target).partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(config)  # type: ignore[no-any-return]


__all__ = ["_BUILTIN", "_SHIPPED", "available_backends", "builtin_target", "check_backends",
           "create_exporter", "register_backend"]  # fmt: skip
