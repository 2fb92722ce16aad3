"""The switch: with ``ROLLOUT_TRACER_VERL=1``, an installed, unmodified verl imports
rollout-tracer where it imports ``verl.utils.rollout_trace``.

How it gets there: the wheel puts ``rollout_tracer_verl.pth`` into site-packages. Python runs
its one line at the start of every interpreter of that environment (the driver, and every Ray
worker, which are interpreters of the same environment). The line reads the variable and does
nothing else when it is unset; when it is set it calls :func:`install`, which puts
:class:`VerlTraceFinder` first on ``sys.meta_path``. The finder answers for exactly one module
name; rollout-tracer itself is imported only when verl imports that module.

What verl then gets (:func:`build_module`) has verl's three names, ``RolloutTraceConfig``,
``rollout_trace_attr`` and ``rollout_trace_op``, from :mod:`tracer.verl_compat`, and:

- verl's own ``RolloutTraceConfig.init`` call (its ``rollout.trace`` section) starts tracing;
  the options verl has no name for come from ``ROLLOUT_TRACER_*`` variables or the file
  ``$ROLLOUT_TRACER_CONFIG``, read as ``tracer.init`` reads them everywhere
  (:mod:`tracer.config_sources`). Without a tracking URI
  anywhere the MLflow store is verl's default, ``sqlite:////tmp/mlruns.db``.
- Init logs ``rollout-tracer active for verl (...)``; every trace has ``tracer=rollout-tracer``.
- A tracer must never stop a job: when rollout-tracer cannot be imported, verl's module is
  loaded as if the switch were off; when its init fails (a bad option, a backend that does
  not start), verl's own tracer is initialized instead and traces every op. Either way with
  one warning that says why.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import os
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

ENV_VAR = "ROLLOUT_TRACER_VERL"
VERL_MODULE = "verl.utils.rollout_trace"
# verl's logger: loaded as verl wrote it, then its Tracking gets the live numbers
# (tracer/verl_metrics.py)
VERL_TRACKING_MODULE = "verl.utils.tracking"
# verl's own module, loaded under this name only when the switch falls back to it at init
VERL_OWN_MODULE = "verl.utils._rollout_trace_verl_own"
# verl's RolloutTraceConfig.init: MLFLOW_TRACKING_URI, else this
VERL_DEFAULT_TRACKING_URI = "sqlite:////tmp/mlruns.db"
ACTIVE_MESSAGE = "rollout-tracer active for verl"

log = logging.getLogger("tracer.verl")


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``ROLLOUT_TRACER_VERL`` asks for the switch (1/true/yes/on)."""
    return environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once). Called by the ``.pth`` line."""
    if any(isinstance(f, VerlTraceFinder) for f in sys.meta_path):
        return
    if VERL_MODULE in sys.modules:
        log.warning("rollout-tracer: %s was imported before the switch was installed; this "
                    "process keeps verl's own tracer", VERL_MODULE)  # fmt: skip
        return
    sys.meta_path.insert(0, VerlTraceFinder())


def uninstall() -> None:
    """Take the finder off ``sys.meta_path`` (for tests)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, VerlTraceFinder)]


