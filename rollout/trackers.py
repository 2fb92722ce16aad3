"""Step metrics and sample tables in the experiment trackers users already use.

``trainer.logger`` (verl's key) lists any of:

=========  ==============================================================================
console    one readable line per step (through tqdm, so a progress bar stays intact)
mlflow     one run per experiment in the experiment ``trainer.project_name``: flattened
           config as params, metrics per step, samples as ``mlflow.log_table`` artifacts
           (``samples/step_000001.json``); the tracer links its traces to the run
           (``mlflow.search_traces(run_id=...)``, the run's Traces tab)
wandb      online with ``WANDB_API_KEY`` (or ``wandb login``), or ``WANDB_MODE=offline``;
           samples as a ``wandb.Table``
swanlab    ``SWANLAB_MODE`` online (``SWANLAB_API_KEY`` or ``swanlab login``), local
           (needs ``swanlab[dashboard]``), offline or disabled; samples as ``swanlab.Text``
trackio    local-first (``TRACKIO_DIR``, default the Hugging Face cache), or a Space /
           server via ``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL``; samples as a
           ``trackio.Table``
=========  ==============================================================================

Each tracker's package is imported only when it is listed; a missing package or key is a
:class:`TrackerError` at start that names the extra to install or the variable to set.
``trainer.log_rollout_generations: N`` (like verl's ``log_val_generations``) logs N samples
(prompt, response, reward) per step. Only the driver logs: build :class:`Tracking` with
``is_driver=False`` elsewhere (it does nothing), and feed the driver
:func:`rollout.metrics.aggregate` of the workers' raw numbers.

A tracker that fails while logging is warned about once and the rollout goes on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rollout.metrics import StepInputs, clean_metrics, collect, compute_metrics
from rollout.tracker_writers import (
    ROLLOUT_SAMPLES,
    TRACKERS,
    VAL_GENERATIONS,
    ConsoleTracker,
    MlflowTracker,
    SwanlabTracker,
    Tracker,
    TrackerError,
    TrackioTracker,
    WandbTracker,
    parse_logger,
)

__all__ = ["ROLLOUT_SAMPLES", "TRACKERS", "VAL_GENERATIONS", "Tracker", "TrackerError", "Tracking",
           "resolve_tracking_uri"]  # fmt: skip

log = logging.getLogger("rollout.trackers")


def resolve_tracking_uri(trace: Mapping[str, Any] | None) -> str:
    """The MLflow store the tracer uses: ``rollout.trace.tracking_uri``, else
    ``MLFLOW_TRACKING_URI``, else ``./mlflow.db``."""
    uri = (trace or {}).get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI")
    return uri or f"sqlite:///{os.path.abspath('mlflow.db')}"




class Tracking:
    """All configured trackers behind one object (shaped like verl's ``Tracking``).

    ``Tracking.from_config(config, trace)`` starts them (errors: :class:`TrackerError`);
    ``log_step(step_result, tracer.metrics())`` logs one step; ``finish()`` at the end.
    """

    def __init__(
        self,
        names: Sequence[str] | str | None,
        *,
        project: str = "rollout-tracer",
        experiment: str = "default",
        config: Mapping[str, Any] | None = None,
        tracking_uri: str | None = None,
        mlflow_experiment: str | None = None,
        num_samples: int = 0,
        num_val_samples: int = 0,
        is_driver: bool = True,
        write: Callable[[str], None] | None = None,
    ) -> None:
        self.names = parse_logger(names) if is_driver else []
        self.num_samples = max(0, int(num_samples or 0))
        self.num_val_samples = max(0, int(num_val_samples or 0))
        self.trackers: list[Tracker] = []
        self._failed: set[str] = set()
        config = dict(config or {})
        try:
            for name in self.names:
                if name == "console":
                    self.trackers.append(ConsoleTracker(write))
                elif name == "mlflow":
                    uri = tracking_uri or resolve_tracking_uri(None)
                    exp = mlflow_experiment or project  # the tracer's experiment
                    self.trackers.append(MlflowTracker(exp, experiment, config, uri))
                elif name == "wandb":
                    self.trackers.append(WandbTracker(project, experiment, config))
                elif name == "swanlab":
                    self.trackers.append(SwanlabTracker(project, experiment, config))
                elif name == "trackio":
                    self.trackers.append(TrackioTracker(project, experiment, config))
        except BaseException:
            self.finish(failed=True)  # the ones already started
            raise

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        trace: Mapping[str, Any] | None = None,
        *,
        is_driver: bool = True,
        write: Callable[[str], None] | None = None,
    ) -> Tracking:
        """From ``trainer.logger``, ``trainer.project_name`` / ``experiment_name`` and
        ``trainer.log_rollout_generations``; MLflow uses the tracer's store (``trace``)."""
        trainer = config.get("trainer") or {}
        return cls(
            trainer.get("logger", ["console"]),
            project=str(trainer.get("project_name", "rollout-tracer")),
            experiment=str(trainer.get("experiment_name", "default")),
            config=config,
            tracking_uri=resolve_tracking_uri(trace),
            mlflow_experiment=(trace or {}).get("project_name"),
            num_samples=int(trainer.get("log_rollout_generations") or 0),
            num_val_samples=int(trainer.get("log_val_generations") or 0),
            is_driver=is_driver,
            write=write,
        )

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run's id (pass it to the tracer as ``mlflow_run_id``), else None."""
        for t in self.trackers:
            if isinstance(t, MlflowTracker):
                return t.run_id
        return None

    def _call(self, tracker: Tracker, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:
            key = f"{tracker.name}.{what}"
            if key not in self._failed:
                self._failed.add(key)
                log.warning("tracker %s failed to %s (the rollout goes on; further errors "
                            "not shown): %r", tracker.name, what, exc)  # fmt: skip

    def call(self, tracker: Tracker, what: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` for ``tracker`` (e.g. an image, rollout/heatmap.py): a failure is
        warned about once per kind and the rollout goes on."""
        self._call(tracker, what, fn)

    def call_each(self, writers: Mapping[str, Callable[..., None]], what: str,
                  *args: Any) -> list[str]:  # fmt: skip
        """``writers[name](tracker, *args)`` for every tracker that has a writer (those that take
        an image, or text); a failure is warned about once per kind. The trackers' names."""
        done = []
        for tracker in self.trackers:
            writer = writers.get(tracker.name)
            if writer is None:
                continue
            self._call(tracker, what, lambda t=tracker, w=writer: w(t, *args))  # type: ignore[misc]
            done.append(tracker.name)
        return done

    def log(self, metrics: Mapping[str, Any], step: int) -> dict[str, float]:
        """Log ``metrics`` (non-numbers skipped with one warning each) at ``step``."""
        clean = clean_metrics(metrics)
        for t in self.trackers:
            self._call(t, "log", lambda t=t: t.log(dict(clean), int(step)))  # type: ignore[misc]
        return clean

    def log_samples(
        self, rows: Sequence[Mapping[str, Any]], step: int, key: str = ROLLOUT_SAMPLES
    ) -> None:
        """Log the samples table (prompt, response, reward, ...) of ``step`` under ``key``."""
        if not rows:
            return
        data = [dict(r) for r in rows]
        for t in self.trackers:
            log = t.log_samples
            self._call(t, "log samples", lambda log=log: log(data, int(step), key))  # type: ignore[misc]

    def log_validation(
        self, result: Any, tracer_metrics: Mapping[str, Any] | None = None
    ) -> dict[str, float]:
        """Log one validation pass (a ``StepResult`` with ``validate``): ``val/...`` metrics
        and, with ``trainer.log_val_generations: N``, a table of N generations
        (``val/generations``) in every tracker, like verl's ``log_val_generations``."""
        inputs = collect(result, num_samples=self.num_val_samples)
        rollout = compute_metrics(inputs)
        metrics = {f"val/{k.removeprefix('rollout/')}": v for k, v in rollout.items()
                   if k.startswith("rollout/")}  # fmt: skip
        clean = self.log(metrics, inputs.step)
        self.log_samples(inputs.samples, inputs.step, VAL_GENERATIONS)
        return clean

    def log_inputs(
        self, inputs: StepInputs, tracer_metrics: Mapping[str, Any] | None = None
    ) -> dict[str, float]:
        """Compute and log the metrics (and samples) of one step's raw numbers (e.g. the
        driver's :func:`rollout.metrics.aggregate` of all workers). The step's own metrics
        come from ``compute_metrics``; the driver's extra ones (health, patterns, mismatch)
        are gathered in :class:`rollout.after_step.AfterStep`, one ``metrics.update`` line
        each: add a new per-step metric there."""
        metrics = self.log(compute_metrics(inputs, tracer_metrics), inputs.step)
        self.log_samples(inputs.samples[: self.num_samples], inputs.step)
        return metrics

    def log_step(
        self, result: Any, tracer_metrics: Mapping[str, Any] | None = None
    ) -> dict[str, float]:
        """Log one ``StepResult`` of a single worker."""
        return self.log_inputs(collect(result, num_samples=self.num_samples), tracer_metrics)

    def finish(self, failed: bool = False) -> None:
        """End every tracker's run (FAILED / crashed when ``failed``)."""
        for t in self.trackers:
            self._call(t, "finish", lambda t=t: t.finish(failed))  # type: ignore[misc]
        self.trackers = []
