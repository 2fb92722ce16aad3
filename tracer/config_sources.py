"""Where a :class:`TraceConfig` comes from: the code, the file ``$ROLLOUT_TRACER_CONFIG`` and the
variables ``ROLLOUT_TRACER_<FIELD>``, merged by one function (:func:`resolve_config`) that
``tracer.init`` calls, and with it the verl switch, verl-style ``RolloutTraceConfig.init``,
``rollout-tracer run`` and its Ray workers.

Precedence, lowest first: the field's default, the file, the variables, the code. The code wins
because whoever wrote ``tracer.init(spool_dir=...)`` meant that value, even when it equals the
default (``redact=True`` against a shared file's ``redact: false``); variables beat the file
because a variable is set per job and the file is shared by many (logfire's order: argument,
environment, file). What the code said is known, not guessed from values: a mapping's keys, the
keyword overrides, and a ``TraceConfig``'s :attr:`~tracer.config.TraceConfig.said`. A field the
code did not give is filled from the environment, so a cluster sets what the code does not say.

The variables are derived from :class:`TraceConfig`'s fields, so a field added there has its
``ROLLOUT_TRACER_<FIELD>`` variable with no change here. A ``ROLLOUT_TRACER_`` variable that
is neither a field's nor in :data:`ENV_OTHERS` is an error when its name is close to one (a
misspelling: ``ROLLOUT_TRACER_SPOL_DIR``), and one warning line when it is not (someone else's
variable: ``ROLLOUT_TRACER_HOME``): a stray variable never stops a job.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Mapping
from typing import Any

from tracer.config import ConfigError, TraceConfig, did_you_mean
from tracer.config_values import check_value, from_text, kind_of

log = logging.getLogger("tracer")

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
    """The config ``tracer.init(config, **overrides)`` runs with: every field the code gives
    (a mapping's keys, ``overrides``, a ``TraceConfig``'s ``said``), even at its default; for the
    others the variable's value, else the file's, else the default (see the module's
    docstring). Raises :class:`ConfigError` naming the source of a bad value.

    Example::

        # ROLLOUT_TRACER_SPOOL_DIR=/data/spool in the environment
        resolve_config({"backend": "jsonl"}).spool_dir  # '/data/spool'
        resolve_config({"backend": "jsonl", "spool_dir": None}).spool_dir  # None: code wins
    """
    overrides = dict(overrides or {})
    if isinstance(config, TraceConfig):
        said = config.said | set(overrides)
        code = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        filled, sources = _from_environment(said, environ)
        if not filled and not overrides:
            return config
    elif config is None or isinstance(config, Mapping):
        code = {**dict(config or {}), **overrides}
        said = frozenset(code)
        filled, sources = _from_environment(said, environ)
    else:
        raise ConfigError(f"config must be a TraceConfig or a mapping, got {type(config).__name__}")
    values = {**code, **overrides, **filled}  # filled holds only what the code did not say
    return TraceConfig.from_sources(values, said, sources)


def merged_options(
    options: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``options`` (the code's mapping: every key it has is said) with the fields it lacks
    filled from the variables and the file: for a caller that adjusts the mapping before
    ``tracer.init`` (the ``rollout-tracer run`` command fills in its MLflow store)."""
    filled, _ = _from_environment(frozenset(options), environ)
    return {**filled, **dict(options)}


def _from_environment(
    said: frozenset[str] | set[str], environ: Mapping[str, str] | None
) -> tuple[dict[str, Any], dict[str, str]]:
    """The environment's values for the fields the code did not say, and where each came
    from."""
    sources: dict[str, str] = {}
    options = options_from_env(os.environ if environ is None else environ, sources)
    filled = {k: v for k, v in options.items() if k not in said}
    return filled, {k: sources[k] for k in filled}


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
    return None if text is None else from_text(var, text, "bool | None", var)


