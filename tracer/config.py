"""Tracer configuration: one dataclass, validated once at init, errors that list valid values."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tracer.backend_registry import _BUILTIN, available_backends
from tracer.config_values import ConfigError, check_value

# Keep rules (tail sampling, tracer/keep.py): names accepted in ``TraceConfig.keep``.
KEEP_RULES = ("errors", "extreme_rewards", "zero_variance_groups", "tool_errors", "truncated",
              "predicate")  # fmt: skip


# Semantic conventions the OTLP backend can write next to MLflow's span attributes
# (``TraceConfig.otlp_conventions``): OpenTelemetry GenAI, and OpenInference (Arize Phoenix).
OTLP_CONVENTIONS = ("genai", "openinference")


def _default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


# Keys earlier versions accepted, and why they are gone (a config that still sets one fails
# with this reason instead of a bare "unknown key").
REMOVED_KEYS = {
    "background_switch_interval_s": "the tracer no longer changes the interpreter's switch "
    "interval (nothing process-wide is touched); delete the key",
    "background_yield_s": "background threads no longer step aside for the rollout (it held "
    "finished trajectories out of the spool); delete the key",
}


@dataclass
class TraceConfig:
    """Everything the tracer can be told. Field names follow verl's ``rollout.trace`` section.

    Example::

        tracer.init(TraceConfig(backend="mlflow", project_name="gsm8k", experiment_name="grpo",
                                token2text=True, max_samples_per_step_per_worker=8))
    """

    # verl's names
    backend: str | list[str] | None = "mlflow"
    token2text: bool = False
    max_samples_per_step_per_worker: int | None = None
    project_name: str = "rollout-tracer"
    experiment_name: str = "default"
    # sampling
    sampling_seed: int = 0
    # keep rules (tail sampling, tracer/keep.py): also store trajectories that head sampling
    # left out when one of these rules matches at the trajectory's (or its group's) end. Rules
    # earlier in the list win when keep_max_per_step is reached. Any of KEEP_RULES.
    keep: list[str] = field(default_factory=list)
    keep_max_per_step: int | None = None  # tail-kept trajectories per (step, validate)
    keep_predicate: Any = None  # (record: TrajectoryRecord) -> bool; the rule "predicate"
    keep_group_size: int | None = None  # GRPO n: a group decides as soon as it is complete
    # hot-path buffer: finished trajectories waiting for the background pipeline
    max_buffer_trajectories: int = 10_000
    max_buffer_bytes: int = 512 * 1024 * 1024
    # per-field payload limit: longer strings / lists are truncated with a marker
    max_field_chars: int = 200_000
    max_list_items: int = 20_000
    # background export
    flush_interval_s: float = 1.0
    export_batch_size: int = 256
    # a batch waits in the spool up to this long for more to share its export call (one
    # store transaction); a flush, shutdown or a whole batch sends it at once (0: never waits)
    export_interval_s: float = 5.0
    export_max_retries: int = 3
    export_timeout_s: float = 30.0  # the default flush() timeout; also per HTTP call
    # shutdown (and interpreter exit) waits at most this long for a backend; what is left
    # stays in the spool and one line says how to export it later
    shutdown_timeout_s: float = 10.0
    # spool: the write-ahead log that outlives backend outages and crashes (tracer/spool.py)
    spool: bool = True
    spool_dir: str | None = None  # default: ./.rollout-tracer/spool
    max_spool_bytes: int = 2 * 1024**3
    replay_interval_s: float = 2.0
    # redaction of secrets in everything exported (tracer/redact.py)
    redact: bool = True
    redact_patterns: list[str] = field(default_factory=list)
    redact_callback: Any = None  # (text: str) -> str
    # identity
    worker_id: str = field(default_factory=_default_worker_id)
    # A secret of this run, the same in the driver and every worker (e.g. made once by the
    # driver with tracer.new_run_salt() and passed in the workers' config). When set, a
    # trajectory with a step, sample_index and rollout_n gets a trace id derived from the salt
    # and that identity (tracer/ids.py), so tracer.annotate() in any process finds it. None:
    # random trace ids, and annotate() is unavailable.
    run_salt: str | None = None
    # how long an annotation waits for its trace to be stored (it has just ended, or the
    # backend is down) before it is counted annotation_lost
    annotation_timeout_s: float = 120.0
    # the stuck-trajectory watchdog (tracer/watchdog.py): a trajectory open longer than this,
    # or far longer than its step's typical one, is reported once (a log line, a metric)
    # while it still runs; 0 turns the watchdog off
    stuck_after_s: float = 600.0
    # the live per-step analysis (tracer/live/): how many recent steps each process keeps
    # (behaviour groups, time parts) for tracer.step_metrics(); 0 turns it off
    live_steps: int = 16
    # backend options
    tracking_uri: str | None = None  # mlflow; default: MLFLOW_TRACKING_URI, then ./mlflow.db
    jsonl_path: str | None = None  # jsonl; default: ./traces/<project>/<experiment>.jsonl
    otlp_endpoint: str | None = None  # otlp; default: OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT
    otlp_headers: dict[str, str] = field(default_factory=dict)
    # otlp: which semantic conventions the spans carry besides MLflow's (any of OTLP_CONVENTIONS)
    otlp_conventions: list[str] = field(default_factory=lambda: list(OTLP_CONVENTIONS))
    weave_entity: str | None = None
    # mlflow: link every exported trace to this MLflow run (search_traces(run_id=...), the
    # run's Traces tab); the run must be in the experiment named project_name
    mlflow_run_id: str | None = None
    # run a backend's export calls in a child process, off the rollout's GIL. None (the
    # default): only the built-in MLflow backend's (its export is ~2 ms of Python per trace),
    # and in this process after all when the child cannot start; True: every spoolable
    # backend's (a child that cannot start is an init error); False: none. When None here,
    # $ROLLOUT_TRACER_EXPORT_IN_SUBPROCESS (1/0/true/false/none) decides, for a whole job and
    # its subprocesses at once (resolve_export_in_subprocess)
    export_in_subprocess: bool | None = None
    # what to do when a backend cannot start: "raise" (default) or "warn" (others go on)
    on_backend_error: str = "raise"
    # raise tracer-internal errors instead of logging them (the project's own tests set it)
    raise_internal_errors: bool = False

    def __post_init__(self) -> None:
        # every value, whatever it is, against its field's type and range (tracer/config_values.py)
        for f in dataclasses.fields(self):
            check_value(f.name, getattr(self, f.name), str(f.type), self._source(f.name))
        for name, check in (("backend", self._check_backends), ("keep", self._check_keep),
                            ("otlp_conventions", self._check_conventions),
                            ("redact_patterns", self._check_patterns)):  # fmt: skip
            try:
                check()
            except ConfigError as exc:
                raise ConfigError(f"{self._source(name)}: {exc}") from None

    def _source(self, name: str) -> str:
        """Where the value of ``name`` came from, for an error (see :meth:`from_sources`)."""
        return self.__dict__.get("_sources", {}).get(name) or f"TraceConfig({name}=...)"

    @classmethod
    def from_sources(
        cls, values: Mapping[str, Any], said: Iterable[str], sources: Mapping[str, str]
    ) -> TraceConfig:
        """The config made of ``values``, of which the code said ``said``; an invalid value's
        error names its source from ``sources`` (``file PATH:key``, ``ROLLOUT_TRACER_X``)
        instead of ``TraceConfig(x=...)``. For tracer/config_sources.py."""
        config = cls.__new__(cls)
        config.__dict__["_sources"] = dict(sources)
        config.__init__(**dict(values))  # type: ignore[misc]
        del config.__dict__["_sources"]
        config.__dict__["_said"] = frozenset(said)
        return config

    def _check_backends(self) -> None:
        self.backend = _normalize_backends(self.backend)
        check_backends(self.backend)

    def _check_patterns(self) -> None:
        for pattern in self.redact_patterns:
            if not isinstance(pattern, str):
                raise ConfigError(f"redact pattern {pattern!r} is not a string")
            try:
                re.compile(pattern)
            except re.error as exc:
                raise ConfigError(f"invalid redact pattern {pattern!r}: {exc}") from exc

    @property
    def said(self) -> frozenset[str]:
        """The fields the code gave when it made this config (by keyword or position), even
        at their default: what ``ROLLOUT_TRACER_*`` and the file may not change
        (tracer/config_sources.py). A copy by ``dataclasses.replace`` gives every field."""
        return self.__dict__.get("_said", frozenset())

    def with_values(self, **changes: Any) -> TraceConfig:
        """A copy with ``changes``; the fields it says are this one's and ``changes``'."""
        new = dataclasses.replace(self, **changes)
        new.__dict__["_said"] = self.said | frozenset(changes)
        return new

    def _check_conventions(self) -> None:
        names = self.otlp_conventions
        if isinstance(names, str):
            names = names.split(",")
        elif not isinstance(names, (list, tuple)):
            raise ConfigError(
                f"otlp_conventions must be a list of names (any of {', '.join(OTLP_CONVENTIONS)}),"
                f" got {names!r}"
            )
        cleaned = [str(n).strip().lower() for n in names if str(n).strip()]
        for name in cleaned:
            if name not in OTLP_CONVENTIONS:
                raise ConfigError(
                    f"unknown OTLP convention {name!r}{did_you_mean(name, OTLP_CONVENTIONS)}; "
                    f"otlp_conventions accepts: {', '.join(OTLP_CONVENTIONS)}"
                )
        self.otlp_conventions = list(dict.fromkeys(cleaned))

    def _check_keep(self) -> None:
        keep = self.keep
        if keep is None:
            keep = []
        elif isinstance(keep, str):
            keep = [k.strip() for k in keep.split(",") if k.strip()]
        elif not isinstance(keep, (list, tuple)):
            raise ConfigError(f"keep must be a list of rule names, got {keep!r}")
        self.keep = [str(k).strip().lower() for k in keep]
        for rule in self.keep:
            if rule not in KEEP_RULES:
                raise ConfigError(
                    f"unknown keep rule {rule!r}{did_you_mean(rule, KEEP_RULES)}; valid rules: "
                    f"{', '.join(KEEP_RULES)}"
                )
        if "predicate" in self.keep and self.keep_predicate is None:
            raise ConfigError("keep rule 'predicate' needs keep_predicate=<callable(record)>")

    @property
    def keep_on(self) -> bool:
        """Whether any keep rule is configured (every trajectory is then recorded)."""
        return bool(self.keep) or self.keep_predicate is not None

    @property
    def backends(self) -> list[str]:
        assert isinstance(self.backend, list)
        return self.backend

    @property
    def enabled(self) -> bool:
        return bool(self.backends) and (
            self.max_samples_per_step_per_worker != 0 or self.keep_on
        )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> TraceConfig:
        return cls(**dict(data))

    @classmethod
    def coerce(
        cls, config: TraceConfig | Mapping[str, Any] | None, **overrides: Any
    ) -> TraceConfig:
        if config is None:
            config = {}
        if isinstance(config, TraceConfig):
            return config.with_values(**overrides) if overrides else config
        if isinstance(config, Mapping):
            return cls.from_mapping({**dict(config), **overrides})
        raise ConfigError(f"config must be a TraceConfig or a mapping, got {type(config).__name__}")


def _recording_init(init: Callable[..., None]) -> Callable[..., None]:
    """The dataclass's own ``__init__``, which first notes the fields it is given (see
    :attr:`TraceConfig.said`: "the code wins" must hold for a value equal to the default, so
    comparing with the defaults cannot tell) and turns a name that is no field into a
    ConfigError with the close ones, instead of Python's bare TypeError."""
    names = [f.name for f in dataclasses.fields(TraceConfig) if f.init]

    @functools.wraps(init)
    def __init__(self: TraceConfig, *args: Any, **kwargs: Any) -> None:
        for key in kwargs:
            if key in REMOVED_KEYS:
                raise ConfigError(f"trace config key {key!r} was removed: {REMOVED_KEYS[key]}")
            if key not in names:
                raise ConfigError(f"TraceConfig({key}=...): unknown option{close_names(key, names)}"
                                  f"; valid: {', '.join(sorted(names))}")  # fmt: skip
        if len(args) > len(names):
            raise ConfigError(f"TraceConfig takes at most {len(names)} values, got {len(args)}")
        self.__dict__["_said"] = frozenset([*names[: len(args)], *kwargs])
        init(self, *args, **kwargs)

    return __init__


