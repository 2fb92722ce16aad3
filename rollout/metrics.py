"""Per-step rollout metrics: the raw numbers of one step (:class:`StepInputs`), how several
workers' raw numbers combine (:func:`aggregate`), and the metric dict the trackers log
(:func:`compute_metrics`).

Workers only collect; the driver aggregates and logs::

    inputs = collect(step_result, num_samples=4)          # on each worker (plain lists)
    merged = aggregate([w1_inputs, w2_inputs.to_dict()])  # on the driver
    metrics = compute_metrics(merged, tracer.metrics())   # {"rollout/reward/mean": 0.5, ...}

Metric names (all floats):

* ``rollout/reward/{mean,std,min,max}``, ``rollout/accuracy``
* ``rollout/response_length/{mean,min,max}`` (all response tokens: model + tool responses),
  ``rollout/generated_tokens/mean`` (model tokens only)
* ``rollout/turns/{mean,max}`` (assistant turns), ``rollout/user_turns/mean`` (interaction
  feedback turns), ``rollout/tool_calls/{mean,total}``,
  ``rollout/tool_error_rate`` (failed tool calls / tool calls)
* ``rollout/finish_reason/<reason>``: fraction of trajectories (stop, length, max_turns, ...)
* ``rollout/grpo/zero_std_group_frac``: fraction of GRPO groups (one prompt's ``n`` samples)
  whose rewards are all equal, i.e. groups with zero advantage; ``rollout/grpo/num_groups``
* ``rollout/num_trajectories``, ``perf/step_time_s``, ``perf/trajectories_per_s``,
  ``perf/tokens_per_s`` (generated tokens per second of step wall time)
* the tracer's own counters (``tracer/...``, from :func:`tracer.metrics`)

Values are converted with :func:`to_float`: Python numbers, numpy scalars and one-element
tensors/arrays become floats; anything else is skipped with one warning per key.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("rollout.metrics")

FINISH_REASONS = ("stop", "length", "max_turns")
SAMPLE_COLUMNS = ("step", "sample_index", "rollout_n", "prompt", "response", "reward",
                  "accuracy", "finish_reason", "turns", "tool_calls")  # fmt: skip


@dataclass
class StepInputs:
    """The raw numbers of one step on one worker: one entry per trajectory in every list.

    Plain Python values only, so it crosses process boundaries (Ray, pickle, JSON via
    :meth:`to_dict`)."""

    step: int
    rewards: list[float] = field(default_factory=list)
    accuracies: list[float] = field(default_factory=list)
    response_tokens: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    user_turns: list[int] = field(default_factory=list)  # interaction feedback turns
    tool_calls: list[int] = field(default_factory=list)
    tool_errors: list[int] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)  # GRPO group (prompt) of each trajectory
    elapsed_s: float = 0.0  # wall time of the step on this worker
    samples: list[dict[str, Any]] = field(default_factory=list)  # rows of SAMPLE_COLUMNS

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StepInputs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# ---------------------------------------------------------------- value conversion
_warned: set[str] = set()


def to_float(value: Any) -> float | None:
    """``value`` as a float: bool/int/float, numpy scalars, 0-d or one-element numpy arrays
    and torch tensors. ``None`` for anything else (strings, lists, multi-element tensors)."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    size = getattr(value, "size", None)
    numel = getattr(value, "numel", None)
    try:
        if callable(numel):  # torch.Tensor
            if numel() != 1:
                return None
            return float(value.detach().cpu().item())
        if size is not None and not callable(size) and int(size) != 1:
            return None  # numpy array with several elements
        item = getattr(value, "item", None)
        if callable(item):  # numpy scalar / 1-element array, jax, ...
            out = item()
            if isinstance(out, (bool, int, float)):
                return float(out)
    except Exception:
        return None
    return None


def clean_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Only the values :func:`to_float` converts; each skipped key is warned about once."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        number = to_float(value)
        if number is None:
            if key not in _warned:
                _warned.add(key)
                log.warning("metric %r skipped: %s is not a number", key, type(value).__name__)
            continue
        out[str(key)] = number
    return out