def options_from_env(
    environ: Mapping[str, str], sources: dict[str, str] | None = None
) -> dict[str, Any]:
    """The options the environment sets: the YAML/JSON mapping in the file
    ``$ROLLOUT_TRACER_CONFIG``, then one variable per field, ``ROLLOUT_TRACER_<FIELD>``
    (``ROLLOUT_TRACER_SPOOL_DIR=/data/spool``, ``ROLLOUT_TRACER_KEEP=errors,tool_errors``),
    which wins over the file. Lists are comma separated, dicts JSON, booleans
    1/true/yes/on or 0/false/no/off, ``none`` is None (tracer/config_values.py). Each value is
    checked against its field's type and range; a bad one raises :class:`ConfigError` naming
    the variable or ``file PATH:key``. A key of the file that names no option, and a variable
    close to an option's, raise with the closest name; another ``ROLLOUT_TRACER_`` variable is
    one warning line. ``sources`` (when given) receives where each option came from.

    Example::

        options = options_from_env(os.environ)  # {"spool_dir": "/data/spool", ...}
    """
    fields = env_fields()
    options: dict[str, Any] = {}
    where: dict[str, str] = {}
    path = environ.get(ENV_PREFIX + "CONFIG")
    if path:
        for key, value in _options_file(path, fields).items():
            options[key], where[key] = value, f"file {path}:{key}"
    for var, text in environ.items():
        if not var.startswith(ENV_PREFIX) or var[len(ENV_PREFIX) :] in ENV_OTHERS:
            continue
        name = var[len(ENV_PREFIX) :].lower()
        if name in NOT_FROM_ENV:
            raise ConfigError(f"{var} is not read from the environment: {NOT_FROM_ENV[name]}")
        if name not in fields:
            _unknown_variable(var, fields)
            continue
        annotation = str(fields[name].type)
        options[name] = from_text(name, text, annotation, var)
        check_value(name, options[name], annotation, f"{var}={text!r}")
        where[name] = var
    if sources is not None:
        sources.update(where)
    return options


# Suffixes at least this similar (difflib's ratio) to an option's are misspellings of it.
CLOSE = 0.75
_warned: set[str] = set()  # unknown variables already named in a warning (once a process)


def _unknown_variable(var: str, fields: Mapping[str, Any]) -> None:
    """A misspelt option's variable fails; someone else's ``ROLLOUT_TRACER_*`` (a site's
    ``ROLLOUT_TRACER_HOME``) gets one warning line, once, and the job goes on."""
    suffix = var[len(ENV_PREFIX) :]
    known = [n.upper() for n in fields] + list(ENV_OTHERS)
    close = difflib.get_close_matches(suffix, known, n=1, cutoff=CLOSE)
    valid = sorted(ENV_PREFIX + n for n in known)
    if close:
        raise ConfigError(f"unknown variable {var} (did you mean `{ENV_PREFIX + close[0]}`?); "
                          f"rollout-tracer reads {', '.join(valid)}")  # fmt: skip
    if var not in _warned:
        _warned.add(var)
        log.warning("rollout-tracer: ignoring %s: no option has that name or one close to "
                    "it (docs/configuration.md lists the variables)", var)  # fmt: skip


def _options_file(path: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The file's options, typed (a string for a number or a boolean is read as a variable's
    text) and checked; errors name ``file PATH:key``."""
    import yaml  # JSON is YAML too

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read {ENV_PREFIX}CONFIG={path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{ENV_PREFIX}CONFIG={path} must hold a mapping of options")
    options = {}
    for key, value in data.items():
        where = f"file {path}:{key}"
        if key in NOT_FROM_ENV:
            raise ConfigError(f"{where}: not read from a file: {NOT_FROM_ENV[key]}")
        if key not in fields:
            raise ConfigError(f"{where}: unknown option{did_you_mean(str(key), fields)}; "
                              f"valid: {', '.join(sorted(fields))}")  # fmt: skip
        annotation = str(fields[key].type)
        if isinstance(value, str) and kind_of(annotation)[0] not in ("str", "backend", "list"):
            value = from_text(key, value, annotation, where)
        check_value(key, value, annotation, where)
        options[key] = value
    return options