setattr(TraceConfig, "__init__", _recording_init(TraceConfig.__init__))  # noqa: B010


def close_names(name: str, valid: Iterable[str]) -> str:
    """:func:`did_you_mean`'s hint, plus up to two more valid names that are close."""
    first = did_you_mean(name, valid)
    others = [c for c in difflib.get_close_matches(name, sorted(valid), n=3, cutoff=0.6)
              if f"`{c}`" not in first][:2]  # fmt: skip
    if not others:
        return first
    also = ", ".join(f"`{c}`" for c in others)
    return f"{first[:-1]}; also close: {also})" if first else f" (close: {also})"


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """``" (did you mean `x`?)"`` for the closest valid name, or ``""`` when none is close.
    A name contained in exactly one valid name wins (a tutorial's ``max_samples`` means
    ``max_samples_per_step_per_worker``, not the closer-spelled ``max_spool_bytes``); else
    difflib's closest match."""
    choices = sorted(valid)
    lowered = name.lower()
    contained = [c for c in choices if len(lowered) >= 3 and lowered in c.lower()]
    match = contained if len(contained) == 1 else []
    if not match:
        match = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return f" (did you mean `{match[0]}`?)" if match else ""


def _normalize_backends(backend: Any) -> list[str]:
    """Backend names as a list, lower case, without duplicates. Whether each name exists is
    checked by :func:`check_backends` against tracer/backend_registry.py."""
    if backend is None:
        return []
    if isinstance(backend, str):
        names = [b.strip() for b in backend.split(",")] if "," in backend else [backend.strip()]
    elif isinstance(backend, (list, tuple)):
        names = [str(b).strip() for b in backend]
    else:
        raise ConfigError(f"backend must be a name or a list of names, got {backend!r}")
    # "dummy" is verl's name for a backend that traces nothing
    names = [n.lower() for n in names if n and n.lower() not in ("none", "null", "off", "dummy")]
    seen: list[str] = []
    for n in names:
        if n not in seen:
            seen.append(n)
    return seen


def check_backends(names: list[str]) -> None:
    """Raise ``ConfigError`` naming the valid backends (and the closest one) for a typo. Valid:
    the built-in names, those given to :func:`register_backend` so far, and the entry points
    of the ``rollout_tracer.backends`` group (``TraceConfig`` asks when it is made, so register
    a backend before making a config that names it)."""
    if all(n in _BUILTIN for n in names):  # every TraceConfig asks: skip the entry-point scan
        return
    valid = available_backends()
    bad = [n for n in names if n not in valid]
    if bad:
        raise ConfigError(
            f"unknown trace backend(s) {bad}; valid backends: {sorted(valid)} "
            f"(or None / 'dummy': tracing off){did_you_mean(bad[0], valid)}"
        )
