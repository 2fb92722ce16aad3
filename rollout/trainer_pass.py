"""The trainer's side of a step, as verl's actor and reference workers do it after the rollout:
one forward pass over prompt + response per trajectory that recomputes every response token's
log-prob and the policy's entropy in the trainer's precision (bfloat16, against the float32
sampler), and the reference policy's log-probs; all attached to the traced trajectory with
``tracer.annotate`` in verl's whole-response layout (``response_mask``: 0 for tool and user
tokens). The gap between the trainer's and the engine's log-probs is the rollout-vs-trainer
mismatch (``rollout.mismatch``: verl's ``rollout_corr/*`` metrics).

The reference policy is the step-0 policy. ``rollout-tracer run`` does no gradient update, so
the policy never leaves step 0 and a frozen copy would equal the current weights: the
reference pass runs the rollout's own float32 weights (teacher-forced over the whole
sequence), and ``ref_kl`` here measures the bfloat16-vs-float32 gap of the same policy, not a
policy that drifted. In a real trainer the same code path shows the drift.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import tracer
from rollout.mismatch import rollout_corr_metrics

log = logging.getLogger("rollout.trainer_pass")


def recompute_logprobs(model: Any, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
    """log p(response token | everything before it) under ``model``, one per response token."""
    return forward(model, prompt_ids, response_ids, entropy=False)[0]


def forward(
    model: Any, prompt_ids: list[int], response_ids: list[int], entropy: bool = True
) -> tuple[list[float], list[float] | None]:
    """Log-probs of the response tokens and (``entropy``) the entropy of the policy at each
    response position, from one forward pass; computed in float32 from the model's logits."""
    import torch

    ids = torch.tensor([prompt_ids + response_ids])
    # only the positions that predict a response token go through the LM head (the same
    # values; ~14 % less time for SmolLM2 with a 400-token prompt)
    keep = len(response_ids) + 1
    with torch.inference_mode():
        try:
            out = model(ids, logits_to_keep=keep)
        except TypeError:  # a model class that does not take the argument
            out = model(ids)
        logits = out.logits[0, -keep:-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    target = torch.tensor(response_ids).unsqueeze(-1)
    lps = [float(x) for x in logp.gather(-1, target)[:, 0]]
    if not entropy:
        return lps, None
    ent = -(logp.exp() * logp).sum(-1)  # verl's entropy_from_logits
    return lps, [float(x) for x in ent]


def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 matrices natively (AVX512-BF16 or AMX, through
    oneDNN). False where it cannot tell (the check is PyTorch's own, not a public API)."""
    import torch

    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except Exception:
        return False


def bf16_matmuls_in_float32(model: Any) -> None:
    """Run this model's ``nn.Linear`` layers as a GPU's bfloat16 GEMM computes them: bfloat16
    inputs and weights, float32 products and sums, the result rounded to bfloat16. Every
    bfloat16 value is exact in float32, so only the order of the sums differs from a native
    kernel. Without native bfloat16, PyTorch falls back to a reference kernel ~6x slower than
    float32 (one SmolLM2 pass over 600 tokens: 14.7 s against 2.6 s this way, 2026-12-03), and
    that pass was a third of the main job. Only this model instance changes (its layers'
    ``forward``); everything else in it stays bfloat16."""
    import types

    import torch
    import torch.nn.functional as F

    def linear(self: Any, x: Any) -> Any:
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.forward = types.MethodType(linear, module)  # type: ignore[method-assign]


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


@dataclass
class StepTokens:
    """One step's per-token values over model tokens (loss_mask 1), one list per trajectory
    (sorted by sample_index, rollout_n): what the metrics and the heatmap are drawn from."""

    step: int
    labels: list[str] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)  # whole response, verl's layout
    rollout: list[list[float]] = field(default_factory=list)
    train: list[list[float]] = field(default_factory=list)
    ref: list[list[float]] = field(default_factory=list)


def _model_tokens(values: list[float], mask: list[int]) -> list[float]:
    return [v for v, m in zip(values, mask, strict=True) if m]


class TrainerPass:
    """``TrainerPass.from_config(config, engine)``; ``run(step_result)`` after each step."""

    def __init__(self, train_model: Any, ref_model: Any, num_threads: int | None = None) -> None:
        self.train_model = train_model
        self.ref_model = ref_model
        # torch threads while the pass runs (the hf engine's ``rollout.num_threads``: CPU
        # cores - 1); None: torch's own default. On 2 cores one thread was as fast as two
        # alone (main job 157 vs 160 s) and 12 % less CPU, and 21 % faster beside a busy
        # process (164 vs 207 s): a second thread spins for a core the machine does not have.
        self.num_threads = num_threads

    @classmethod
    def from_config(cls, config: dict[str, Any], engine: Any) -> TrainerPass | None:
        """None when ``trainer.recompute_log_probs`` is off or the engine has no policy (the
        scripted engine replays text)."""
        if not (config.get("trainer") or {}).get("recompute_log_probs"):
            return None
        if config["actor_rollout_ref"]["rollout"]["name"] == "scripted":
            log.info("trainer pass skipped: the scripted engine has no policy to recompute")
            return None
        from rollout.models import load_model

        path = config["actor_rollout_ref"]["model"]["path"]
        train, _ = load_model(path, dtype="bfloat16")
        if not native_bf16_matmul():
            bf16_matmuls_in_float32(train)
        ref = getattr(engine, "model", None)  # the hf engine's float32 weights, shared
        if ref is None or not callable(ref):
            ref, _ = load_model(path, dtype="float32")
        return cls(train, ref, getattr(engine, "num_threads", None))

    def run(self, result: Any) -> tuple[dict[str, float], StepTokens]:
        """Recompute, annotate every trajectory of the step, and return verl's
        ``rollout_corr/*`` metrics (when the engine's log-probs are there) with the values."""
        with _torch_threads(self.num_threads):
            return self._run(result)

    def _run(self, result: Any) -> tuple[dict[str, float], StepTokens]:
        tokens = StepTokens(int(result.step))
        outs = sorted(result.outputs, key=lambda o: (o.extra["sample_index"], o.extra["rollout_n"]))
        for out in outs:
            if not out.response_ids:
                continue
            train, entropy = forward(self.train_model, out.prompt_ids, out.response_ids)
            ref, _ = forward(self.ref_model, out.prompt_ids, out.response_ids, entropy=False)
            extra = out.extra
            tracer.annotate(
                step=extra["step"], sample_index=extra["sample_index"],
                rollout_n=extra["rollout_n"], validate=bool(extra.get("validate")),
                values={"train_logprob": train, "ref_logprob": ref, "entropy": entropy,
                        "response_mask": out.response_mask},
            )  # fmt: skip
            mask = out.response_mask
            tokens.labels.append(f"{extra['sample_index']}/{extra['rollout_n']}")
            tokens.masks.append(list(mask))
            tokens.train.append(_model_tokens(_f32(train), mask))
            tokens.ref.append(_model_tokens(_f32(ref), mask))
            if out.response_logprobs is not None:
                tokens.rollout.append(_model_tokens(_f32(out.response_logprobs), mask))
        metrics = {}
        if tokens.rollout and len(tokens.rollout) == len(tokens.train):
            metrics = rollout_corr_metrics(tokens.rollout, tokens.train)
        return metrics, tokens


@contextlib.contextmanager
def _torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads at ``n`` meanwhile (``None``: unchanged), then as they were."""
    import torch

    before = torch.get_num_threads()
    if n is None or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _f32(values: list[float]) -> list[float]:
    """As the tracer stores them (float32), so the metrics equal what a reader recomputes."""
    import array

    return array.array("f", values).tolist()
