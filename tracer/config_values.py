"""Every :class:`~tracer.config.TraceConfig` value checked against its field's type and range,
whatever its source, with an error that names the source: ``TraceConfig(x=...)`` for the code,
``file PATH:key`` for ``$ROLLOUT_TRACER_CONFIG``, the variable's name for ``ROLLOUT_TRACER_X``.

Text (a variable, or a string in the file where the field is not a string) is read by
:func:`from_text` first; code must pass the field's own type (a bool for a bool: ``"no"`` in
code is an error, not a truthy string).

Accepted spellings of a boolean in text, case-insensitive: ``1 true yes on`` and
``0 false no off``; ``none``/``null``/empty is None where the field allows None. Anything else
(``maybe``) is a :class:`ConfigError`.
"""

from __future__ import annotations

import json
import math
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message says which values are accepted and where
    the value came from."""


TEXT_TRUE = ("1", "true", "yes", "on")
TEXT_FALSE = ("0", "false", "no", "off")
TEXT_NONE = ("", "none", "null")

# Ranges. Integers not named here may be any int (sampling_seed); floats must be finite.
POSITIVE_INTS = ("max_buffer_trajectories", "max_buffer_bytes", "max_field_chars",
                 "max_list_items", "export_batch_size", "max_spool_bytes", "keep_max_per_step",
                 "keep_group_size")  # fmt: skip
NON_NEGATIVE_INTS = ("export_max_retries", "max_samples_per_step_per_worker", "live_steps")
# intervals and timeouts where 0 would spin or give up at once
POSITIVE_FLOATS = ("flush_interval_s", "replay_interval_s", "export_timeout_s")
# 0 means something here: shutdown leaves everything to the spool, annotations do not wait,
# the watchdog is off
NON_NEGATIVE_FLOATS = ("export_interval_s", "shutdown_timeout_s", "annotation_timeout_s",
                       "stuck_after_s")
# string fields with a fixed set of values
CHOICES = {"on_backend_error": ("raise", "warn")}


def kind_of(annotation: str) -> tuple[str, bool]:
    """(``bool``/``int``/``float``/``str``/``list``/``dict``/``backend``/``any``, allows None)
    from a field's annotation string (``int | None``, ``list[str]``, ...)."""
    parts = [p.strip() for p in annotation.split("|")]
    optional = "None" in parts
    parts = [p for p in parts if p != "None"]
    if len(parts) > 1:  # backend: str | list[str]
        return "backend", optional
    head = parts[0].split("[")[0]
    return {"Any": "any"}.get(head, head), optional


def from_text(name: str, text: str, annotation: str, where: str) -> Any:
    """A variable's (or a file string's) text as the field's type; ConfigError naming
    ``where`` when it is not one."""
    kind, optional = kind_of(annotation)
    value = text.strip()
    if optional and value.lower() in TEXT_NONE:
        return None
    try:
        if kind == "bool":
            if value.lower() in TEXT_TRUE:
                return True
            if value.lower() in TEXT_FALSE:
                return False
            raise ValueError(f"not a boolean (true: {'/'.join(TEXT_TRUE)}; false: "
                             f"{'/'.join(TEXT_FALSE)})")  # fmt: skip
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
        if kind in ("list", "backend"):
            return [item.strip() for item in value.split(",") if item.strip()]
        if kind == "dict":
            parsed = json.loads(value)
            if not isinstance(parsed, dict):
                raise ValueError("not a JSON object")
            return parsed
    except ValueError as exc:
        raise ConfigError(f"{where}={text!r}: {exc}") from exc
    return value


def check_value(name: str, value: Any, annotation: str, where: str) -> None:
    """Raise ConfigError (``where: ...``) unless ``value`` has the field's type and range."""
    problem = _problem(name, value, annotation)
    if problem:
        raise ConfigError(f"{where}: {problem}")


def _problem(name: str, value: Any, annotation: str) -> str | None:
    kind, optional = kind_of(annotation)
    if value is None:
        return None if optional or kind == "any" else f"{name} must not be None"
    if kind == "bool":
        if not isinstance(value, bool):
            return f"{name} must be True or False, got {value!r}"
    elif kind == "int":
        return _int_problem(name, value)
    elif kind == "float":
        return _float_problem(name, value)
    elif kind == "str":
        if not isinstance(value, str):
            return f"{name} must be a string, got {value!r}"
        if name in CHOICES and value not in CHOICES[name]:
            return f"{name} must be one of {', '.join(map(repr, CHOICES[name]))}, got {value!r}"
    elif kind == "dict":
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            return f"{name} must be a mapping of strings, got {value!r}"
    elif kind in ("list", "backend"):  # names: their values are checked where they are known
        if not isinstance(value, (str, list, tuple)):
            return f"{name} must be a name or a list of names, got {value!r}"
    elif kind == "any" and not callable(value):
        return f"{name} must be a callable, got {value!r}"
    return None


def _int_problem(name: str, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{name} must be an integer, got {value!r}"
    if name in POSITIVE_INTS and value <= 0:
        return f"{name} must be a positive integer, got {value!r}"
    if name in NON_NEGATIVE_INTS and value < 0:
        return f"{name} must be an integer >= 0, got {value!r}"
    return None


def _float_problem(name: str, value: Any) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return f"{name} must be a number (seconds), got {value!r}"
    if not math.isfinite(value):
        return f"{name} must be a finite number, got {value!r}"
    if name in POSITIVE_FLOATS and value <= 0:
        return f"{name} must be > 0, got {value!r}"
    if name in NON_NEGATIVE_FLOATS and value < 0:
        return f"{name} must be >= 0, got {value!r}"
    return None
