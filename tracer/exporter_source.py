"""Where each backend's exporter is made at ``init``, and again in a forked process: here, or
in an export child (``export_in_subprocess``; tracer/backends/subprocess_proxy.py).

A built-in backend whose export is heavy Python (MLflow) is made in its export child only: the
child opens the store and answers, and an error there is ``init``'s error, in the backend's own
words. The user's process never imports its library (MLflow: ~2,300 modules, ~300,000 objects
its garbage collector would walk for the rest of the job, ~230 MiB). Any other backend is made
here first, so its errors surface at ``init``, then handed to a child when the setting says so.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING

from tracer.backends import builtin_target, create_exporter
from tracer.backends.base import BackendStartError, Exporter, as_exporter

if TYPE_CHECKING:
    from tracer.config import TraceConfig

log = logging.getLogger("tracer")

# how an error of the child's start begins when the backend's library is missing
IMPORT_ERRORS = ("ImportError", "ModuleNotFoundError")


def start_error_text(exc: BaseException) -> str:
    """An exporter's start error for ``init``'s message: the child's own words (they name the
    error's type already), else the type and the message."""
    if isinstance(exc, BackendStartError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class ExporterSource:
    """Hands the pipeline its exporter: the one made at init first (so its errors surfaced
    there), a fresh one on later calls (in a forked child), in a child process when
    ``export_in_subprocess`` says so (``_in_child``)."""

    def __init__(
        self, exporter: Exporter, name: str, config: TraceConfig, in_subprocess: bool | None
    ) -> None:
        self.exporter: Exporter | None = exporter
        self.name = name
        self.config = config
        self.child_destination: str | None = None  # set once this process exports from a child
        self.in_subprocess = in_subprocess
        self.as_made = False  # the first exporter goes as it is (a child, or no child started)

    @classmethod
    def start(cls, name: str, config: TraceConfig, in_subprocess: bool | None) -> ExporterSource:
        """Make the backend's first exporter (raises what its start raised)."""
        child, tried = _child_first(name, config, in_subprocess)
        if child is not None:
            source = cls(child, name, config, in_subprocess)
            source.child_destination = child.spool_key  # a fork starts its own child
        else:
            source = cls(as_exporter(create_exporter(name, config)), name, config, in_subprocess)
        source.as_made = tried  # a child that did not start is not tried again now
        return source

    def __call__(self) -> Exporter:
        exporter, self.exporter = self.exporter, None
        if exporter is not None and self.as_made:
            return exporter
        if exporter is None and self.child_destination is not None:
            from tracer.backends.subprocess_proxy import SubprocessExporter

            # a forked process: its own child, started by its export worker's thread at the
            # first export (this runs on the rollout's thread, under the pipeline's lock)
            return SubprocessExporter(self.name, self.config, self.child_destination,
                                      start=False, required=self.in_subprocess)  # fmt: skip
        if exporter is None:
            exporter = as_exporter(create_exporter(self.name, self.config))
        if not _in_child(self.in_subprocess, self.name, exporter):
            return exporter
        from tracer.backends.subprocess_proxy import SubprocessExporter

        try:
            child = SubprocessExporter(self.name, self.config, exporter.spool_key)
        except Exception as exc:
            if self.in_subprocess:  # asked for: an init error, as any backend's
                exporter.shutdown()
                raise
            _fall_back(self.name, exc)
            return exporter
        exporter.shutdown()  # it proved the backend starts; the child has its own
        self.child_destination = exporter.spool_key
        return child


def _fall_back(name: str, exc: BaseException) -> None:
    log.warning("rollout-tracer: %s exports from this process: its export process did not "
                "start (%s: %s)", name, type(exc).__name__, exc)  # fmt: skip


def _child_first(name: str, config: TraceConfig,
                 setting: bool | None) -> tuple[Exporter | None, bool]:  # fmt: skip
    """(the export child of a built-in backend whose export is heavy, or None, whether one
    was tried). None when the backend is made here first (any other backend, or
    ``export_in_subprocess=False``), or when no child could start (made here after all, with
    one warning, unless ``export_in_subprocess=True`` asked for a child: then that error). The
    child's own error making the backend is raised as it is (``BackendStartError``)."""
    target = builtin_target(name)  # None: not built in, or register_backend changed it
    if setting is False or target is None:
        return None, False
    module, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module), attr)  # ours: no backend library imported
    if not (getattr(cls, "heavy_export", False) and getattr(cls, "spoolable", True)):
        return None, False
    from tracer.backends.subprocess_proxy import SubprocessExporter

    try:
        return SubprocessExporter(name, config, ""), True
    except BackendStartError:
        raise
    except Exception as exc:
        if setting:
            raise
        _fall_back(name, exc)
        return None, True


def _in_child(setting: bool | None, name: str, exporter: Exporter) -> bool:
    """Whether ``exporter``'s exports go to a child process: every spoolable backend's when
    ``export_in_subprocess`` is True; by default (None) a built-in backend's whose export is
    heavy Python (MLflow), when the child makes the same exporter from its name (not a
    subclass or a backend registered in this process only)."""
    if setting is False or not exporter.spoolable:
        return False
    if setting:
        return True
    cls = type(exporter)
    return bool(getattr(cls, "heavy_export", False)) and (
        builtin_target(name) == f"{cls.__module__}:{cls.__qualname__}"
    )
