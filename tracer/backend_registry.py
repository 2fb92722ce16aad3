"""The backend names and what each stands for: one dict of lazily imported factories (the
built-in names, those given to :func:`register_backend`) plus the ``rollout_tracer.backends``
entry-point group for third-party backends. A leaf: ``TraceConfig`` asks it whether a backend
name exists when a config is made, and tracer/backends/ makes the exporters."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tracer.backends.base import Exporter
    from tracer.config import TraceConfig

# name -> "module:factory" (or a callable); the factory takes a TraceConfig, returns an Exporter.
_BUILTIN: dict[str, Any] = {
    "mlflow": "tracer.backends.mlflow_backend:MlflowExporter",
    "jsonl": "tracer.backends.jsonl_backend:JsonlExporter",
    "otlp": "tracer.backends.otlp_backend:OtlpExporter",
    "weave": "tracer.backends.weave_backend:WeaveExporter",
    "trackio": "tracer.backends.trackio_backend:TrackioExporter",
    "memory": "tracer.testing:InMemoryExporter",
}

_SHIPPED = dict(_BUILTIN)  # what a fresh process has: register_backend may change _BUILTIN


def register_backend(name: str, factory: str | Callable[[TraceConfig], Exporter]) -> None:
    """Make ``backend=name`` available: a ``"module:Factory"`` path or a callable that takes
    the TraceConfig and returns an Exporter (see ``tracer.backends.base.Exporter``)."""
    _BUILTIN[name.lower()] = factory


def builtin_target(name: str) -> str | None:
    """The import path a built-in backend's name stands for (as a fresh process resolves it),
    None when ``register_backend`` changed it or the name is not built in."""
    target = _BUILTIN.get(name)
    return target if isinstance(target, str) and target == _SHIPPED.get(name) else None


def available_backends() -> dict[str, Any]:
    names = dict(_BUILTIN)
    try:
        for ep in entry_points(group="rollout_tracer.backends"):
            names.setdefault(ep.name, ep.value)
    except Exception:  # a broken third-party distribution must not break init
        pass
    return names