# ---------------------------------------------------------------- collect / aggregate
def _prompt_text(messages: Sequence[Mapping[str, Any]]) -> str:
    users = [m.get("content") for m in messages if m.get("role") == "user"]
    return str(users[0]) if users else ""


def _response_text(turns: Iterable[Any]) -> str:
    parts = []
    for turn in turns:
        text = getattr(turn, "text", "")
        role = getattr(turn, "role", "assistant")
        parts.append(text if role == "assistant" else f"[{role}] {text}")
    return "\n".join(parts)


def sample_row(out: Any) -> dict[str, Any]:
    """One samples-table row (prompt, response, reward, ...) of an ``AgentLoopOutput``."""
    reward = out.reward or {}
    return {
        "step": int(out.extra.get("step", 0)),
        "sample_index": int(out.extra.get("sample_index", 0)),
        "rollout_n": int(out.extra.get("rollout_n", 0)),
        "prompt": _prompt_text(out.messages),
        "response": _response_text(out.turns),
        "reward": to_float(reward.get("score")) if reward else None,
        "accuracy": to_float(reward.get("accuracy")) if reward else None,
        "finish_reason": str(out.finish_reason),
        "turns": int(out.num_assistant_turns),
        "tool_calls": int(out.tool_calls),
    }


def collect(result: Any, *, elapsed_s: float | None = None, num_samples: int = 0) -> StepInputs:
    """The :class:`StepInputs` of a ``StepResult`` (``result.step``, ``result.outputs``);
    ``num_samples`` rows for the samples table, the first ones by (sample_index, rollout_n)."""
    step = int(result.step)
    inputs = StepInputs(step=step)
    if elapsed_s is None:
        elapsed_s = float(getattr(result, "elapsed_s", 0.0) or 0.0)
    inputs.elapsed_s = float(elapsed_s)
    outputs = list(result.outputs)
    for out in outputs:
        reward = out.reward or {}
        score = to_float(reward.get("score")) if reward else None
        if score is not None:
            inputs.rewards.append(score)
        acc = to_float(reward.get("accuracy")) if reward else None
        if acc is not None:
            inputs.accuracies.append(acc)
        inputs.response_tokens.append(len(out.response_ids))
        inputs.generated_tokens.append(int(sum(out.response_mask)))
        inputs.turns.append(int(out.num_assistant_turns))
        inputs.user_turns.append(int(getattr(out, "num_user_turns", 0) or 0))
        inputs.tool_calls.append(int(out.tool_calls))
        inputs.tool_errors.append(int(out.tool_errors))
        inputs.finish_reasons.append(str(out.finish_reason))
        group = out.extra.get("sample_index", out.request_id.rsplit("-n", 1)[0])
        inputs.groups.append(f"{step}:{group}" if score is not None else "")
    if num_samples > 0:
        chosen = sorted(outputs, key=lambda o: (o.extra.get("sample_index", 0),
                                                o.extra.get("rollout_n", 0)))  # fmt: skip
        inputs.samples = [sample_row(o) for o in chosen[:num_samples]]
    return inputs


_LIST_FIELDS = ("rewards", "accuracies", "response_tokens", "generated_tokens", "turns",
                "user_turns", "tool_calls", "tool_errors", "finish_reasons", "groups")  # fmt: skip


def aggregate(
    per_worker: Sequence[StepInputs | Mapping[str, Any]], num_samples: int | None = None
) -> StepInputs:
    """Combine the :class:`StepInputs` (or their ``to_dict()``) of several workers for the
    same step: lists are concatenated, the step time is the slowest worker's (workers run
    concurrently), samples are the first ``num_samples`` (default: the most any worker sent)
    by (sample_index, rollout_n)."""
    items = [p if isinstance(p, StepInputs) else StepInputs.from_dict(p) for p in per_worker]
    if not items:
        raise ValueError("aggregate() needs the inputs of at least one worker")
    steps = {p.step for p in items}
    if len(steps) != 1:
        raise ValueError(f"aggregate() got inputs of different steps: {sorted(steps)}")
    merged = StepInputs(step=items[0].step)
    for p in items:
        for name in _LIST_FIELDS:
            getattr(merged, name).extend(getattr(p, name))
        merged.elapsed_s = max(merged.elapsed_s, float(p.elapsed_s))
    limit = max(len(p.samples) for p in items) if num_samples is None else num_samples
    samples = [s for p in items for s in p.samples]
    samples.sort(key=lambda s: (s.get("sample_index", 0), s.get("rollout_n", 0)))
    merged.samples = samples[:limit]
    return merged


