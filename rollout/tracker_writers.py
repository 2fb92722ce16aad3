"""One writer per experiment tracker (``trainer.logger``): the console line, MLflow, W&B,
SwanLab and Trackio, each behind :class:`Tracker` (``log``, ``log_samples``, ``finish``); the
names they accept and the packages they need. :class:`rollout.trackers.Tracking` starts the
configured ones and fans each step out to them; this module knows nothing of steps."""

from __future__ import annotations

import importlib
import importlib.util
import netrc
import os
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlparse

from rollout.metrics import SAMPLE_COLUMNS

# tracker -> (module to import, pip extra that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "mlflow": ("mlflow", "rollout-tracer[mlflow]"),
    "wandb": ("wandb", "rollout-tracer[wandb]"),
    "swanlab": ("swanlab", "rollout-tracer[swanlab]"),
    "trackio": ("trackio", "rollout-tracer[trackio]"),
}
TRACKERS = ("console", "mlflow", "wandb", "swanlab", "trackio")
ROLLOUT_SAMPLES = "rollout/samples"  # the table key of trainer.log_rollout_generations
VAL_GENERATIONS = "val/generations"  # the table key of trainer.log_val_generations (verl's)


class TrackerError(ValueError):
    """A tracker cannot start: unknown name, missing package, missing key."""


def _require(tracker: str) -> Any:
    module, extra = EXTRAS[tracker]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TrackerError(
            f"trainer.logger includes {tracker!r} but the {module!r} package cannot be "
            f"imported ({exc}); install it with: pip install '{extra}'"
        ) from exc


def parse_logger(value: Any) -> list[str]:
    """``trainer.logger`` as a list of tracker names (a name, ``"a,b"`` or a list)."""
    if value is None:
        return []
    if isinstance(value, str):
        names = [v.strip() for v in value.split(",")]
    elif isinstance(value, (list, tuple)):
        names = [str(v).strip() for v in value]
    else:
        raise TrackerError(f"trainer.logger must be a name or a list of names, got {value!r}")
    names = [n.lower() for n in names if n and n.lower() not in ("none", "null")]
    bad = [n for n in names if n not in TRACKERS]
    if bad:
        raise TrackerError(f"unknown trainer.logger value(s) {bad}; valid: {', '.join(TRACKERS)}")
    return list(dict.fromkeys(names))


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


