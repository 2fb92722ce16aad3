"""The Tracer object and the module-level default that the public functions use."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from tracer import current
from tracer.attempts import AttemptCounter, identity_key
from tracer.backends import check_backends
from tracer.config import ConfigError, TraceConfig
from tracer.config_sources import resolve_config, resolve_export_in_subprocess
from tracer.exporter_source import IMPORT_ERRORS, ExporterSource, start_error_text
from tracer.sampling import Sampler

log = logging.getLogger("tracer")


class TracerInitError(RuntimeError):
    """A backend could not be started (missing package, unreachable server, bad credentials)."""


class Tracer:
    """Holds a config, the sampler and the background pipeline. Most users never touch it:
    ``tracer.init(config)`` builds one and makes it the default."""

    def __init__(self, config: TraceConfig | Mapping[str, Any] | None = None, **overrides: Any):
        if config is None and not overrides:
            self.config = TraceConfig(backend=None)  # the default before init(): tracing off
        else:
            self.config = TraceConfig.coerce(config, **overrides)
        check_backends(self.config.backends)  # a typo fails here, not at the first trajectory
        self.sampler = Sampler(
            self.config.max_samples_per_step_per_worker, self.config.sampling_seed
        )
        self.attempts = AttemptCounter()  # tracer/attempts.py: a retried sample's number
        self.tokenizer: Any = None
        self.pipeline: Any = None
        self.annotator: Any = None
        self._annotator_lock = threading.Lock()
        self.active = False
        # the traced trajectories still open: trace_attr adds each as it opens and takes it
        # out as it ends (tracer/watchdog.py: OpenTrajectories; nothing kept without a watchdog)
        self.open_trajectories: Any = _NOT_WATCHED
        # the unsampled rollouts open now, by id (the watchdog's; None: no watchdog)
        self.unsampled: dict[int, Any] | None = None
        self.watchdog: Any = None
        self.keep_on = self.config.keep_on
        if not self.keep_on:  # the sampler decides alone: one Python call fewer per trajectory
            self.admit = self.sampler.admit  # type: ignore[method-assign]

    def start(self) -> Tracer:
        """Create the backends (so configuration and connection errors surface here)."""
        if not self.config.enabled:
            return self
        from tracer.pipeline import Pipeline

        factories: list[Any] = []
        in_subprocess = resolve_export_in_subprocess(self.config)  # a bad variable raises here
        for name in self.config.backends:
            try:
                source = ExporterSource.start(name, self.config, in_subprocess)
            except ConfigError:
                raise
            except Exception as exc:
                why = start_error_text(exc)
                msg = f"rollout-tracer: backend {name!r} could not start: {why}"
                if isinstance(exc, ImportError) or why.startswith(IMPORT_ERRORS):
                    msg += f" (install it with: pip install 'rollout-tracer[{name}]')"
                if self.config.on_backend_error == "raise":
                    raise TracerInitError(msg) from exc
                log.warning("%s; tracing goes on without it (on_backend_error='warn')", msg)
                continue
            factories.append(source)
        if not factories:
            return self
        self.pipeline = Pipeline(self.config, self.sampler, factories, lambda: self.tokenizer)
        self.submit = self.pipeline.submit  # type: ignore[method-assign]  # never raises
        if self.config.stuck_after_s > 0:
            self._start_watchdog()
        self.active = True
        return self

    def _start_watchdog(self) -> None:
        from tracer.watchdog import OpenTrajectories, Watchdog

        try:
            watchdog = Watchdog(self.config, OpenTrajectories()).start()
        except RuntimeError as exc:  # no thread left: tracing goes on without it
            log.warning("rollout-tracer: the stuck-trajectory watchdog did not start (%s); "
                        "tracing goes on without it", exc)  # fmt: skip
            return
        self.open_trajectories, self.watchdog = watchdog.open, watchdog
        self.unsampled = watchdog.open.unsampled

    # hot path
    def admit(self, step: Any, sample_index: Any, validate: bool) -> tuple[bool, Any]:
        traced, sample_index = self.sampler.admit(step, sample_index, validate)
        # keep rules: a trajectory head sampling leaves out is recorded all the same, as a tail
        # candidate decided at its end (tracer/keep.py); the pipeline asks the sampler again
        return traced or self.keep_on, sample_index

    def submit(self, traj: Any) -> None:
        """A trajectory that ends with no pipeline (never started, or shut down) goes nowhere;
        while one runs, ``start`` binds this name to its ``submit`` (which never raises)."""

    def annotate(
        self,
        step: Any,
        sample_index: Any,
        rollout_n: Any,
        values: Mapping[str, Any],
        validate: bool = False,
        experiment: str | None = None,
        attempt: int | None = None,
    ) -> bool:
        """See :func:`tracer.annotate`."""
        if not self.active:
            return False
        from tracer.annotations import AnnotationRecord
        from tracer.annotator import Annotator, copy_value
        from tracer.ids import attempt_trace_id, derived_trace_id
        from tracer.trajectory import has_identity

        config = self.config
        if not config.run_salt:
            raise ConfigError(
                "tracer.annotate needs run_salt in the trace config, the same in the driver "
                "and every rollout worker (e.g. run_salt=tracer.new_run_salt() in the driver, "
                "passed to the workers' tracer.init): trace ids are derived from it"
            )
        if not has_identity(step, sample_index, rollout_n):
            raise ValueError("tracer.annotate needs step, sample_index and rollout_n")
        if attempt is not None and (
            not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0
        ):
            raise ValueError(f"tracer.annotate: attempt must be an int >= 0, got {attempt!r}")
        raw = {str(k): copy_value(v) for k, v in values.items()}
        trace_id = derived_trace_id(config.run_salt, config.project_name,
                                    experiment or config.experiment_name, step, sample_index,
                                    rollout_n, bool(validate))  # fmt: skip
        if self.annotator is None:
            with self._annotator_lock:
                if self.annotator is None:
                    self.annotator = Annotator(config)
        own = experiment in (None, config.experiment_name)
        if attempt is None and own and not self.keep_on and (
            self.sampler.rejects(step, sample_index, validate)
        ):  # this process's sampler turned it down: there is no trace to wait for
            self.annotator.skip()
            return True
        if attempt is None and own:  # the latest this process traced, when it traced one
            attempt = self.attempts.latest(step, identity_key(sample_index, rollout_n, validate))
        if attempt is not None:
            trace_id = attempt_trace_id(trace_id, attempt)
        record = AnnotationRecord(trace_id, step, sample_index, rollout_n, bool(validate),
                                  time.time_ns(), attempt=attempt)  # fmt: skip
        return bool(self.annotator.put(record, raw))

    # control
    def end_step(self, step: Any, validate: bool | None = None) -> None:
        if self.pipeline is not None:
            self.pipeline.end_step(step, validate)

    def flush(self, timeout_s: float | None = None) -> bool:
        timeout = self.config.export_timeout_s if timeout_s is None else timeout_s
        ok = True
        if self.pipeline is not None:
            ok = bool(self.pipeline.flush(timeout))
        if self.annotator is not None:
            ok = self.annotator.flush(timeout) and ok
        return ok

    def shutdown(self, timeout_s: float | None = None) -> bool:
        self.active = False
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.annotator is not None:
            self.annotator.close(self.config.shutdown_timeout_s if timeout_s is None
                                 else timeout_s)  # fmt: skip
            self.annotator = None
        if self.pipeline is None:
            return True
        ok = bool(self.pipeline.shutdown(
            self.config.shutdown_timeout_s if timeout_s is None else timeout_s))
        self.__dict__.pop("submit", None)  # back to the method: submits go nowhere
        self.pipeline = None
        return ok

    def metrics(self) -> dict[str, Any]:
        out = self.pipeline.metrics() if self.pipeline is not None else {}
        if self.annotator is not None:
            out.update(self.annotator.metrics())
        if self.watchdog is not None:
            out.update(self.watchdog.metrics())
        return dict(out)


class _NotWatched:
    """The open-trajectory set of a tracer without a watchdog: keeps nothing."""

    def add(self, item: Any) -> None:
        pass

    ended = add


_NOT_WATCHED = _NotWatched()


_lock = threading.Lock()
current.tracer = Tracer()
_atexit_registered = False


def get_tracer() -> Tracer:
    """The tracer that ``trace_attr``/``trace_op`` use now (disabled until ``init``)."""
    return current.tracer  # type: ignore[no-any-return]


def init(config: TraceConfig | Mapping[str, Any] | None = None, **overrides: Any) -> Tracer:
    """Configure tracing for this process and make it the default. Replaces (and flushes) any
    previous tracer. Options the code leaves unsaid come from ``$ROLLOUT_TRACER_CONFIG`` and
    ``ROLLOUT_TRACER_<FIELD>`` variables (:func:`tracer.config_sources.resolve_config`).
    Raises ``ConfigError`` for bad values (a misspelt ``ROLLOUT_TRACER_`` variable too) and
    ``TracerInitError`` when a backend cannot start.

    Example::

        tracer.init({"backend": "mlflow", "project_name": "gsm8k", "token2text": True})
    """
    global _atexit_registered
    new = Tracer(resolve_config(config, overrides)).start()
    with _lock:
        old, current.tracer = current.tracer, new
        if not _atexit_registered:
            atexit.register(_shutdown_at_exit)
            _atexit_registered = True
    old.shutdown()
    return new


def flush(timeout_s: float | None = None) -> bool:
    """Block until every trajectory finished so far is stored by every backend. A backend that
    is down is probed until it answers or ``timeout_s`` (default ``export_timeout_s``) passes.
    True only when nothing is left waiting and nothing was lost since the previous flush; what
    is left stays in the spool, and ``metrics()`` says where each trajectory is."""
    return get_tracer().flush(timeout_s)


def end_step(step: Any, validate: bool | None = None) -> None:
    """Tell the keep rules that ``step`` is over (both its training and validation rollouts
    when ``validate`` is None): its min/max rewards and open groups are decided now, in the
    background, after every trajectory finished so far. Never blocks; a no-op without keep
    rules. Without it a step is decided at ``flush()`` or when newer steps pile up.

    Example::

        for step in range(steps):
            rollouts = run_step(step)
            tracer.end_step(step)
    """
    get_tracer().end_step(step, validate)


def shutdown(timeout_s: float | None = None) -> bool:
    """Flush (waiting at most ``timeout_s``, default ``shutdown_timeout_s``) and stop the
    background workers; tracing is off afterwards until ``init``. If a backend is still down,
    one line says how many trajectories wait in the spool and the command that exports them."""
    return get_tracer().shutdown(timeout_s)


def reset() -> None:
    """Shut down the default tracer and replace it with a disabled one (for tests)."""
    with _lock:
        old, current.tracer = current.tracer, Tracer()
    old.shutdown()


def annotate(
    step: Any,
    sample_index: Any,
    rollout_n: Any,
    values: Mapping[str, Any],
    validate: bool = False,
    experiment: str | None = None,
    attempt: int | None = None,
) -> bool:
    """Attach values computed after the rollout to the trajectory traced with this identity,
    from any process of the run (the trace id is derived from ``run_salt`` and the identity;
    see ``tracer.annotator``). A sample run more than once has one trace per attempt:
    ``attempt`` names one, None means the latest. Per-token values are arrays aligned with the
    trajectory's model tokens (its generate calls' response tokens, in order), or with verl's
    whole response when ``response_mask`` (or ``loss_mask``) is given too; per-trajectory
    values are numbers.
    Names the readers know: ``train_logprob``, ``ref_logprob``, ``entropy``, ``advantage``,
    ``rollout_logprob`` (when the engine's are not on the trace). Returns False when tracing
    is off or the queue is full. An annotation waits for its trace to be stored, at most
    ``annotation_timeout_s``, then counts as ``tracer/annotations/<backend>/annotation_lost``;
    one of a trajectory this process's sampler left out counts as ``skipped``. Idempotent.

    Example::

        tracer.annotate(step=3, sample_index=i, rollout_n=k,
                        values={"train_logprob": old_log_prob[j], "ref_logprob": ref[j],
                                "response_mask": response_mask[j], "advantage": 0.7})
    """
    return get_tracer().annotate(step, sample_index, rollout_n, values, validate, experiment,
                                 attempt)


def new_run_salt() -> str:
    """A fresh ``run_salt`` for a run: make it once in the driver, give it to every worker."""
    return os.urandom(16).hex()


def register_tokenizer(tokenizer: Any) -> None:
    """Tokenizer for token2text when the traced object has no ``tokenizer`` attribute."""
    get_tracer().tokenizer = tokenizer


def metrics() -> dict[str, Any]:
    """Counters to log beside training metrics: exported, dropped, queue depth, ..."""
    return get_tracer().metrics()


def _shutdown_at_exit() -> None:
    with contextlib.suppress(Exception):  # interpreter teardown: nothing left to report to
        get_tracer().shutdown()
