"""verl's tracer API (``verl.utils.rollout_trace``) on top of ours, same names and signatures,
so code written for verl runs unchanged: swap the import, keep the calls."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tracer.core import init
from tracer.ops import trace_attr, trace_op


class RolloutTraceConfig:
    """verl: ``RolloutTraceConfig.init(project_name, experiment_name, backend, token2text)``."""

    @classmethod
    def init(
        cls,
        project_name: str,
        experiment_name: str,
        backend: str | list[str] | None,
        token2text: bool = False,
        max_samples_per_step_per_worker: int | None = None,
        **extra: Any,
    ) -> None:
        init(
            {
                "project_name": project_name,
                "experiment_name": experiment_name,
                "backend": backend,
                "token2text": token2text,
                "max_samples_per_step_per_worker": max_samples_per_step_per_worker,
                **extra,
            }
        )

    @classmethod
    def get_backend(cls) -> Any:
        from tracer.core import get_tracer

        backends = get_tracer().config.backends
        return backends[0] if len(backends) == 1 else (backends or None)

    @classmethod
    def enable_token2text(cls) -> bool:
        from tracer.core import get_tracer

        return bool(get_tracer().config.token2text)

    @classmethod
    def reset(cls) -> None:
        from tracer.core import reset

        reset()


def rollout_trace_attr(
    sample_index: Any = None,
    step: Any = None,
    rollout_n: Any = None,
    name: str = "rollout_trace",
    validate: bool = False,
    trace: bool = True,
) -> trace_attr:
    """verl's ``rollout_trace_attr``: same parameters, same order."""
    return trace_attr(
        step=step,
        sample_index=sample_index,
        rollout_n=rollout_n,
        validate=validate,
        name=name,
        trace=trace,
    )


def rollout_trace_op(func: Callable[..., Any]) -> Callable[..., Any]:
    """verl's bare decorator; the span kind is guessed from the function name."""
    name = func.__name__.lower()
    kind = "other"
    for needle, k in (
        ("generate", "generate"),
        ("tool", "tool"),
        ("reward", "reward"),
        ("score", "reward"),
        ("parse", "parse"),
        ("run", "trajectory"),
    ):
        if needle in name:
            kind = k
            break
    return trace_op(kind=kind)(func)
