"""Rollout engines behind one async interface (see :mod:`rollout.engines.base`)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from rollout.engines.base import Engine, GenerateOutput, SamplingParams

__all__ = ["ENGINES", "Engine", "GenerateOutput", "SamplingParams", "make_engine"]

# name -> "module:Class"; imported lazily so vLLM / torch are only loaded when used
ENGINES: dict[str, str] = {
    "hf": "rollout.engines.hf:HFEngine",
    "vllm": "rollout.engines.vllm_engine:VllmEngine",
    "scripted": "rollout.engines.scripted:ScriptedEngine",
}


def _load(name: str) -> Any:
    module, _, attr = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def make_engine(config: Mapping[str, Any], **kwargs: Any) -> Engine:
    """Build the engine named by ``config["actor_rollout_ref"]["rollout"]["name"]``.

    ``config`` is the full verl-shaped config (a mapping). ``hf`` and ``vllm`` load the model at
    ``actor_rollout_ref.model.path`` via their ``from_config(config)`` or
    ``from_pretrained(path)``; ``scripted`` needs ``script=...`` in ``kwargs`` and uses the
    model path's tokenizer. Unknown names fail with the list of valid ones.
    """
    aro = config["actor_rollout_ref"]
    name = aro["rollout"]["name"]
    if name not in ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; valid: {', '.join(ENGINES)}")
    cls = _load(name)
    path = aro["model"]["path"]
    if name == "scripted":
        from rollout.models import load_tokenizer

        return cls(load_tokenizer(path), kwargs.pop("script", []), **kwargs)
    if hasattr(cls, "from_config"):
        return cls.from_config(config, **kwargs)
    if hasattr(cls, "from_pretrained"):
        return cls.from_pretrained(path, **kwargs)
    from rollout.models import resolve_model_path

    return cls(str(resolve_model_path(path)), **kwargs)
