"""A step's live numbers for a TRL job of several processes (for :mod:`tracer.trl`'s ``log``).

Each process traces its own completions, so each holds part of a step. transformers' training
loop calls ``log()`` on every process at each logging step (and after each evaluation), so
:func:`step_metrics` is one collective that every process enters together: its
:func:`tracer.live.partial` goes in, the main process gets the merged numbers and logs them,
once for the whole job. Nothing is allowed to keep one process out of the collective: an error
while making a part travels as the error, and the others are not left waiting for it.
"""

from __future__ import annotations

from typing import Any


def step_metrics(accelerator: Any, step: int, validate: bool, traced: int,
                 timeout_s: float = 5.0) -> tuple[dict[str, float] | None, list[str]]:  # fmt: skip
    """(the merged numbers of ``step``, or None outside the main process; the errors of every
    process). ``traced``: this process's completions so far (``tracer/trl_completions`` adds
    them up). Every process of ``accelerator`` must call it at the same point."""
    from tracer import live

    mine: dict[str, Any] = {"traced": int(traced)}
    try:
        mine["part"] = live.partial(step, validate=validate, timeout_s=timeout_s)
    except Exception as exc:  # still goes into the collective: the others wait for this one
        mine["error"] = f"{type(exc).__name__}: {exc}"
    gathered = [mine]
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        gathered = list(gather_object([mine]))
    errors = [str(g["error"]) for g in gathered if "error" in g]
    if not accelerator.is_main_process:
        return None, errors
    parts = [g["part"] for g in gathered if "part" in g]
    out = live.metrics(live.merge(parts)) if parts else {}
    out["tracer/trl_completions"] = float(sum(int(g["traced"]) for g in gathered))
    out["tracer/trl_processes"] = float(len(gathered))
    return out, errors
