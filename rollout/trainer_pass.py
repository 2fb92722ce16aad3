"""A stand-in for the trainer's recompute after the rollout, as verl's actor does it: one
forward pass over prompt + response in another precision (bfloat16 against the float32
sampler), the log-prob of every response token, attached to the traced trajectory with
``tracer.annotate`` in verl's whole-response layout (``response_mask``: 0 for tool and user
tokens). The gap between these and the engine's log-probs is the rollout-vs-trainer mismatch.
"""

from __future__ import annotations

from typing import Any

import tracer


def recompute_logprobs(model: Any, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """log p(response token | everything before it) under ``model``, one per response token."""
    import torch

    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    target = torch.tensor(response_ids).unsqueeze(-1)
    return [float(x) for x in torch.log_softmax(logits, dim=-1).gather(-1, target)[:, 0]]


def annotate_step(result: Any, model: Any) -> int:
    """Recompute and attach ``train_logprob`` for every trajectory of a ``StepResult``;
    returns how many were handed to the tracer."""
    handed = 0
    for out in result.outputs:
        if not out.response_ids:
            continue
        train = recompute_logprobs(model, out.prompt_ids, out.response_ids)
        extra = out.extra
        handed += tracer.annotate(
            step=extra["step"], sample_index=extra["sample_index"], rollout_n=extra["rollout_n"],
            values={"train_logprob": train, "response_mask": out.response_mask},
        )  # fmt: skip
    return handed
