"""Under the switch, the live numbers in verl's own logger: ``verl.utils.tracking.Tracking``
(W&B, MLflow, SwanLab, console, ...) gets the rollout workers' ``patterns/*``, ``timing/*``,
``tracer/*`` with every ``Tracking.log(data, step)``, under that step.

- In the rollout workers (processes where verl's ``RolloutTraceConfig.init`` started tracing
  and Ray runs), :func:`start_publisher` starts a :class:`tracer.live_gather.Publisher`; the
  switched ``rollout_trace_attr`` tells it the newest training step (:func:`note_step`).
- In the driver, verl's module loads unchanged and its ``Tracking`` is replaced by
  :func:`tracking_class`'s subclass: its constructor starts the
  :class:`tracer.live_gather.Collector` (once per process), its ``log`` adds the step's numbers
  (read from memory: no Ray call), its ``finish`` stops the collector.

Nothing here may stop a job: each entry point catches its own failure, says so once and leaves
verl's behaviour as it would be without the switch.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from tracer.live_gather import Collector, Publisher, StepBook

log = logging.getLogger("tracer.verl")


class _Process:
    """This process's publisher (rollout worker) or collector and book (driver)."""

    lock = threading.Lock()
    publisher: Publisher | None = None
    collector: Collector | None = None
    book: StepBook | None = None
    warned: set[str] = set()


def _warn_once(what: str, exc: BaseException) -> None:
    if what not in _Process.warned:
        _Process.warned.add(what)
        log.warning("rollout-tracer: %s failed (%s: %s); verl runs as without the live "
                    "numbers", what, type(exc).__name__, exc)  # fmt: skip


def _ray_running() -> bool:
    ray = sys.modules.get("ray")  # never import Ray where it does not run
    return ray is not None and bool(ray.is_initialized())


# ------------------------------------------------------------------------------ rollout workers
def start_publisher(worker_id: str) -> None:
    """Start this rollout worker's publisher (once; only in a Ray process)."""
    try:
        with _Process.lock:
            if _Process.publisher is None and _ray_running():
                _Process.publisher = Publisher(worker_id).start()
    except Exception as exc:
        _warn_once("starting the live numbers' publisher", exc)


def note_step(step: Any) -> None:
    """A training trajectory of ``step`` opened in this process (the rollout's thread)."""
    publisher = _Process.publisher
    if publisher is not None:
        publisher.note_step(step)


def stop_publisher() -> None:
    """One last send, then stop (``RolloutTraceConfig.reset``)."""
    with _Process.lock:
        publisher, _Process.publisher = _Process.publisher, None
    if publisher is not None:
        try:
            publisher.stop()
        except Exception as exc:
            _warn_once("the live numbers' last send", exc)


# ------------------------------------------------------------------------------ the driver
def driver_book() -> StepBook | None:
    """This process's book, its collector started (None where Ray does not run)."""
    with _Process.lock:
        if _Process.book is None:
            if not _ray_running():
                log.info("rollout-tracer: Ray is not running in the process that made verl's "
                         "Tracking; no live numbers in it")  # fmt: skip
                return None
            book = StepBook()
            _Process.collector = Collector(book).start()
            _Process.book = book
        return _Process.book


def stop_driver() -> None:
    with _Process.lock:
        collector, _Process.collector, _Process.book = _Process.collector, None, None
    if collector is not None:
        collector.stop()


def tracking_class(base: type) -> type:
    """verl's ``Tracking`` with the live numbers added to every ``log``."""

    class Tracking(base):  # type: ignore[valid-type,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._rollout_tracer_book: StepBook | None = None
            try:
                self._rollout_tracer_book = driver_book()
            except Exception as exc:
                _warn_once("starting the live numbers' collector", exc)

        def log(self, data: Any, step: Any, *args: Any, **kwargs: Any) -> Any:
            book = getattr(self, "_rollout_tracer_book", None)
            if book is not None and isinstance(step, int) and isinstance(data, dict):
                try:
                    extra = book.for_log(step)
                except Exception as exc:
                    _warn_once("reading the live numbers", exc)
                    extra = {}
                if extra:
                    data = {**extra, **data}  # verl's own keys win a clash
            return super().log(data, step, *args, **kwargs)

        def finish(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(self, "_rollout_tracer_book", None) is not None:
                self._rollout_tracer_book = None
                stop_driver()
            return super().finish(*args, **kwargs)

    Tracking.__doc__ = base.__doc__
    # pickled and shown as verl's: the module attribute resolves to this class
    Tracking.__module__, Tracking.__qualname__ = base.__module__, base.__qualname__
    return Tracking
