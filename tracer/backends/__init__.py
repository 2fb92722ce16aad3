"""Backend registry: one dict of lazily imported factories, plus the ``rollout_tracer.backends``
entry-point group for third-party backends. ``import tracer`` imports no backend library."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tracer.backends.base import Exporter
    from tracer.config import TraceConfig

# name -> "module:factory"; the factory takes a TraceConfig and returns an Exporter.
_BUILTIN: dict[str, str] = {
    "mlflow": "tracer.backends.mlflow_backend:MlflowExporter",
    "jsonl": "tracer.backends.jsonl_backend:JsonlExporter",
    "otlp": "tracer.backends.otlp_backend:OtlpExporter",
    "weave": "tracer.backends.weave_backend:WeaveExporter",
    "memory": "tracer.testing:InMemoryExporter",
}


def available_backends() -> dict[str, str]:
    names = dict(_BUILTIN)
    try:
        for ep in entry_points(group="rollout_tracer.backends"):
            names.setdefault(ep.name, ep.value)
    except Exception:  # a broken third-party distribution must not break init
        pass
    return names


def create_exporter(name: str, config: TraceConfig) -> Exporter:
    target = available_backends()[name]
    module_name, _, attr = target.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(config)  # type: ignore[no-any-return]
