"""Where a :class:`TraceConfig` comes from: the code, the file ``$ROLLOUT_TRACER_CONFIG`` and the
variables ``ROLLOUT_TRACER_<FIELD>``, merged by one function (:func:`resolve_config`) that
``tracer.init`` calls, and with it the verl switch, verl-style ``RolloutTraceConfig.init``,
``rollout-tracer run`` and its Ray workers.

Precedence, lowest first: the field's default, the file, the variables, the code. The code wins
because whoever wrote ``tracer.init(spool_dir=...)`` meant that value; variables beat the file
because a variable is set per job and the file is shared by many (logfire's order: argument,
environment, file). A field the code leaves at its default is filled from the environment, so
a cluster sets what the code does not say.

The variables are derived from :class:`TraceConfig`'s fields, so a field added there has its
``ROLLOUT_TRACER_<FIELD>`` variable with no change here. A ``ROLLOUT_TRACER_`` variable that
is neither a field's nor in :data:`ENV_OTHERS` is an error naming the closest one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from tracer.config import ConfigError, TraceConfig, did_you_mean

ENV_PREFIX = "ROLLOUT_TRACER_"
# ROLLOUT_TRACER_* variables that are not TraceConfig fields, and who reads them. A new one
# must be added here, or every tracer.init in its process fails naming the closest option.
ENV_OTHERS = {
    "VERL": "the verl switch: rollout_tracer_verl.pth and tracer/verl_switch.py",
    "CONFIG": "the options file read here",
    "CACHE": "where rollout/models.py keeps converted models",
}
# Fields never read from the environment: verl's own five (verl's trace section passes them:
# a variable beside it would be a second place to set the same thing) and the callables.
NOT_FROM_ENV = {
    "backend": "verl's name: tracer.init(backend=...) or actor_rollout_ref.rollout.trace.backend",
    "token2text": "verl's name: set it in code or verl's trace section",
    "max_samples_per_step_per_worker": "verl's name: set it in code or verl's trace section",
    "project_name": "verl's name: set it in code or trainer.project_name",
    "experiment_name": "verl's name: set it in code or trainer.experiment_name",
    "keep_predicate": "a callable: set it in code",
    "redact_callback": "a callable: set it in code",
}


def env_fields() -> dict[str, dataclasses.Field[Any]]:
    """The fields that have a ``ROLLOUT_TRACER_<FIELD>`` variable (all but NOT_FROM_ENV)."""
    return {f.name: f for f in dataclasses.fields(TraceConfig) if f.name not in NOT_FROM_ENV}


def resolve_config(
    config: TraceConfig | Mapping[str, Any] | None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> TraceConfig:
    """The config ``tracer.init(config, **overrides)`` runs with: what the code says, and for
    every field it leaves unsaid the file's or a variable's value (see the module's docstring).
    The code says a field when it gives a value other than the field's default (a mapping's
    ``keep: []`` or ``tracking_uri: null`` says nothing). Raises :class:`ConfigError`.

    Example::

        # ROLLOUT_TRACER_SPOOL_DIR=/data/spool in the environment
        resolve_config({"backend": "jsonl"}).spool_dir  # '/data/spool'
    """
    if isinstance(config, TraceConfig):
        filled = _unsaid(vars(config) | dict(overrides or {}), environ)
        changes = {**filled, **dict(overrides or {})}
        return dataclasses.replace(config, **changes) if changes else config
    if config is None:
        config = {}
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a TraceConfig or a mapping, got {type(config).__name__}")
    return TraceConfig.from_mapping(merged_options({**config, **dict(overrides or {})}, environ))


def merged_options(
    options: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``options`` (the code's mapping) with what it leaves unsaid filled from the file and
    the variables: for a caller that adjusts the mapping before ``tracer.init`` (the
    ``rollout-tracer run`` command fills in its MLflow store)."""
    return {**dict(options), **_unsaid(options, environ)}