# ---------------------------------------------------------------- metrics
def _stats(prefix: str, values: Sequence[float], which: Iterable[str]) -> dict[str, float]:
    if not values:
        return {}
    n = len(values)
    mean = sum(values) / n
    calc = {
        "mean": lambda: mean,
        "std": lambda: math.sqrt(sum((v - mean) ** 2 for v in values) / n),
        "min": lambda: float(min(values)),
        "max": lambda: float(max(values)),
    }
    return {f"{prefix}/{k}": float(calc[k]()) for k in which}


def zero_std_group_fraction(rewards: Sequence[float], groups: Sequence[str]) -> tuple[float, int]:
    """Fraction of groups (of two or more rewards) whose rewards are all equal, and the
    number of such groups."""
    by_group: dict[str, list[float]] = {}
    for reward, group in zip(rewards, groups, strict=False):
        if group:
            by_group.setdefault(group, []).append(reward)
    sized = [g for g in by_group.values() if len(g) >= 2]
    if not sized:
        return 0.0, 0
    zero = sum(1 for g in sized if max(g) - min(g) <= 1e-8)
    return zero / len(sized), len(sized)


def compute_metrics(
    inputs: StepInputs | Mapping[str, Any], tracer_metrics: Mapping[str, Any] | None = None
) -> dict[str, float]:
    """The metric dict of one step (names in the module docstring), floats only."""
    p = inputs if isinstance(inputs, StepInputs) else StepInputs.from_dict(inputs)
    n = len(p.finish_reasons)
    m: dict[str, float] = {"rollout/num_trajectories": float(n)}
    m.update(_stats("rollout/reward", p.rewards, ("mean", "std", "min", "max")))
    if p.accuracies:
        m["rollout/accuracy"] = sum(p.accuracies) / len(p.accuracies)
    m.update(_stats("rollout/response_length", p.response_tokens, ("mean", "min", "max")))
    m.update(_stats("rollout/generated_tokens", p.generated_tokens, ("mean",)))
    m.update(_stats("rollout/turns", p.turns, ("mean", "max")))
    m.update(_stats("rollout/user_turns", p.user_turns, ("mean",)))
    if n:
        calls = sum(p.tool_calls)
        m["rollout/tool_calls/mean"] = calls / n
        m["rollout/tool_calls/total"] = float(calls)
        m["rollout/tool_error_rate"] = sum(p.tool_errors) / calls if calls else 0.0
        reasons = dict.fromkeys(FINISH_REASONS, 0)
        for reason in p.finish_reasons:
            reasons[reason] = reasons.get(reason, 0) + 1
        for reason, count in reasons.items():
            m[f"rollout/finish_reason/{reason}"] = count / n
    # collect() leaves the group of a trajectory without a reward empty: the rest align
    groups = [g for g in p.groups if g]
    frac, num_groups = zero_std_group_fraction(p.rewards, groups)
    m["rollout/grpo/zero_std_group_frac"] = frac
    m["rollout/grpo/num_groups"] = float(num_groups)
    m["perf/step_time_s"] = float(p.elapsed_s)
    if p.elapsed_s > 0:
        m["perf/trajectories_per_s"] = n / p.elapsed_s
        m["perf/tokens_per_s"] = sum(p.generated_tokens) / p.elapsed_s
    if tracer_metrics:
        m.update(clean_metrics(tracer_metrics))
    return m