class Tracker:
    """One destination. ``log`` gets clean float metrics; ``log_samples`` the sample rows."""

    name = "tracker"

    def log(self, metrics: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def log_samples(
        self, rows: list[dict[str, Any]], step: int, key: str = ROLLOUT_SAMPLES
    ) -> None:
        return None

    def finish(self, failed: bool = False) -> None:
        return None


class ConsoleTracker(Tracker):
    name = "console"

    def __init__(self, write: Callable[[str], None] | None = None) -> None:
        if write is None:
            try:
                from tqdm import tqdm

                write = tqdm.write
            except ImportError:  # pragma: no cover - tqdm is a dependency
                write = print
        self.write = write

    def log(self, metrics: dict[str, float], step: int) -> None:
        if any(k.startswith("val/") for k in metrics):
            self.write(format_val_line(metrics, step))
        else:
            self.write(format_line(metrics, step))


def format_line(m: Mapping[str, float], step: int) -> str:
    """One readable line of the main metrics of a step."""

    def g(key: str, fmt: str = ".2f") -> str:
        return format(m[key], fmt) if key in m else "-"

    parts = [f"step {step}"]
    if "rollout/reward/mean" in m:
        parts.append(f"reward {g('rollout/reward/mean')}±{g('rollout/reward/std')} "
                     f"[{g('rollout/reward/min')}, {g('rollout/reward/max')}]")  # fmt: skip
    parts.append(f"acc {g('rollout/accuracy')}")
    parts.append(f"resp_len {g('rollout/response_length/mean', '.1f')}")
    parts.append(f"turns {g('rollout/turns/mean')}")
    parts.append(f"tools {g('rollout/tool_calls/mean')} (err {g('rollout/tool_error_rate')})")
    finish = [(k.rsplit("/", 1)[1], v) for k, v in m.items()
              if k.startswith("rollout/finish_reason/") and v > 0]  # fmt: skip
    if finish:
        parts.append("finish " + " ".join(f"{k} {v:.2f}" for k, v in finish))
    parts.append(f"zero_std_groups {g('rollout/grpo/zero_std_group_frac')}")
    if "patterns/top_share" in m:  # rollout/step_patterns.py
        parts.append(f"top pattern {g('patterns/top_share')} rising {g('patterns/rising', '.0f')}")
    parts.append(f"{g('perf/trajectories_per_s')} traj/s {g('perf/tokens_per_s', '.0f')} tok/s")
    exported = sum(v for k, v in m.items() if k.startswith("tracer/") and k.endswith("/exported"))
    dropped = sum(v for k, v in m.items() if k.startswith("tracer/") and "dropped" in k)
    if any(k.startswith("tracer/") for k in m):
        parts.append(f"tracer exported {exported:.0f} dropped {dropped:.0f}")
    return " | ".join(parts)


def format_val_line(m: Mapping[str, float], step: int) -> str:
    """One readable line of a validation pass."""

    def g(key: str, fmt: str = ".2f") -> str:
        return format(m[key], fmt) if key in m else "-"

    return (f"validation at step {step} | reward {g('val/reward/mean')} | acc "
            f"{g('val/accuracy')} | turns {g('val/turns/mean')} | tools "
            f"{g('val/tool_calls/mean')}")  # fmt: skip


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, project: str, experiment: str, config: Mapping[str, Any], uri: str):
        _require("mlflow")
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(project)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            try:
                exp_id = self.client.create_experiment(project)
            except Exception:  # created concurrently (e.g. by the tracer)
                exp = self.client.get_experiment_by_name(project)
                if exp is None:
                    raise
                exp_id = exp.experiment_id
        run = self.client.create_run(str(exp_id), run_name=experiment,
                                     tags={"mlflow.source.name": "rollout-tracer"})  # fmt: skip
        self.run_id: str = run.info.run_id
        self.experiment_id = str(exp_id)
        params = [Param(k[:250], str(v)[:6000]) for k, v in flatten(config).items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        self.client.log_batch(self.run_id, tags=[RunTag("experiment_name", experiment)])

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, v, ts, step) for k, v in metrics.items()]
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_samples(
        self, rows: list[dict[str, Any]], step: int, key: str = ROLLOUT_SAMPLES
    ) -> None:
        data = {c: [r.get(c) for r in rows] for c in SAMPLE_COLUMNS}
        folder = "samples" if key == ROLLOUT_SAMPLES else key.replace("/", "_")
        path = f"{folder}/step_{step:06d}.json"
        self.client.log_table(self.run_id, data=data, artifact_file=path)

    def finish(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _table_rows(rows: list[dict[str, Any]]) -> list[list[Any]]:
    return [[r.get(c) for c in SAMPLE_COLUMNS] for r in rows]


def _has_netrc_entry(url: str) -> bool:
    host = urlparse(url).hostname or url
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, project: str, experiment: str, config: Mapping[str, Any]) -> None:
        wandb = _require("wandb")
        mode = os.environ.get("WANDB_MODE", "online").lower()
        if mode not in ("offline", "dryrun", "disabled") and not (
            os.environ.get("WANDB_API_KEY")
            or os.environ.get("WANDB_IDENTITY_TOKEN_FILE")
            or _has_netrc_entry(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
        ):
            raise TrackerError(
                "trainer.logger includes 'wandb' (online) but no W&B API key was found: set "
                "WANDB_API_KEY (or run `wandb login`), or set WANDB_MODE=offline to write an "
                "offline run folder (upload later with `wandb sync`)"
            )
        self.wandb = wandb
        self.run = wandb.init(project=project, name=experiment, config=dict(config))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_samples(
        self, rows: list[dict[str, Any]], step: int, key: str = ROLLOUT_SAMPLES
    ) -> None:
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=_table_rows(rows))
        self.run.log({key: table}, step=step)

    def finish(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class SwanlabTracker(Tracker):
    name = "swanlab"

    def __init__(self, project: str, experiment: str, config: Mapping[str, Any]) -> None:
        swanlab = _require("swanlab")
        mode = os.environ.get("SWANLAB_MODE", "online").lower()
        mode = {"cloud": "online"}.get(mode, mode)  # verl's older name
        if mode == "local" and importlib.util.find_spec("swanboard") is None:
            raise TrackerError(
                "SWANLAB_MODE=local needs SwanLab's dashboard package: "
                "pip install 'swanlab[dashboard]' (or 'rollout-tracer[swanlab]')"
            )
        if mode == "online" and not (os.environ.get("SWANLAB_API_KEY") or _swanlab_key(swanlab)):
            raise TrackerError(
                "trainer.logger includes 'swanlab' (online) but no SwanLab API key was found: "
                "set SWANLAB_API_KEY (or run `swanlab login`), or set SWANLAB_MODE=local "
                "(or offline) to keep the run on disk (SWANLAB_LOG_DIR, default ./swanlog)"
            )
        self.swanlab = swanlab
        self.run = swanlab.init(project=project, experiment_name=experiment, mode=mode,
                                config=dict(config))  # fmt: skip

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_samples(
        self, rows: list[dict[str, Any]], step: int, key: str = ROLLOUT_SAMPLES
    ) -> None:
        texts = []
        for r in rows:
            text = f"prompt:\n{r.get('prompt')}\n\nresponse:\n{r.get('response')}"
            caption = (
                f"sample {r.get('sample_index')}/{r.get('rollout_n')} reward={r.get('reward')}"
            )
            texts.append(self.swanlab.Text(text, caption=caption))
        self.run.log({key: texts}, step=step)

    def finish(self, failed: bool = False) -> None:
        self.run.finish(state="crashed" if failed else "success")


def _swanlab_key(swanlab: Any) -> str | None:
    try:
        return swanlab.Settings().api_key  # reads SwanLab's saved login too
    except Exception:
        return None


class TrackioTracker(Tracker):
    name = "trackio"

    def __init__(self, project: str, experiment: str, config: Mapping[str, Any]) -> None:
        trackio = _require("trackio")
        self.trackio = trackio
        self.run = trackio.init(project=project, name=experiment, config=dict(config),
                                embed=False)  # fmt: skip

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_samples(
        self, rows: list[dict[str, Any]], step: int, key: str = ROLLOUT_SAMPLES
    ) -> None:
        table = self.trackio.Table(columns=list(SAMPLE_COLUMNS), data=_table_rows(rows))
        self.run.log({key: table}, step=step)

    def finish(self, failed: bool = False) -> None:
        self.run.finish()
