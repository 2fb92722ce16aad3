"""verl-shaped YAML config with dotted command-line overrides.

``load_config(["trainer.total_steps=4", "+trainer.note=hi"])`` reads the packaged
``rollout.yaml`` and applies overrides: values are parsed as YAML (``4`` -> int, ``null`` ->
None, ``[a, b]`` -> list); ``+key=value`` adds a key that does not exist yet. Unknown keys fail
with :class:`ConfigKeyError`, whose message lists the valid keys at that level.
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from tracer.config import did_you_mean

DEFAULT_CONFIG = "rollout.yaml"


class ConfigKeyError(KeyError):
    """An override names a key that does not exist (message lists the valid keys)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def read_config_text(name: str = DEFAULT_CONFIG) -> str:
    """The text of a packaged config: ``config/`` beside this package in a source checkout
    (so a checkout's own config wins over an editable install's mapping to another tree),
    else ``rollout._config`` when installed."""
    path = Path(__file__).resolve().parent.parent / "config" / name
    if path.is_file():
        return path.read_text("utf-8")
    try:
        return resources.files("rollout._config").joinpath(name).read_text("utf-8")
    except (ModuleNotFoundError, FileNotFoundError):
        pass
    raise FileNotFoundError(f"config {name!r} not found (looked in {path}, rollout._config)")


def _parse_value(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_override(config: dict[str, Any], override: str) -> None:
    """Apply one ``a.b.c=value`` (or ``+a.b.c=value``) override to ``config`` in place."""
    if "=" not in override:
        raise ValueError(f"override {override!r} is not of the form key=value")
    key, _, raw = override.partition("=")
    add = key.startswith("+")
    parts = key.lstrip("+").strip().split(".")
    if not all(parts):
        raise ValueError(f"override {override!r} has an empty key part")
    node: Any = config
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[:depth]) or "<top level>"
        if not isinstance(node, dict):
            raise ConfigKeyError(f"cannot set {key!r}: {where} is not a section")
        if part not in node:
            if not add:
                valid = ", ".join(sorted(node)) or "(none)"
                raise ConfigKeyError(
                    f"unknown config key {'.'.join(parts[: depth + 1])!r}"
                    f"{did_you_mean(part, node)}; valid keys at "
                    f"{where}: {valid} (use +{key.lstrip('+')}=... to add a new key)"
                )
            node[part] = _parse_value(raw) if last else {}
        elif last:
            if add:
                raise ConfigKeyError(f"key {key.lstrip('+')!r} exists; override it without '+'")
            node[part] = _parse_value(raw)
        node = node[part]


def load_config(overrides: list[str] | None = None, path: str | None = None) -> dict[str, Any]:
    """Load the default config (or the YAML file ``path``) and apply ``overrides``."""
    text = Path(path).read_text("utf-8") if path else read_config_text()
    config = yaml.safe_load(text) or {}
    config = copy.deepcopy(config)
    for override in overrides or []:
        apply_override(config, override)
    _normalize(config)
    return config


def _normalize(config: dict[str, Any]) -> None:
    trainer = config.setdefault("trainer", {})
    if trainer.get("total_training_steps") is not None:  # verl's name wins when set
        trainer["total_steps"] = trainer["total_training_steps"]
    rollout = config["actor_rollout_ref"]["rollout"]
    if rollout["name"] not in ("hf", "vllm", "scripted"):
        raise ValueError(
            f"actor_rollout_ref.rollout.name={rollout['name']!r}; valid: hf, vllm, scripted"
        )
    for key in ("n", "response_length", "prompt_length"):
        value = rollout[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"actor_rollout_ref.rollout.{key} must be a positive int: {value!r}")
    from rollout.engines.structured import check_config
    from rollout.interaction import make_interaction  # fails at load: lists the valid names

    make_interaction((rollout.get("multi_turn") or {}).get("interaction"))
    check_config(rollout.get("multi_turn"), rollout["name"])  # tool_choice values, xgrammar


def trace_config(config: dict[str, Any]) -> dict[str, Any]:
    """The mapping for ``tracer.init``: the ``rollout.trace`` section plus project names."""
    trace = dict(config["actor_rollout_ref"]["rollout"].get("trace") or {})
    # null and [] in the section say nothing (config/rollout.yaml lists keys at their default):
    # $ROLLOUT_TRACER_<FIELD> and the options file may set them; any other value wins over both
    trace = {k: v for k, v in trace.items() if (v is not None and v != []) or k == "backend"}
    trace.setdefault("project_name", config["trainer"]["project_name"])
    trace.setdefault("experiment_name", config["trainer"]["experiment_name"])
    if trace.get("keep"):  # a GRPO group is decided as soon as its n rollouts are in
        trace.setdefault("keep_group_size", config["actor_rollout_ref"]["rollout"]["n"])
    return trace
