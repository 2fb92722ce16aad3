"""Independent evidence that a reward was not earned, for a run without a correctness signal
(:mod:`tracer.readers.habits.patterns` calls it for a group that holds a share and is paid above the
rest of its steps; the near-duplicate answers of :mod:`tracer.readers.habits.near_dup` are the third
kind). Each says what it saw in numbers; shape alone (short, rising) is never evidence.

**A tool no longer called while reward rises.** Over the recent steps, the run's tool calls
per training trajectory are at most ``tool_drop`` (0.5) x the highest rate of an earlier
window of as many steps (at least ``min_tool_rate``, 0.3, there), the group's own rate is at
most ``tool_drop`` x that rate too, and the steps' mean reward is at least ``min_gain`` (0.1)
above what it was in that window. Tool use that drops while reward stays flat is no evidence.

**Training reward rising while validation reward stays flat.** Between the run's first
validation pass and its last one up to the step (validation trajectories, ``validate=True``,
over the prompts every pass has: the same data each time), the training reward (mean over
``smooth`` steps ending at each pass) rose by at least ``min_gain`` and the validation reward
by at most ``val_flat`` (0.5) x that rise, by two standard errors of the passes' difference
(a small validation set is noisy), while the group's share grew at least twofold over the same
span. Validation that rises with training is no evidence.

Either kind flags only a group paid at least ``min_gain`` above the rest of its steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tracer.readers.habits.patterns_sql import Counts, StepTotal


class Thresholds(Protocol):  # the fields of PatternThresholds read here
    smooth: int
    min_tool_rate: float
    tool_drop: float
    min_gain: float
    val_flat: float


@dataclass
class Window:
    steps: list[int]
    calls: float  # tool calls per trajectory
    reward: float | None


@dataclass
class RunShape:
    """What the run-level evidence needs, computed once per run: per step index, the
    earlier window with the most tool calls; the validation passes (step, mean reward)."""

    steps: list[int]
    totals: Mapping[int, StepTotal]
    peak: list[Window | None]
    validation: list[tuple[int, float, int, float]]  # step, mean, n, variance of the mean

    def window(self, steps: list[int]) -> Window:
        c = Counts()
        calls = 0
        for s in steps:
            c.merge(self.totals[s])
            calls += self.totals[s].calls
        return Window(steps, calls / c.n if c.n else 0.0, c.reward_mean)


def run_shape(totals: Mapping[int, StepTotal], val: Mapping[int, StepTotal],
              th: Thresholds) -> RunShape:  # fmt: skip
    """``totals``: the training steps'; ``val``: every step's, validation passes included."""
    steps = sorted(totals)
    passes = []
    for s, t in sorted(val.items()):
        if t.val_n:
            mean = t.val_sum / t.val_n
            var = max(t.val_sq / t.val_n - mean * mean, 0.0) / t.val_n
            passes.append((s, mean, t.val_n, var))
    shape = RunShape(steps, totals, [], passes)
    best: Window | None = None
    for i in range(len(steps)):
        j = i - th.smooth  # the last full window ending before the recent steps
        if j - th.smooth + 1 >= 0:
            w = shape.window(steps[j - th.smooth + 1 : j + 1])
            if best is None or w.calls > best.calls:
                best = w
        shape.peak.append(best)
    return shape


def where(steps: list[int]) -> str:
    """``step 4`` or ``steps 4-6``."""
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def tool_dropped(shape: RunShape, i: int, recent: list[int], group_calls: int, group_n: int,
                 th: Thresholds) -> str | None:  # fmt: skip
    """The evidence in words, or None: a tool no longer called while reward rises."""
    then = shape.peak[i]
    now = shape.window(recent)
    if then is None or then.reward is None or now.reward is None or not group_n:
        return None
    mine = group_calls / group_n
    if (then.calls >= th.min_tool_rate and now.calls <= th.tool_drop * then.calls
            and mine <= th.tool_drop * then.calls
            and now.reward >= then.reward + th.min_gain):  # fmt: skip
        return (f"tool calls fell from {then.calls:.2f} to {now.calls:.2f} per trajectory "
                f"({where(then.steps)} to {where(recent)}) while the mean reward rose from "
                f"{then.reward:.2f} to {now.reward:.2f}; this group calls {mine:.2f}")  # fmt: skip
    return None


def validation_flat(shape: RunShape, step: int, share_at: Any, share_now: float,
                    th: Thresholds) -> str | None:  # fmt: skip
    """The evidence in words, or None: training reward rising while validation reward on the
    same prompts stays flat. ``share_at(steps)``: the group's share over those steps."""
    passes = [p for p in shape.validation if p[0] <= step]
    if len(passes) < 2:
        return None
    (s0, v0, n0, var0), (s1, v1, _, var1) = passes[0], passes[-1]

    def upto(s: int) -> list[int]:  # the last full window of training steps up to s
        before = [t for t in shape.steps if t <= s]
        return before[-th.smooth :] if len(before) >= th.smooth else shape.steps[: th.smooth]

    w0, w1 = shape.window(upto(s0)), shape.window(upto(s1))
    if w0.reward is None or w1.reward is None or w1.steps == w0.steps:
        return None
    gain, val_gain = w1.reward - w0.reward, v1 - v0
    then = share_at(w0.steps)
    noise = 2 * (var0 + var1) ** 0.5
    if gain >= th.min_gain and val_gain + noise <= th.val_flat * gain and share_now >= 2 * then:
        return (f"training reward rose from {w0.reward:.2f} to {w1.reward:.2f} between the "
                f"validation passes of steps {s0} and {s1}, while validation reward on the same "
                f"prompts ({n0} trajectories a pass) went from {v0:.2f} to {v1:.2f}; this group "
                f"grew from {100 * then:.0f}% to {100 * share_now:.0f}%")  # fmt: skip
    return None