def _unsaid(said: Mapping[str, Any], environ: Mapping[str, str] | None) -> dict[str, Any]:
    """The environment's options for the fields ``said`` lacks or holds at their default."""
    sources = options_from_env(os.environ if environ is None else environ)
    fields = env_fields()
    return {k: v for k, v in sources.items()
            if k not in said or said[k] == _default(fields[k])}  # fmt: skip


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def resolve_export_in_subprocess(
    config: TraceConfig, environ: Mapping[str, str] | None = None
) -> bool | None:
    """``config.export_in_subprocess``, or when that is None the variable
    ``ROLLOUT_TRACER_EXPORT_IN_SUBPROCESS`` (an argument wins over the environment). The
    variable reaches every process of a job: a CLI run, Ray workers, a test suite that starts
    no export child where the test is not about it. A bad value raises :class:`ConfigError`.

    Example::

        resolve_export_in_subprocess(TraceConfig(backend="mlflow"))  # None: the default
    """
    if config.export_in_subprocess is not None:
        return config.export_in_subprocess
    var = ENV_PREFIX + "EXPORT_IN_SUBPROCESS"
    text = (os.environ if environ is None else environ).get(var)
    return None if text is None else _env_value(var, text, "bool | None")


def options_from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """The options the environment sets: the YAML/JSON mapping in the file
    ``$ROLLOUT_TRACER_CONFIG``, then one variable per field, ``ROLLOUT_TRACER_<FIELD>``
    (``ROLLOUT_TRACER_SPOOL_DIR=/data/spool``, ``ROLLOUT_TRACER_KEEP=errors,tool_errors``),
    which wins over the file. Lists are comma separated, dicts JSON, booleans
    1/0/true/false, ``none`` is None. A variable or key that names no option raises
    :class:`ConfigError` with the closest name.

    Example::

        options = options_from_env(os.environ)  # {"spool_dir": "/data/spool", ...}
    """
    fields = env_fields()
    options: dict[str, Any] = {}
    path = environ.get(ENV_PREFIX + "CONFIG")
    if path:
        options.update(_options_file(path, fields))
    for var, text in environ.items():
        if not var.startswith(ENV_PREFIX) or var[len(ENV_PREFIX) :] in ENV_OTHERS:
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if name in NOT_FROM_ENV:
            raise ConfigError(f"{var} is not read from the environment: {NOT_FROM_ENV[name]}")
        if name not in fields:
            valid = [ENV_PREFIX + n.upper() for n in [*fields, *map(str.lower, ENV_OTHERS)]]
            raise ConfigError(f"unknown variable {var}{did_you_mean(var, valid)}; rollout-tracer "
                              f"reads {', '.join(sorted(valid))}")  # fmt: skip
        options[name] = _env_value(var, text, str(fields[name].type))
    return options


def _options_file(path: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    import yaml  # JSON is YAML too

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {ENV_PREFIX}CONFIG={path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{ENV_PREFIX}CONFIG={path} must hold a mapping of options")
    for key in data:
        if key in NOT_FROM_ENV:
            raise ConfigError(f"{key!r} in {path} is not read from a file: {NOT_FROM_ENV[key]}")
        if key not in fields:
            raise ConfigError(f"unknown option {key!r} in {path}{did_you_mean(key, fields)}; "
                              f"valid: {', '.join(sorted(fields))}")  # fmt: skip
    return dict(data)


def _env_value(var: str, text: str, annotation: str) -> Any:
    """``text`` as the field's type, read from its annotation (``int | None``, ...)."""
    value = text.strip()
    if "None" in annotation and value.lower() in ("", "none", "null"):
        return None
    kind = annotation.split("|")[0].strip()
    try:
        if kind == "bool":
            if value.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError("not a boolean (1/0/true/false)")
            return value.lower() in ("1", "true", "yes", "on")
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind.startswith("list"):
            return [item.strip() for item in value.split(",") if item.strip()]
        if kind.startswith("dict"):
            parsed = json.loads(value)
            if not isinstance(parsed, dict):
                raise ValueError("not a JSON object")
            return parsed
    except ValueError as exc:
        raise ConfigError(f"{var}={text!r}: {exc}") from exc
    return value