class VerlTraceFinder(importlib.abc.MetaPathFinder):
    """Finds ``verl.utils.rollout_trace`` through the other finders and loads ours in its
    place, and ``verl.utils.tracking`` to add the live numbers to its ``Tracking``; every
    other name is left to them."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in (VERL_MODULE, VERL_TRACKING_MODULE):
            return None
        verl_spec = _find_elsewhere(fullname, path, target)
        if verl_spec is None:  # no verl here: the import fails as it would without us
            return None
        loader = _SwitchLoader if fullname == VERL_MODULE else _TrackingLoader
        return importlib.util.spec_from_loader(fullname, loader(verl_spec), origin=verl_spec.origin)


def _find_elsewhere(fullname: str, path: Any, target: Any) -> Any:
    for finder in sys.meta_path:
        if isinstance(finder, VerlTraceFinder):
            continue
        find_spec = getattr(finder, "find_spec", None)
        spec = find_spec(fullname, path, target) if find_spec is not None else None
        if spec is not None:
            return spec
    return None


class _SwitchLoader(importlib.abc.Loader):
    def __init__(self, verl_spec: importlib.machinery.ModuleSpec) -> None:
        self.verl_spec = verl_spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        try:
            names = build_module()
        except Exception as exc:  # rollout-tracer cannot load: verl's module, as if off
            log.warning("rollout-tracer: %s is set but rollout-tracer could not load "
                        "(%s: %s); verl traces with its own tracer", ENV_VAR,
                        type(exc).__name__, exc)  # fmt: skip
            loader = self.verl_spec.loader
            assert loader is not None
            module.__file__ = self.verl_spec.origin
            loader.exec_module(module)
            return
        module.__dict__.update(names)
        module.__file__ = self.verl_spec.origin  # verl's file: what tools expect to find


class _TrackingLoader(importlib.abc.Loader):
    """verl's ``verl.utils.tracking`` as verl wrote it; then its ``Tracking`` becomes the
    subclass that adds the live numbers, unless that fails (verl's class stays)."""

    def __init__(self, verl_spec: importlib.machinery.ModuleSpec) -> None:
        self.verl_spec = verl_spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        loader = self.verl_spec.loader
        assert loader is not None
        module.__file__ = self.verl_spec.origin
        loader.exec_module(module)
        try:
            from tracer.verl_metrics import tracking_class

            module.Tracking = tracking_class(module.Tracking)  # type: ignore[attr-defined]
        except Exception as exc:
            log.warning("rollout-tracer: the live numbers cannot be added to verl's Tracking "
                        "(%s: %s); verl logs its own metrics only", type(exc).__name__,
                        exc)  # fmt: skip


class _Fallback:
    """verl's own module once rollout-tracer's init failed in this process (else None)."""

    module: ModuleType | None = None


def build_module() -> dict[str, Any]:
    """The names the switched ``verl.utils.rollout_trace`` holds."""
    from tracer import verl_compat, verl_metrics

    class RolloutTraceConfig(verl_compat.RolloutTraceConfig):
        __doc__ = verl_compat.RolloutTraceConfig.__doc__

        @classmethod
        def init(  # type: ignore[override]
            cls,
            project_name: str | None,
            experiment_name: str | None,
            backend: str | list[str] | None,
            token2text: bool = False,
            max_samples_per_step_per_worker: int | None = None,
        ) -> None:
            """verl's signature, verl's call; never raises (see the module's docstring)."""
            if cls.get_instance()._initialized or _Fallback.module is not None:
                return
            args = (project_name, experiment_name, backend, token2text,
                    max_samples_per_step_per_worker)  # fmt: skip
            try:
                options = switch_options(os.environ)
                super().init(*args, **options)
            except Exception as exc:
                _fall_back(exc, args)
                config = cls.get_instance()  # what verl's agent loop reads for its sampling
                config.backend, config.token2text = backend, token2text
                config.project_name, config.experiment_name = project_name, experiment_name
                config.max_samples_per_step_per_worker = max_samples_per_step_per_worker
                return
            if cls.get_instance()._tracer is not None and backend not in (None, "dummy"):
                tracer = cls.get_instance()._tracer
                assert tracer is not None
                cfg = tracer.config
                log.warning("%s (backend=%s, project=%s, experiment=%s, tracking_uri=%s, "
                            "spool=%s, pid=%d)", ACTIVE_MESSAGE, ",".join(cfg.backends),
                            cfg.project_name, cfg.experiment_name,
                            cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"),
                            cfg.spool_dir if cfg.spool else "off", os.getpid())  # fmt: skip
                verl_metrics.start_publisher(cfg.worker_id)  # a Ray rollout worker's numbers

        @classmethod
        def reset(cls) -> None:
            """Forget the configuration, rollout-tracer's or verl's own after a fallback."""
            verl_metrics.stop_publisher()
            own, _Fallback.module = _Fallback.module, None
            if own is not None:
                own.RolloutTraceConfig.reset()
            super().reset()

    def rollout_trace_attr(
        sample_index: Any = None,
        step: Any = None,
        rollout_n: Any = None,
        name: str = "rollout_trace",
        validate: Any = False,
        trace: bool = True,
    ) -> Any:
        own = _Fallback.module
        if own is None and not validate:
            verl_metrics.note_step(step)
        impl = verl_compat.rollout_trace_attr if own is None else own.rollout_trace_attr
        return impl(sample_index, step, rollout_n, name, validate, trace)

    rollout_trace_attr.__doc__ = verl_compat.rollout_trace_attr.__doc__
    for obj in (RolloutTraceConfig, rollout_trace_attr):  # pickled by reference, as verl's
        obj.__module__, obj.__qualname__ = VERL_MODULE, obj.__name__
    return {
        "__doc__": __doc__,
        "__rollout_tracer__": True,
        "RolloutTraceConfig": RolloutTraceConfig,
        "rollout_trace_attr": rollout_trace_attr,
        "rollout_trace_op": _switched_op(verl_compat.rollout_trace_op),
    }


def switch_options(environ: Mapping[str, str]) -> dict[str, Any]:
    """rollout-tracer's own options for verl's processes: ``ROLLOUT_TRACER_*`` and
    ``$ROLLOUT_TRACER_CONFIG``; the MLflow store defaults to verl's."""
    from tracer.config_sources import options_from_env

    options = options_from_env(environ)
    if options.get("tracking_uri") is None and not environ.get("MLFLOW_TRACKING_URI"):
        options["tracking_uri"] = VERL_DEFAULT_TRACKING_URI
    return options


def _switched_op(ours: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Any:
    def rollout_trace_op(func: Callable[..., Any]) -> Callable[..., Any]:
        traced = ours(func)
        theirs: list[Callable[..., Any]] = []  # verl's decoration, made on first use

        def verl_traced(own: ModuleType) -> Callable[..., Any]:
            if not theirs:
                theirs.append(own.rollout_trace_op(func))
            return theirs[0]

        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def async_op(*args: Any, **kwargs: Any) -> Any:
                own = _Fallback.module
                if own is None:
                    return await traced(*args, **kwargs)
                return await verl_traced(own)(*args, **kwargs)

            switched: Callable[..., Any] = async_op
        else:

            @functools.wraps(func)
            def op(*args: Any, **kwargs: Any) -> Any:
                own = _Fallback.module
                if own is None:
                    return traced(*args, **kwargs)
                return verl_traced(own)(*args, **kwargs)

            switched = op
        info = getattr(traced, "__rollout_tracer_op__", None)
        if info is not None:
            switched.__rollout_tracer_op__ = info  # type: ignore[attr-defined]
        return switched

    return rollout_trace_op


def _fall_back(exc: Exception, args: tuple[Any, ...]) -> None:
    """rollout-tracer's init failed: verl's own tracer takes over in this process."""
    try:
        own = _load_verl_own()
        own.RolloutTraceConfig.init(*args)
    except Exception as own_exc:
        log.warning("rollout-tracer could not start (%s: %s) and neither could verl's own "
                    "tracer (%s: %s); this process traces nothing", type(exc).__name__, exc,
                    type(own_exc).__name__, own_exc)  # fmt: skip
        return
    _Fallback.module = own
    log.warning("rollout-tracer could not start (%s: %s); verl traces with its own tracer",
                type(exc).__name__, exc)  # fmt: skip


def _load_verl_own() -> ModuleType:
    if VERL_OWN_MODULE in sys.modules:
        return sys.modules[VERL_OWN_MODULE]
    origin = sys.modules[VERL_MODULE].__file__
    spec = importlib.util.spec_from_file_location(VERL_OWN_MODULE, origin)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[VERL_OWN_MODULE] = module
    spec.loader.exec_module(module)
    return module
